"""Wan2.2 A14B's two experts as one sampling model, switching where diffusers' WanPipeline does.

    model = ExpertPair(high, low, boundary_ratio=0.875)   # high: transformer/, low: transformer_2/

``WanPipeline`` / ``WanImageToVideoPipeline`` run ``transformer`` while the scheduler's timestep
t >= boundary_ratio * 1000 and ``transformer_2`` below, with ``guidance_scale_2`` there
(``dit.sampling.guidance_at``). Every branch and shard of one denoising step shares its t, so a
forward call is one expert's; the sampler (``dit/sampling.py``, ``dynamic_cp/runtime/sampling.py``)
calls this module as it calls one VideoDiT. Training takes one expert (``model.expert``,
``dit.flow.sample_expert_sigma``), or both (``model.expert: both``, ``dit/expert_training.py``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from dit.flow import on_expert_side


class ExpertPair(nn.Module):
    def __init__(self, high: nn.Module, low: nn.Module, boundary_ratio: float):
        super().__init__()
        mismatch = [
            k
            for k in ("patch_size", "in_channels", "out_channels", "text_dim")
            if high.config[k] != low.config[k]
        ]
        if mismatch:
            raise ValueError(
                f"the two experts differ in {mismatch[0]} ({high.config[mismatch[0]]} vs "
                f"{low.config[mismatch[0]]}); transformer/ and transformer_2/ must come from one Wan2.2 model"
            )
        self.high, self.low = high, low
        self.boundary_ratio = float(boundary_ratio)

    @property
    def config(self):
        """The experts' shared shape (patch, channels, widths): the high expert's config."""
        return self.high.config

    def expert_name_at(self, timesteps: torch.Tensor) -> str:
        """'high' or 'low': the expert the pipeline runs at ``timesteps`` (b,), or at one scalar t."""
        high = on_expert_side(timesteps.float(), "high", self.boundary_ratio)
        assert bool(high.all()) or not bool(high.any()), "one forward call mixes the experts' timesteps"
        return "high" if bool(high.all()) else "low"

    def expert_at(self, timesteps: torch.Tensor) -> nn.Module:
        return getattr(self, self.expert_name_at(timesteps))

    def save_pretrained(self, directory) -> None:
        """A Wan2.2 A14B-shaped folder: ``transformer/`` (high), ``transformer_2/`` (low) and a
        model_index.json with the switch, which model.pretrained (and model.expert) reads back."""
        from pathlib import Path

        from dit.wan_pipeline_folders import EXPERT_FOLDERS

        directory = Path(directory)
        for name, folder in EXPERT_FOLDERS.items():
            getattr(self, name).save_pretrained(directory / folder)
        self.write_index(directory)

    def write_index(self, directory) -> None:
        """The model_index.json that marks ``directory`` as two experts switching at the boundary."""
        import json
        from pathlib import Path

        cls = ["dit.model", type(self.high).__name__]
        index = {"transformer": cls, "transformer_2": cls, "boundary_ratio": self.boundary_ratio}
        (Path(directory) / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")

    def forward(self, x, positions, seq_lens, timesteps, *args, **kwargs):
        """VideoDiT's forward, run by the expert that the pipeline runs at ``timesteps`` (b,)."""
        return self.expert_at(timesteps)(x, positions, seq_lens, timesteps, *args, **kwargs)
