"""LoRA (dit/lora.py) against diffusers' own Wan LoRA code, on small random models of the real classes.

- identity: a fresh adapter (B = 0) leaves the output within 1e-7 of the base;
- a LoRA trained here for 3 steps on a random WanTransformer3DModel (through model.pretrained), with
  alpha != rank and patch-embedding / FFN / output targets, loads into diffusers' WanTransformer3DModel
  the way ``WanPipeline.load_lora_weights`` does, and both compute the same outputs (1e-5, fp32) for
  one clip and for packed clips;
- the reverse: adapters added with peft to a diffusers Wan model and saved by diffusers (pipeline and
  model functions), or written in DiffSynth-Studio's key names, load here with equal outputs;
- checkpoints hold only the adapters (and their EMA), the base stays frozen, resume is bitwise;
- merged export, model.lora_init, sample.py --lora, validation clips in metrics.jsonl.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_overrides
from diffusers import WanTransformer3DModel
from diffusers.loaders import WanLoraLoaderMixin
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from safetensors import safe_open

import sample
from dit import lora
from dit.attention import PackedAttention
from dit.config import load_config
from dit.model_config import LoraSettings
from dit.packing import pack, unpack
from dit.trainer import Trainer
from dit.wan_import import import_wan_state_dict, load_pretrained

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
TOL = 1e-5
TEXT_DIM = 16
WAN = dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=3, out_channels=3, text_dim=TEXT_DIM,
    freq_dim=32, ffn_dim=40, num_layers=2,
)  # fmt: skip
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2", "patch_embedding", "proj_out"]
CLIPS = [(3, 3, 6, 10), (3, 1, 4, 2), (3, 5, 2, 6)]  # (c, f, h, w): odd frames, no square


def make_wan(seed: int = 0) -> WanTransformer3DModel:
    torch.manual_seed(seed)
    return WanTransformer3DModel(**WAN).eval()


def batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    clips = [torch.randn(*s, generator=g) for s in CLIPS]
    texts = [torch.randn(n, TEXT_DIM, generator=g) for n in (5, 8, 1)]
    return clips, texts, torch.tensor([999.0, 1.0, 437.5])


@torch.no_grad()
def ours(model, clips, texts, timesteps) -> list[torch.Tensor]:
    packed = pack(clips, model.patch_size)
    text, lens = torch.cat(texts), torch.tensor([t.shape[0] for t in texts])
    out = model(packed.tokens, packed.positions, packed.seq_lens, timesteps, text, lens,
                PackedAttention(packed.seq_lens))  # fmt: skip
    return unpack(packed, out, model.patch_size)


@torch.no_grad()
def theirs(wan, clips, texts, timesteps, pad: int) -> list[torch.Tensor]:
    """diffusers on each clip alone, the caption zero-padded as the Wan pipeline pads it."""
    return [
        wan(c[None], t[None], torch.cat([x, x.new_zeros(pad - len(x), TEXT_DIM)])[None]).sample[0]
        for c, x, t in zip(clips, texts, timesteps)
    ]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def imported(wan) -> torch.nn.Module:
    return import_wan_state_dict(
        wan.config, {k: v.clone() for k, v in wan.state_dict().items()}, text_pad_len=8
    )


@torch.no_grad()
def randomize(params) -> None:
    g = torch.Generator().manual_seed(7)
    for p in params:
        p.copy_(0.1 * torch.randn(p.shape, generator=g))


def test_fresh_adapter_is_the_identity():
    model = imported(make_wan())
    clips, texts, t = batch()
    before = ours(model, clips, texts, t)
    lora.freeze_base(model, torch.float32)
    params = lora.add_lora(model, lora.peft_config(LoraSettings(rank=4, alpha=8, target_modules=TARGETS)))
    assert params and all(p.requires_grad for p in params)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [
        n for n, _ in model.named_parameters() if ".lora_" in n
    ]
    assert max_diff(ours(model, clips, texts, t), before) <= 1e-7


def test_target_that_matches_nothing_is_an_error():
    model = imported(make_wan())
    with pytest.raises(ValueError, match="target_modules"):
        lora.add_lora(model, lora.peft_config(LoraSettings(target_modules=["to_qq"])))


# ----------------------------------------------------------------------------- a trained LoRA


def lora_overrides(tmp: Path, out: str, **extra) -> list[str]:
    return tiny_overrides(
        tmp,
        **{
            "output_dir": str(tmp / out),
            "model.overrides": "{}",
            "model.pretrained": str(tmp / "wan"),
            "model.lora": "{rank: 4, alpha: 8, target_modules: [" + ", ".join(TARGETS) + "]}",
            "data.num_val_clips": 1,
            "flow.val_sigmas": "[0.5]",
            "train.global_batch_size": 3,
            "train.lr": 1e-2,
            "train.max_steps": 3,
            "train.checkpoint_every": 2,
            "train.val_every": 100,
            "train.ema_decay": 0.5,
            "train.sample_every": 3,
            "train.sample_prompts": "[a red circle moving right on a black background]",
            "train.sample_shape": "[1, 8, 8]",
            "train.sample_steps": 2,
            **extra,
        },
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 3-step LoRA run on a random Wan (checkpoints at 2 and 3), and one resumed from step 2."""
    tmp = tmp_path_factory.mktemp("lora")
    make_wan().save_pretrained(tmp / "wan")
    whole = Trainer(load_config(TINY, lora_overrides(tmp, "whole")), device=torch.device("cpu"))
    whole.train()
    resumed = Trainer(
        load_config(TINY, lora_overrides(tmp, "resumed")),
        resume=str(tmp / "whole" / "checkpoints" / "step_000002"),
        device=torch.device("cpu"),
    )
    resumed.train()
    return tmp, whole, resumed


def test_only_adapters_train_and_resume_is_exact(trained):
    tmp, whole, resumed = trained
    names = [n for n, p in whole.model.named_parameters() if p.requires_grad]
    assert names and all(".lora_" in n for n in names)
    assert (
        len(whole.trainable_parameters())
        == len(names)
        == sum(len(g["params"]) for g in whole.optimizer.param_groups)
    )
    assert set(whole.ema.state) == set(names)  # the EMA holds adapters only, no copy of the base
    base = load_pretrained(tmp / "wan").state_dict()
    live = whole.model.state_dict()
    for key, value in base.items():  # the frozen base did not move
        assert torch.equal(live[key.replace(".weight", ".base_layer.weight").replace(".bias", ".base_layer.bias")]
                           if key not in live else live[key], value), key  # fmt: skip
    step = tmp / "whole" / "checkpoints" / "step_000003"
    assert sorted(p.name for p in (step / "model").iterdir()) == [lora.WEIGHT_NAME]
    assert sorted(p.name for p in (step / "ema").iterdir()) == [lora.WEIGHT_NAME]
    a, b = dict(whole.model.named_parameters()), dict(resumed.model.named_parameters())
    # every adapter trained (a forward that bypassed one, e.g. a fused q/k/v GEMM over the base
    # weights, would leave its B at zero and the diffusers comparison blind to it)
    untrained = [n for n in names if "lora_B" in n and not a[n].abs().max() > 0]
    assert not untrained, f"training left B at zero: {untrained}"
    for n in names:
        assert torch.equal(a[n], b[n]), n
        assert torch.equal(whole.ema.state[n], resumed.ema.state[n]), n


def test_trained_lora_loads_in_diffusers_with_equal_outputs(trained):
    tmp, whole, _ = trained
    file = tmp / "whole" / lora.WEIGHT_NAME  # the run's final export (EMA adapters)
    with safe_open(file, framework="pt") as f:
        keys = list(f.keys())
        meta = json.loads(f.metadata()["lora_adapter_metadata"])
    assert "transformer.blocks.0.attn1.to_q.lora_A.weight" in keys and all(
        k.startswith("transformer.") for k in keys
    )
    assert meta["transformer.r"] == 4 and meta["transformer.lora_alpha"] == 8
    # what WanPipeline.load_lora_weights(folder) does
    wan = make_wan()
    state, metadata = WanLoraLoaderMixin.lora_state_dict(str(tmp / "whole"), return_lora_metadata=True)
    WanLoraLoaderMixin.load_lora_into_transformer(state, transformer=wan, metadata=metadata)
    clips, texts, t = batch()
    pad = whole.model.config.text_pad_len
    want = theirs(wan, clips, texts, t, pad)
    with whole.ema_weights() as model:  # the export's (a 3-step EMA is not what sampling takes)
        model.eval()
        assert max_diff(ours(model, clips, texts, t), want) <= TOL  # packed clips
        assert max_diff(ours(model, clips[:1], texts[:1], t[:1]), want[:1]) <= TOL  # one clip
    assert max_diff(want, theirs(make_wan(), clips, texts, t, pad)) > 1e-3  # the LoRA changes the output
    # merged export: a full diffusers transformer folder computing the same function
    merged = load_pretrained(tmp / "wan")
    lora.load_lora(merged, file)
    lora.merge_lora(merged)
    assert not any(".lora_" in n for n, _ in merged.named_parameters())
    assert (
        lora.main(["merge", "--base", str(tmp / "wan"), "--lora", str(file), "--out", str(tmp / "merged")])
        == 0
    )
    assert_same(load_pretrained(tmp / "merged"), merged)
    plain = WanTransformer3DModel.from_pretrained(tmp / "merged").eval()
    assert max_diff(theirs(plain, clips, texts, t, pad), want) <= TOL


def assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _diffsynth(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers keys -> DiffSynth-Studio's: original Wan module names with peft's .default. infix."""
    names = [("attn1.", "self_attn."), ("attn2.", "cross_attn."), ("to_q.", "q."), ("to_k.", "k."),
             ("to_v.", "v."), ("to_out.0.", "o."), ("ffn.net.0.proj.", "ffn.0."), ("ffn.net.2.", "ffn.2.")]  # fmt: skip
    out = {}
    for key, value in state.items():
        for a, b in names:
            key = key.replace(a, b)
        out[key.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")] = value
    return out


@pytest.mark.parametrize("saver", ["pipeline", "model", "diffsynth"])
def test_lora_saved_by_diffusers_loads_here(saver, tmp_path):
    from safetensors.torch import save_file

    wan = make_wan()
    targets = TARGETS if saver != "diffsynth" else TARGETS[:6]  # DiffSynth's files adapt blocks only
    alpha = 5 if saver != "diffsynth" else 3  # DiffSynth trains at scale 1 and saves no alpha
    wan.add_adapter(LoraConfig(r=3, lora_alpha=alpha, target_modules=targets))
    randomize(p for n, p in wan.named_parameters() if ".lora_" in n)
    if saver == "pipeline":  # diffusers' training scripts
        WanLoraLoaderMixin.save_lora_weights(
            tmp_path, transformer_lora_layers=get_peft_model_state_dict(wan),
            transformer_lora_adapter_metadata=wan.peft_config["default"].to_dict(),
        )  # fmt: skip
    elif saver == "model":
        wan.save_lora_adapter(tmp_path)
    else:
        save_file(_diffsynth(get_peft_model_state_dict(wan)), tmp_path / lora.WEIGHT_NAME)
    clips, texts, t = batch()
    want = theirs(wan, clips, texts, t, 8)
    model = imported(make_wan())
    lora.load_lora(model, tmp_path)
    assert max_diff(ours(model, clips, texts, t), want) <= TOL
    lora.set_lora_scale(model, 0.0)  # --lora-scale 0 is the base
    assert max_diff(ours(model, clips, texts, t), theirs(make_wan(), clips, texts, t, 8)) <= TOL


def test_lora_init_continues_from_a_file(trained):
    tmp, whole, _ = trained
    file = tmp / "whole" / "checkpoints" / "step_000003" / "model" / lora.WEIGHT_NAME
    cfg = load_config(TINY, lora_overrides(tmp, "cont", **{"model.lora_init": str(file)}))
    trainer = Trainer(cfg, device=torch.device("cpu"))
    a, b = dict(whole.model.named_parameters()), dict(trainer.model.named_parameters())
    names = [n for n, p in b.items() if p.requires_grad]
    assert names and all(torch.equal(a[n], b[n]) for n in names)
    bad = load_config(
        TINY, lora_overrides(tmp, "bad", **{"model.lora_init": str(file), "model.lora.rank": 8})
    )
    with pytest.raises(ValueError, match="model.lora.rank=8"):
        Trainer(bad, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="needs model.lora"):
        load_config(TINY, [f"model.lora_init={file}"])


def test_validation_clips_and_sample_cli(trained, tmp_path):
    tmp, _, _ = trained
    records = [json.loads(x) for x in (tmp / "whole" / "metrics.jsonl").read_text().splitlines()]
    sampled = {r["step"]: r["samples"] for r in records if "samples" in r}
    assert sorted(sampled) == [0, 3]  # before training and at the sample_every / last step
    for paths in sampled.values():
        assert any(p.endswith(".mp4") for p in paths) and any(p.endswith(".png") for p in paths)
        assert all(Path(p).is_file() for p in paths)
    args = ["--checkpoint", str(tmp / "whole"), "--prompt", "a red circle", "--frames", "1",
            "--height", "8", "--width", "8", "--steps", "2", "--grid"]  # fmt: skip
    assert sample.main([*args, "--out", str(tmp_path / "run")]) == 0  # a LoRA run's own checkpoint
    extra = ["--lora", str(tmp / "whole" / lora.WEIGHT_NAME), "--lora-scale", "0.5"]
    assert sample.main([*args, *extra, "--out", str(tmp_path / "extra")]) == 0  # and a LoRA on top
    assert len(list((tmp_path / "extra").glob("*.mp4"))) == 1
