"""sample.py's ``--base-dtype``, ``--offload`` and ``--idle-expert``, through its entry point on tiny checkpoints: offload
changes no bit of a clip, fp8 changes it, ``auto`` samples as the run trained (its model.base_dtype and
model.offload), and the memory check prices what the flags keep on the device.

Clips are compared through the PNG grid sample.py writes (what a user looks at), as
tests/test_sample_cli.py does. Plants seen to fail: ``store_for_sampling`` ignoring ``--offload``
(no offloader: the spy), ignoring ``--base-dtype`` (fp8 grid equal to precision's), ``resolve_lowmem``
not reading the run's config (auto unequal to the explicit fp8 grid), the offloader freeing a block
before its forward (empty weights: the run fails), sample.py not passing the sampler to the memory
check (the fitting run exits 2), ``weight_bytes`` pricing offloaded blocks as resident. Of
``--idle-expert``: no offload at construction (the 'start' bytes), ``auto`` ignoring the run's
model.idle_expert (no host made), the pre-hook keeping the other expert (the byte counter), the
memory check ignoring where the idle expert waits (the fitting run exits 2), and
``idle_expert_bytes`` pricing the blocks in flight (by hand).
"""

from __future__ import annotations

from pathlib import Path

import imageio.v2 as imageio
import numpy as np
import pytest
import torch
from conftest import tiny_overrides
from test_lora import TINY, lora_overrides, make_wan

import sample
from dit import block_offload, expert_offload
from dit.config import load_config
from dit.trainer import Trainer

SMALL = [
    "--frames",
    "1",
    "--height",
    "8",
    "--width",
    "8",
    "--steps",
    "2",
    "--grid",
    "--prompt",
    "a red circle",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{'lora': a 2-step LoRA run on an fp8_scaled base with every block offloaded, on a random Wan
    (non-zero head, so the base shows in the clip); 'full': a full tiny run, moved off its zero init}."""
    tmp = tmp_path_factory.mktemp("sample_lowmem")
    make_wan().save_pretrained(tmp / "wan")
    extra = {"model.base_dtype": "fp8_scaled", "model.offload": "blocks", "model.gradient_checkpointing": True,
             "train.sample_every": 0, "train.ema_decay": 0, "train.max_steps": 2}  # fmt: skip
    lora = Trainer(load_config(TINY, lora_overrides(tmp, "lora", **extra)), device=torch.device("cpu"))
    lora.train()
    cfg = load_config(TINY, tiny_overrides(tmp / "full", **{"train.ema_decay": 0}))
    torch.manual_seed(0)
    full = Trainer(cfg, device=torch.device("cpu"))
    with torch.no_grad():  # an initial model predicts zero velocity (zero-initialised output layer)
        for p in full.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    full.save()
    return {"lora": Path(lora.cfg.output_dir), "full": Path(cfg.output_dir)}


@pytest.fixture(scope="module")
def pair_run(tmp_path_factory) -> Path:
    """A tiny two-expert run (model.expert=both) that trained with model.idle_expert=cpu, its weights
    moved off their zero init so each expert shows in the clip."""
    tmp = tmp_path_factory.mktemp("sample_idle")
    both = {"model.expert": "both", "model.boundary_ratio": 0.875, "flow.shift": 5.0, "train.ema_decay": 0,
            "model.idle_expert": "cpu"}  # fmt: skip
    cfg = load_config(TINY, tiny_overrides(tmp / "pair", **both))
    torch.manual_seed(0)
    trainer = Trainer(cfg, device=torch.device("cpu"))
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    trainer.save()
    return Path(cfg.output_dir)


@pytest.fixture
def idle_hosts(monkeypatch):
    """Every IdleExpertHost sample.py makes, with (expert run, the other's device bytes, its own) read
    from the tensors at each expert's forward, once the pre-hook has placed them; first ('start', the
    low expert's, the high's) as the first forward finds them."""
    made = []

    class Spy(expert_offload.IdleExpertHost):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.seen = []
            made.append(self)

        def _before(self, module, name):
            other = "low" if name == "high" else "high"
            if not self.seen:  # the first forward finds the low expert on the host already
                self.seen.append(("start", self.device_bytes("low"), self.device_bytes("high")))
            super()._before(module, name)
            self.seen.append((name, self.device_bytes(other), self.device_bytes(name)))

    monkeypatch.setattr(expert_offload, "IdleExpertHost", Spy)
    return made


def test_the_idle_expert_waits_on_the_host_and_changes_no_bit(pair_run, tmp_path, idle_hosts):
    """2 steps at shift 5 around the 0.875 boundary: t=1000 (high), then t=833 (low), each expert
    brought in for its own steps while the other's bytes on the device are 0; the clip is the one
    both experts on the device give, fp8 and offloaded blocks or not."""
    auto = _grid(pair_run, tmp_path)  # the run's model.idle_expert=cpu
    (host,) = idle_hosts
    assert [n for n, *_ in host.seen] == ["start", "high", "low"], host.seen
    assert all(other == 0 and own > 0 for _, other, own in host.seen), host.seen
    np.testing.assert_array_equal(auto, _grid(pair_run, tmp_path, "--idle-expert", "device"))
    assert len(idle_hosts) == 1
    low = ["--base-dtype", "fp8_scaled", "--offload", "blocks"]
    np.testing.assert_array_equal(
        _grid(pair_run, tmp_path, *low), _grid(pair_run, tmp_path, *low, "--idle-expert", "device")
    )
    assert len(idle_hosts) == 2 and all(other == 0 for _, other, _own in idle_hosts[1].seen)


def test_the_memory_check_prices_the_idle_expert_where_it_waits(pair_run, tmp_path, capsys):
    """--memory-gb that holds one expert's fp32 weights and a request, not two experts': only
    --idle-expert cpu fits, and the refusal names it."""
    from dit.sampler_setup import load_checkpoint_sampler
    from dynamic_cp.planning.memory import weight_bytes
    from dynamic_cp.planning.model_dims import ModelDims

    model = load_checkpoint_sampler(str(pair_run), "model", None, 1.0, "cpu").model
    dims = ModelDims.from_config(model.config, text_tokens=model.config.text_pad_len or 64)
    one = weight_bytes(dims, value_bytes=4)  # an expert's fp32 weights
    per_token = (16 * dims.d + 2 * dims.ffn) * 4
    working = 16.5 * per_token  # (1, 8, 8) in 1x2x2 patches, unguided: 16 tokens, and half spare
    assert one > working  # two experts leave not one token
    limit = ["--memory-gb", str((one + working) / 0.9 / 1e9), "--guidance", "1"]
    _grid(pair_run, tmp_path, *limit, "--idle-expert", "device", code=2)
    err = capsys.readouterr().err
    assert "do not fit" in err and "--idle-expert cpu keeps it on the host" in err, err
    _grid(pair_run, tmp_path, *limit)  # auto: the run's cpu
    from dit.sizes import MODEL_SIZES
    from dynamic_cp.planning.memory import block_params
    from dynamic_cp.runtime.sampling_plan import idle_expert_bytes

    wan = ModelDims.from_config(MODEL_SIZES["wan-14b"], text_tokens=512)  # an A14B expert: 40 blocks
    per_block, rest = block_params(wan), wan.num_params - wan.layers * block_params(wan)
    assert idle_expert_bytes(wan, 1, 2, None, 0) == 2 * wan.num_params  # bf16, all on the device
    assert idle_expert_bytes(wan, 4, 2, None, 0) == 2 * wan.num_params / 4  # its FSDP shard
    # offloaded blocks wait on the host whole while the expert is idle: none in flight
    assert idle_expert_bytes(wan, 1, 2, 1, 40) == pytest.approx(2 * rest)
    assert idle_expert_bytes(wan, 1, 2, 1, 30) == pytest.approx(2 * rest + 1 * per_block * 10)


@pytest.fixture
def offloaders(monkeypatch):
    """Every BlockOffloader sample.py makes, recorded."""
    made = []

    class Spy(block_offload.BlockOffloader):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(block_offload, "BlockOffloader", Spy)
    return made


def _grid(run, tmp_path, *flags, code: int = 0) -> np.ndarray | None:
    out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
    assert (
        sample.main(["--checkpoint", str(run), "--weights", "model", "--out", str(out), *SMALL, *flags])
        == code
    )
    return imageio.imread(next(out.glob("*.png"))) if code == 0 else None


def test_offload_is_bitwise_and_fp8_takes_effect_on_a_full_run(runs, tmp_path, offloaders):
    fp8 = _grid(runs["full"], tmp_path, "--base-dtype", "fp8_e4m3")
    assert offloaders == []  # a full run trained without offload: auto is none
    np.testing.assert_array_equal(
        fp8, _grid(runs["full"], tmp_path, "--base-dtype", "fp8_e4m3", "--offload", "blocks")
    )
    (one,) = offloaders
    assert one.swapped == {0, 1} and 1 <= one.peak_blocks <= 2 and one.device_bytes() == 0  # all freed after
    plain = _grid(runs["full"], tmp_path)  # auto: the run's model.base_dtype (auto), its DiT's dtype
    assert not np.array_equal(plain, fp8)
    np.testing.assert_array_equal(
        plain, _grid(runs["full"], tmp_path, "--offload", "blocks", "--offload-blocks", "1")
    )
    assert offloaders[-1].swapped == {1}


def test_a_lora_run_samples_as_it_trained_and_offload_changes_no_bit(runs, tmp_path, offloaders):
    auto = _grid(runs["lora"], tmp_path)  # the run's fp8_scaled base, its blocks offloaded
    (one,) = offloaders
    assert one.swapped == {0, 1} and one.peak_blocks >= 1
    np.testing.assert_array_equal(
        auto, _grid(runs["lora"], tmp_path, "--base-dtype", "fp8_scaled", "--offload", "none")
    )
    assert len(offloaders) == 1
    np.testing.assert_array_equal(auto, _grid(runs["lora"], tmp_path, "--offload-blocks", "1"))
    precision = _grid(runs["lora"], tmp_path, "--base-dtype", "precision", "--offload", "none")
    assert not np.array_equal(auto, precision)
    assert not np.array_equal(auto, _grid(runs["lora"], tmp_path, "--base-dtype", "fp8_e4m3"))


def test_memory_check_prices_fp8_and_offloaded_blocks(runs, tmp_path, capsys):
    """--memory-gb between the fp32 weights and the fp8, offloaded ones (the memory model's own
    ``weight_bytes``, plus one request's working set): only the low-memory sampling fits."""
    from dit.sampler_setup import load_checkpoint_sampler
    from dynamic_cp.planning.memory import block_params, weight_bytes
    from dynamic_cp.planning.model_dims import ModelDims

    model = load_checkpoint_sampler(str(runs["lora"]), "model", None, 1.0, "cpu").model
    dims = ModelDims.from_config(model.config, text_tokens=model.config.text_pad_len or 64)
    plain, low = (
        weight_bytes(dims, value_bytes=4),
        weight_bytes(dims, value_bytes=4, base_bytes=1, offload_blocks=2),
    )
    per_block, rest = block_params(dims), dims.num_params - dims.layers * block_params(dims)
    assert low == pytest.approx(4 * rest + 1 * per_block * 2) and plain == 4 * dims.num_params  # by hand
    assert weight_bytes(dims, value_bytes=4, offload_blocks=2) == plain  # two blocks in flight: all of 2
    per_token = (16 * dims.d + 2 * dims.ffn) * 4  # one block's fp32 working set a token
    working = 16.5 * per_token  # (1, 8, 8) in 1x2x2 patches, unguided: 16 tokens, and half a token spare
    memory_gb = (low + working) / 0.9 / 1e9  # 90% of it planned for
    assert plain - low > working  # fp32 weights leave not one token: "do not fit", not a request's cap
    limit = ["--memory-gb", str(memory_gb), "--guidance", "1"]  # one branch: 16 tokens
    _grid(runs["lora"], tmp_path, *limit, "--base-dtype", "precision", "--offload", "none", code=2)
    err = capsys.readouterr().err
    assert "do not fit" in err and "--base-dtype fp8_scaled --offload blocks" in err, err
    _grid(runs["lora"], tmp_path, *limit)  # the run's fp8 base, its blocks offloaded: fits
    with pytest.raises(ValueError, match="replicated weights"):
        weight_bytes(dims, shards=2, base_bytes=1)
    from dit.sizes import MODEL_SIZES

    wan = ModelDims.from_config(MODEL_SIZES["wan-14b"], text_tokens=512)  # 40 blocks: 2 of 40 in flight
    per_block, rest = block_params(wan), wan.num_params - wan.layers * block_params(wan)
    assert weight_bytes(wan, base_bytes=1, offload_blocks=40) == pytest.approx(2 * rest + 1 * per_block * 2)
    assert weight_bytes(wan, offload_blocks=7) == pytest.approx(2 * rest + 2 * per_block * 35)


def test_a_rerun_with_another_base_dtype_writes_its_own_clip(runs, tmp_path):
    """fp8 changes the clip, so it is part of the clip's key; offload is not (the same clip)."""
    out = tmp_path / "same"
    argv = ["--checkpoint", str(runs["full"]), "--weights", "model", "--out", str(out), *SMALL]
    for flags in ([], ["--offload", "blocks"], ["--base-dtype", "fp8_scaled"]):
        assert sample.main([*argv, *flags]) == 0
    assert len(list(out.glob("*.mp4"))) == 2


def test_bad_offload_blocks_and_torchrun_are_one_line(runs, tmp_path, capsys, monkeypatch):
    _grid(runs["lora"], tmp_path, "--offload-blocks", "3", code=2)
    err = capsys.readouterr().err
    assert err == "error: --offload-blocks 3: the model has 2 blocks; use 0 to 2\n", err
    monkeypatch.setenv("WORLD_SIZE", "2")
    _grid(runs["lora"], tmp_path, "--offload", "blocks", code=2)
    err = capsys.readouterr().err
    assert (
        err.startswith("error: --base-dtype/--offload/--offload-blocks/--idle-expert sample on one process")
        and err.count("\n") == 1
    )
    _grid(runs["lora"], tmp_path, "--idle-expert", "cpu", code=2)
    assert "--idle-expert sample on one process" in capsys.readouterr().err
    monkeypatch.delenv("WORLD_SIZE")
    _grid(runs["full"], tmp_path, "--idle-expert", "cpu", code=2)  # one transformer: nothing idle
    err = capsys.readouterr().err
    assert err.startswith("error: --idle-expert cpu: this model has one transformer") and err.count("\n") == 1


def test_help_names_the_flags(capsys):
    with pytest.raises(SystemExit):
        sample.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for words in [
        "--base-dtype {auto,fp8_e4m3,fp8_scaled,precision}",
        "the transformer blocks' linear weights stored in fp8",
        "auto: the run's model.base_dtype when fp8, else precision",
        "--offload {auto,none,blocks}",
        "auto: blocks when the run trained with model.offload, else none",
        "--offload-blocks OFFLOAD_BLOCKS",
        "how many blocks --offload keeps on the host (default: all)",
        "--idle-expert {auto,cpu,device}",
        "auto: cpu when the run trained with model.idle_expert=cpu, else device",
        "``--base-dtype fp8_scaled`` stores the blocks' weights in fp8",
    ]:
        assert words in text, words
