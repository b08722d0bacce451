"""fp8 base weights (dit/fp8_base.py): exact dequantised forward, the e4m3 error bound, per-row
scales against outliers, gradients to adapters only, and torch._scaled_mm parity on CPU.

Plants seen to fail: a scale applied twice in ``dequantize`` (the error-bound test); a norm cast to
fp8 by ``store_base_in_fp8``, by type or its values rounded through fp8 in place
(test_only_block_linears_are_fp8...); ``_FP8Matmul.backward`` using the
weight without its scale (the gradient test); the trainer leaving the base in bf16 (the run test).
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model
from torch import nn

from dit.fp8_base import E4M3 as FP8
from dit.fp8_base import FP8Linear, dequantize, quantize, store_base_in_fp8
from dit.model_config import ModelConfig


class _Block(nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.to_q = nn.Linear(dim, dim)
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, dim))

    def forward(self, x):
        return self.to_q(self.norm(x)) + self.scale_shift_table[0, 0]


class _Net(nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList([_Block(dim), _Block(dim)])
        self.proj_out = nn.Linear(dim, dim)

    def forward(self, x):
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.proj_out(x)


def _bound(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # e4m3 has 3 stored mantissa bits: round-to-nearest of a normal value (|w/s| >= 2^-6) errs by at
    # most half a unit in the last place, 2^-3 / 2 = 2^-4 of the value. Below 2^-6 the spacing is the
    # subnormal step 2^-9, so the absolute error is at most 2^-10 (in units of the scale). The fp32
    # product fp8 * scale adds one rounding of 2^-24 relative, covered by the factor 1.0001.
    return (2.0**-4 * w.abs() + 2.0**-10 * scale) * 1.0001


@pytest.mark.parametrize("per_row", [False, True])
def test_error_within_e4m3_bound(per_row):
    torch.manual_seed(0)
    w = torch.randn(64, 48) * torch.logspace(-3, 1, 48)  # magnitudes over 4 decades, subnormals too
    w8, scale = quantize(w, per_row)
    assert w8.dtype == FP8
    err = (dequantize(w8, scale, torch.float32) - w).abs()
    assert bool((err <= _bound(w, scale)).all()), float((err - _bound(w, scale)).max())


def test_forward_equals_linear_on_dequantised_weight_exactly():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        lin = nn.Linear(48, 40).to(dtype).requires_grad_(False)
        fp8 = FP8Linear(lin, per_row=True, compute_dtype=dtype)
        x = torch.randn(7, 48, dtype=dtype)
        ref = nn.functional.linear(x, dequantize(fp8.weight_fp8, fp8.weight_scale, dtype), lin.bias)
        assert torch.equal(fp8(x), ref)


def test_scaled_beats_per_tensor_with_row_outliers():
    torch.manual_seed(0)
    w = torch.randn(32, 64) * 0.02
    w[torch.arange(32), torch.randint(0, 64, (32,))] = torch.logspace(-1, 2, 32)  # one outlier per row
    errs = {pr: float((dequantize(*quantize(w, pr), torch.float32) - w).norm()) for pr in (False, True)}
    assert errs[True] < 0.5 * errs[False], errs


def test_only_block_linears_are_fp8_and_adapters_get_grads():
    torch.manual_seed(0)
    net = _Net().requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=4, target_modules=["to_q"], init_lora_weights=False), net)
    for n, p in net.named_parameters():
        p.requires_grad_(".lora_" in n)
    with torch.no_grad():  # norms' own weights (a fresh one is all 1.0: exact in fp8 too)
        for block in net.blocks:
            block.norm.weight.uniform_(0.5, 1.5)
    before = {n: t.clone() for n, t in net.named_parameters()}
    assert store_base_in_fp8(net, per_row=True, compute_dtype=torch.float32) == 2
    for n, t in net.named_parameters():  # every tensor that is not a block linear's weight: untouched
        assert torch.equal(t, before[n]) and t.dtype == before[n].dtype, n  # (a norm rounded via fp8 fails)
    for n, t in [*net.named_parameters(), *net.named_buffers()]:
        assert (t.dtype == FP8) == n.endswith("weight_fp8"), n  # norms, tables, embed, head, adapters
        if t.dtype == FP8:
            assert ".base_layer." in n, n
    net(torch.randn(5, 32)).square().sum().backward()
    grads = {n: p.grad is not None for n, p in net.named_parameters()}
    assert all(g == (".lora_" in n) for n, g in grads.items()), grads
    assert any(grads.values())


def test_scaled_mm_parity_on_cpu():
    """Correctness, not speed: torch._scaled_mm against fp32 matmul of the dequantised operands.
    Products of two e4m3 values (4 significant bits each) are exact in fp32; only the K-term sum
    rounds, so |diff| <= K * 2^-24 * sum|a_ik b_kj| (the factor 2 covers the order of summation)."""
    torch.manual_seed(0)
    x, w = torch.randn(8, 64), torch.randn(16, 64)
    x8, sx = quantize(x, per_row=False)
    w8, sw = quantize(w, per_row=False)
    got = torch._scaled_mm(
        x8, w8.t(), scale_a=sx.reshape(()), scale_b=sw.reshape(()), out_dtype=torch.float32
    )
    a, b = x8.float() * sx, w8.float() * sw
    ref = a @ b.t()
    bound = 2 * 64 * 2.0**-24 * (a.abs() @ b.abs().t())
    assert bool(((got - ref).abs() <= bound).all())


def test_bad_base_dtype_is_one_line():
    with pytest.raises(ValueError, match="model.base_dtype='fp16'; choose one of"):
        ModelConfig(base_dtype="fp16")
    with pytest.raises(ValueError, match="set model.lora"):
        ModelConfig(base_dtype="fp8_scaled")  # full training keeps fp32 master weights


def test_backward_equals_linear_on_dequantised_weight_exactly():
    torch.manual_seed(0)
    lin = nn.Linear(48, 40).requires_grad_(False)
    fp8 = FP8Linear(lin, per_row=True, compute_dtype=torch.float32)
    x = torch.randn(7, 48, requires_grad=True)
    fp8(x).square().sum().backward()
    ours, x.grad = x.grad, None
    w = dequantize(fp8.weight_fp8, fp8.weight_scale, torch.float32)
    nn.functional.linear(x, w, lin.bias).square().sum().backward()
    assert torch.equal(ours, x.grad)


def test_a_lora_run_on_an_fp8_base_trains_and_resumes_exactly(tmp_path):
    """A 3-step LoRA run on a random Wan base stored in fp8 (model.pretrained, quantised at load): the
    adapters move, only they train, a resume from step 2 ends bitwise equal, and the exported LoRA has
    the same keys as one trained on a bf16 base (under bf16 autocast) (adapters alone, diffusers' format)."""
    from safetensors.torch import load_file
    from test_lora import TINY, lora_overrides, make_wan

    from dit.config import load_config
    from dit.trainer import Trainer

    make_wan().save_pretrained(tmp_path / "wan")
    extra = {"model.base_dtype": "fp8_scaled", "train.sample_every": 0, "train.ema_decay": 0}

    def run(out, resume=None, **more):
        cfg = load_config(TINY, lora_overrides(tmp_path, out, **{**extra, **more}))
        trainer = Trainer(cfg, resume=resume, device=torch.device("cpu"))
        start = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        trainer.train()
        return trainer, start

    whole, start = run("whole")
    assert (
        sum(isinstance(m, FP8Linear) for m in whole.model.modules()) == 2 * 10
    )  # 2 blocks x (self- and cross-attention q, k, v, out + 2 FFN)
    live = {n: p for n, p in whole.model.named_parameters() if p.requires_grad}
    assert live and all(".lora_" in n for n in live)
    assert any(not torch.equal(start[n], p) for n, p in live.items()), "the adapters never moved"
    resumed, _ = run("resumed", resume=str(tmp_path / "whole" / "checkpoints" / "step_000002"))
    for n, p in resumed.model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, live[n]), n
    with pytest.raises(ValueError, match="train.mixed_precision=bf16"):
        run("bf16", **{"model.base_dtype": "bf16"})  # fp32 compute on CPU: one dtype per F.linear
    run("bf16", **{"model.base_dtype": "bf16", "train.mixed_precision": "bf16", "train.max_steps": 1})
    keys = {k for k in load_file(str(tmp_path / "whole" / "pytorch_lora_weights.safetensors"))}
    assert keys == set(load_file(str(tmp_path / "bf16" / "pytorch_lora_weights.safetensors")))


def test_scales_by_hand_a_zero_row_and_the_plain_linears_of_a_block():
    """Mutation-driven (tools/mutation.py dit/fp8_base.py): the scale is amax / 448 exactly, also for
    a row whose amax is under 1; a row of zeros gets scale 1 and values 0 (not 0 / 0); a block's
    own nn.Linear (no peft around it) is converted; ``.weight`` is the dequantised matrix; the repr
    names the storage; ``base_storage_dtype`` maps the names."""
    from dit.fp8_base import base_storage_dtype

    w = torch.tensor([[0.5, -0.25], [0.0, 0.0], [3.0, 1.0]])
    values, scale = quantize(w, per_row=True)
    assert torch.equal(scale, torch.tensor([[0.5 / 448], [1.0], [3.0 / 448]]))
    assert torch.equal(values[1].float(), torch.zeros(2)) and values.float().abs().amax() == 448
    net = _Net().requires_grad_(False)  # frozen: what store_base_in_fp8 converts
    assert store_base_in_fp8(net, per_row=False, compute_dtype=torch.float32) == 2
    layer = net.blocks[0].to_q
    assert isinstance(layer, FP8Linear) and "fp8 e4m3 per-tensor, compute torch.float32" in repr(layer)
    assert torch.equal(layer.weight, dequantize(layer.weight_fp8, layer.weight_scale, torch.float32))
    assert base_storage_dtype("fp8_scaled", torch.float32) == torch.float32
    assert base_storage_dtype("bf16", torch.bfloat16) == torch.bfloat16
    assert base_storage_dtype("fp32", torch.bfloat16) == torch.float32
