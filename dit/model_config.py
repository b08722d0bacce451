"""The ``model:`` section of the training configuration: which network, its weights, LoRA, experts,
and how its frozen base is stored (fp8) and placed (offload)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoraSettings:
    rank: int = 16  # LoRA rank r of every adapted layer
    alpha: float | None = None  # LoRA alpha; the update is scaled by alpha / rank; None = rank (scale 1)
    # module names (suffixes, as peft matches them) to adapt; the default is what diffusers' and
    # finetrainers' Wan LoRA scripts train; 'ffn.net.0.proj', 'ffn.net.2', 'proj_out' also work
    target_modules: list = field(default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"])
    dropout: float = 0.0  # dropout on the adapter input during training

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"model.lora.rank={self.rank} must be a positive integer")
        if self.alpha is not None and self.alpha <= 0:
            raise ValueError(f"model.lora.alpha={self.alpha} must be positive (or null for alpha = rank)")
        if not self.target_modules or not all(isinstance(t, str) and t for t in self.target_modules):
            raise ValueError(
                f"model.lora.target_modules={self.target_modules!r} must be a non-empty list of module "
                "names, e.g. [to_q, to_k, to_v, to_out.0]"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.lora.dropout={self.dropout} must be in [0, 1)")


@dataclass
class ModelConfig:
    size: str = "tiny"  # a name in dit.sizes.MODEL_SIZES
    overrides: dict = field(default_factory=dict)  # VideoDiT config fields that replace the size's values
    pretrained: str | None = None  # local directory with our or a diffusers Wan transformer to start from
    gradient_checkpointing: bool = False  # recompute block activations in backward to save memory
    lora: LoraSettings | None = None  # train LoRA adapters on a frozen base (see dit/lora.py); None = full
    lora_init: str | None = None  # a diffusers-format Wan LoRA file or folder to continue training from
    # torch.compile each transformer block (dynamic shapes; attention stays eager): dit/compile.py
    compile: bool = False
    # Wan2.2 A14B: train one expert, 'high' (the pipeline's transformer/, t >= boundary_ratio * 1000)
    # or 'low' (transformer_2/, below); each clip's timestep is drawn on its side. 'both' trains the
    # two in one run, each micro-batch routed to the expert on whose side its clips' timesteps fall,
    # each expert with its own optimizer, LR schedule and EMA. None = one model
    expert: str | None = None
    # model.expert=both: where the expert that runs no micro-batch of a step waits, for the memory
    # model and --dry-run: 'sharded' (kept like the other, FSDP-sharded under parallel.fsdp) or 'cpu'
    # (its weights and optimizer states offloaded to host memory)
    idle_expert: str = "sharded"
    # the expert switch on the shifted schedule (0.875 T2V-A14B, 0.9 I2V-A14B); None = the
    # model_index.json of model.pretrained
    boundary_ratio: float | None = None
    # the frozen LoRA base (dit/fp8_base.py): auto (compute dtype), bf16, fp32, fp8_e4m3 (one scale
    # per matrix) or fp8_scaled (one per row): the blocks' linears in 1 byte a weight
    base_dtype: str = "auto"
    # the frozen base in host memory (dit/block_offload.py): 'none', 'blocks' (offload_blocks of the
    # transformer blocks, each copied in around its forward and its recompute in backward) or
    # 'blocks+activations' (the checkpointed block inputs wait on the host too)
    offload: str = "none"
    offload_blocks: int | str = "auto"  # how many blocks live on the host; auto: the fewest that fit

    def __post_init__(self):
        from dit.block_offload import check_offload
        from dit.flow import EXPERTS
        from dit.fp8_base import check_base_dtype
        from dit.sizes import MODEL_SIZES

        check_base_dtype(self.base_dtype, self.lora is not None)
        check_offload(self)
        if self.expert is not None and self.expert not in (*EXPERTS, "both"):
            raise ValueError(
                f"model.expert={self.expert!r} is not an expert; choose 'high' (transformer/, high noise), "
                "'low' (transformer_2/, low noise) or 'both', or null for a one-model checkpoint"
            )
        if self.idle_expert not in ("sharded", "cpu"):
            raise ValueError(
                f"model.idle_expert={self.idle_expert!r}; choose 'sharded' (kept with the other) or 'cpu' "
                "(offloaded while the other runs)"
            )
        if self.boundary_ratio is not None and not 0.0 < self.boundary_ratio < 1.0:
            raise ValueError(
                f"model.boundary_ratio={self.boundary_ratio} must be in (0, 1), e.g. 0.875 (Wan2.2 T2V-A14B) "
                "or 0.9 (I2V-A14B)"
            )
        if self.boundary_ratio is not None and self.expert is None:
            raise ValueError(
                f"model.boundary_ratio={self.boundary_ratio} splits the timesteps between two experts; set "
                "model.expert=high, low or both too (or drop model.boundary_ratio)"
            )

        if self.size not in MODEL_SIZES:
            raise ValueError(f"model.size={self.size!r} is unknown; choose one of {sorted(MODEL_SIZES)}")
        if self.lora_init is not None and self.lora is None:
            raise ValueError(
                f"model.lora_init={self.lora_init} needs model.lora set (e.g. model.lora={{}}) to train the "
                "adapter it loads"
            )
