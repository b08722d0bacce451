"""train.fp8 (dit/fp8_train.py): the settings' checks, the refusals (CPU, capability < 8.9, LoRA,
torchao missing), which linears of a real VideoDiT convert, and, where torchao is installed
(``.[fp8]``), torchao's Float8Linear on CPU (``torch._scaled_mm`` runs there) against the bf16 matmul
within a bound derived from e4m3's mantissa.

Plants seen to fail: the filter letting the embedders and the head through (``"blocks" in fqn``
instead of a path component: test_the_blocks_linears_convert...), the 16-multiple rule dropped
(the odd-FFN test), the CPU refusal removed (test_refused_on_cpu...), ``convert_to_fp8`` ignoring the
recipe (the per-recipe config test), the fp8 all-gather turned on for rowwise.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from dit.fp8_train import check_fp8_runs, check_fp8_settings, convert_to_fp8, fp8_filter, fp8_targets
from dit.model import VideoDiT
from dit.sizes import MODEL_SIZES

TINY = {**MODEL_SIZES["tiny"], "num_layers": 2}
BLOCK_LINEARS = ["attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k",
                 "attn2.to_v", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2"]  # fmt: skip


def _torchao():
    return pytest.importorskip("torchao.float8", reason="torchao is the optional extra .[fp8]")


def test_settings_are_checked_with_the_fix():
    from dit.config import TrainConfig

    with pytest.raises(ValueError, match=r"^train.fp8='yes' must be true or false$"):
        TrainConfig(fp8="yes")
    with pytest.raises(ValueError, match=r"^train.fp8_recipe='axiswise'; choose one of tensorwise, rowwise$"):
        TrainConfig(fp8=True, fp8_recipe="axiswise")
    assert TrainConfig(fp8=True, fp8_recipe="rowwise").fp8_recipe == "rowwise"
    check_fp8_settings(False, "tensorwise")


def test_refused_on_cpu_with_one_line_naming_the_fix():
    check_fp8_runs(False, False, torch.device("cpu"))  # off: nothing to check
    with pytest.raises(ValueError) as e:
        check_fp8_runs(True, False, torch.device("cpu"))
    assert "\n" not in str(e.value)
    assert "device is cpu: set train.fp8=false" in str(e.value) and "8.9+" in str(e.value)
    with pytest.raises(ValueError, match="a LoRA base is frozen: set train.fp8=false.*fp8_scaled"):
        check_fp8_runs(True, True, torch.device("cpu"))


def test_refused_below_capability_8_9_and_without_torchao(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (8, 0))
    with pytest.raises(ValueError, match=r"A100 has compute capability 8.0, fp8 matmuls need 8.9\+"):
        check_fp8_runs(True, False, cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (8, 9))  # L40S: passes the bar
    monkeypatch.setitem(sys.modules, "torchao", None)  # `import torchao.float8` raises ImportError
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ValueError) as e:
        check_fp8_runs(True, False, cuda)
    assert str(e.value) == (
        'train.fp8=true needs torchao: pip install -c constraints.txt -e ".[fp8]", or set train.fp8=false'
    )


def test_the_trainer_refuses_before_building(tmp_path):
    from conftest import tiny_overrides
    from test_lora import TINY as TINY_YAML

    from dit.config import load_config
    from dit.trainer import Trainer

    cfg = load_config(
        TINY_YAML, tiny_overrides(tmp_path, **{"output_dir": str(tmp_path / "o"), "train.fp8": "true"})
    )
    with pytest.raises(ValueError, match="train.fp8=true needs fp8 matmuls"):
        Trainer(cfg, device=torch.device("cpu"))
    assert not (tmp_path / "o").exists()


def test_the_blocks_linears_convert_and_not_the_embedders_or_head():
    model = VideoDiT(**TINY)
    assert fp8_targets(model) == [f"blocks.{i}.{n}" for i in range(2) for n in BLOCK_LINEARS]
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert "proj_out" in linears and "patch_embedding" in linears  # left in their dtype
    assert "condition_embedder.time_proj" in linears
    # an expert pair's names are high.blocks.N...
    from dit.experts import ExpertPair

    pair = ExpertPair(VideoDiT(**TINY), VideoDiT(**TINY), 0.875)
    assert fp8_targets(pair) == [f"{e}.blocks.{i}.{n}" for e in ("high", "low") for i in range(2)
                                 for n in BLOCK_LINEARS]  # fmt: skip


def test_a_dimension_not_a_multiple_of_16_stays_out():
    model = VideoDiT(**{**TINY, "ffn_dim": 72})  # 128 -> 72 -> 128: _scaled_mm needs multiples of 16
    names = fp8_targets(model)
    assert "blocks.0.ffn.net.0.proj" not in names and "blocks.0.ffn.net.2" not in names
    assert "blocks.0.attn1.to_q" in names
    assert not fp8_filter(nn.Linear(16, 24), "blocks.0.x") and not fp8_filter(nn.Linear(24, 16), "blocks.0.x")
    assert fp8_filter(nn.Linear(16, 32), "blocks.0.x") and not fp8_filter(nn.Linear(16, 32), "blocks")
    assert fp8_filter(nn.Linear(16, 32), "blocks.x")  # any depth below blocks
    assert not fp8_filter(nn.LayerNorm(16), "blocks.0.norm")


class _OneLinear(nn.Module):
    def __init__(self, k, n):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(k, n, bias=False))])

    def forward(self, x):
        return self.blocks[0](x)


def _bound(x: torch.Tensor, w: torch.Tensor, per_row: bool) -> torch.Tensor:
    """|fp8 matmul - exact| for y = x @ w.T, elementwise (n, out), from e4m3's 3 mantissa bits.

    Each operand element v (in units of its scale s) becomes v + e, |e| <= 2^-4 |v| + 2^-10 s: half a
    unit in the last place of a normal (2^-3 / 2), or of the subnormal step 2^-9 below 2^-6. torchao's
    scale is amax / 448, or (rowwise) that rounded up to a power of two: s <= 2 amax / 448 covers
    both. Then |x^ w^ - x w| <= |e_x||w| + |x||e_w| + |e_x||e_w|, summed over k. The product's fp32
    accumulation adds k 2^-24 of sum |x||w|, and the bf16 output one rounding, 2^-8 of |y|."""
    ax, aw = x.float().abs(), w.float().abs()
    dims = dict(dim=1, keepdim=True) if per_row else {}
    sx = 2 * ax.amax(**dims) / 448  # (n, 1) rowwise, () tensorwise
    sw = 2 * aw.amax(**dims) / 448  # (out, 1)
    ex, ew = 2.0**-4 * ax + 2.0**-10 * sx, 2.0**-4 * aw + 2.0**-10 * sw
    e = ex @ aw.T + ax @ ew.T + ex @ ew.T + x.shape[1] * 2.0**-24 * (ax @ aw.T)
    return e + 2.0**-8 * ((x.float() @ w.float().T).abs() + e)  # |y^| <= |y| + e before rounding


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_linear_on_cpu_within_the_e4m3_bound(recipe):
    _torchao()
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    k, n = 128, 48
    model = _OneLinear(k, n).to(torch.bfloat16)
    w = model.blocks[0][0].weight.detach().clone()
    x = (torch.randn(64, k) * torch.logspace(-2, 1, k)).to(torch.bfloat16)  # 3 decades: subnormals too
    assert convert_to_fp8(model, recipe) == ["blocks.0.0"]
    assert type(model.blocks[0][0]) is Float8Linear
    y = model(x)
    assert y.dtype == torch.bfloat16
    err = (y.float() - x.float() @ w.float().T).abs()
    assert (err <= _bound(x, w, recipe == "rowwise")).all(), float(
        (err - _bound(x, w, recipe == "rowwise")).max()
    )
    ref = (x.float() @ w.float().T).abs().max()
    assert err.max() > 2.0**-8 * ref  # above bf16's own output rounding: the operands went through e4m3


def test_a_converted_video_dit_trains_on_cpu_with_fp32_master_weights():
    _torchao()
    from dit.attention import PackedAttention
    from dit.packing import pack

    torch.manual_seed(0)
    model = VideoDiT(**TINY, adaln_zero_init=False)
    names = convert_to_fp8(model, "tensorwise")
    kinds = {n: type(m).__name__ for n, m in model.named_modules()}
    assert {kinds[n] for n in names} == {"Float8Linear"} and kinds["proj_out"] == "Linear"
    packed = pack([torch.randn(3, 3, 8, 8), torch.randn(3, 1, 4, 8)], (1, 2, 2))  # 48 + 8 tokens
    text, t = torch.randn(7, TINY["text_dim"]), torch.tensor([900.0, 10.0])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(packed.tokens, packed.positions, packed.seq_lens, t, text, torch.tensor([5, 2]),
                    PackedAttention(packed.seq_lens))  # fmt: skip
    out.float().square().mean().backward()
    w = model.blocks[0].attn1.to_q.weight
    assert w.dtype == torch.float32 and w.grad is not None and w.grad.dtype == torch.float32
    assert torch.isfinite(w.grad).all() and w.grad.abs().sum() > 0


def test_recipes_and_the_fsdp_all_gather_reach_torchao():
    _torchao()
    got = {}
    for recipe in ("tensorwise", "rowwise"):
        for gather in (False, True):
            model = _OneLinear(32, 32)
            convert_to_fp8(model, recipe, fsdp_all_gather=gather)
            got[recipe, gather] = model.blocks[0][0].config
    default = _OneLinear(32, 32)
    convert_to_fp8(default, "tensorwise")  # no FSDP unless told
    assert not default.blocks[0][0].config.enable_fsdp_float8_all_gather
    assert got["tensorwise", True].enable_fsdp_float8_all_gather
    assert not got["tensorwise", False].enable_fsdp_float8_all_gather
    assert not got["rowwise", True].enable_fsdp_float8_all_gather  # torchao gathers rowwise in bf16
    gran = {r: str(got[r, False].cast_config_weight.scaling_granularity) for r in ("tensorwise", "rowwise")}
    assert "TENSORWISE" in gran["tensorwise"] and "AXISWISE" in gran["rowwise"]


def test_fsdp_scales_hook_only_with_float8_linears():
    from dynamic_cp.runtime.fsdp import fp8_scales_after_step

    plain = _OneLinear(32, 32)
    opt = torch.optim.AdamW(plain.parameters())
    assert fp8_scales_after_step(opt, plain) is opt and not opt._optimizer_step_post_hooks
    _torchao()
    convert_to_fp8(plain, "tensorwise", fsdp_all_gather=True)
    opt = torch.optim.AdamW(plain.parameters())
    assert fp8_scales_after_step(opt, plain) is opt and len(opt._optimizer_step_post_hooks) == 1
    plain(torch.randn(4, 32)).sum().backward()
    opt.step()  # the hook runs torchao's precompute: a no-op on weights that are not FSDP shards
