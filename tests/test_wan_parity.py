"""Wan2.1 parity: imported diffusers WanTransformer3DModels compute the same outputs in VideoDiT.

Small random Wan models (several head counts and head dims, patch sizes (1, 2, 2) and (2, 2, 2), odd
frame counts, non-square clips, out_channels != in_channels) are imported; every clip of a packed
batch must match diffusers' call on that clip alone, with its caption zero-padded as Wan's pipeline
pads it. Export -> import is bitwise, diffusers loads what we export, and checkpoints that do not fit
fail naming the tensor. Under CP (one spawn of 4 gloo ranks, groups of 2 and 4, Ulysses and ring)
the gathered output still matches diffusers.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import tiny_overrides
from diffusers import WanTransformer3DModel
from safetensors import safe_open

import train
from dit.attention import PackedAttention
from dit.model import VideoDiT, pad_text
from dit.packing import pack, unpack
from dit.sizes import MODEL_SIZES
from dit.wan_import import (
    _check_names,
    _empty_model,
    export_wan,
    import_wan_state_dict,
    load_pretrained,
    main,
    videodit_config,
)
from dynamic_cp.attention.cp_attention import make_cp_attention
from dynamic_cp.attention.sharding import gather_shards
from dynamic_cp.runtime.testing import run_gloo

ROOT = Path(__file__).resolve().parent.parent

TOL = 1e-5  # fp32, max abs difference per clip
TEXT_DIM = 16
TEXT_LEN = 8  # stands in for Wan's 512: every caption is zero-padded to it
BASE = dict(text_dim=TEXT_DIM, freq_dim=32, ffn_dim=40, num_layers=2)
# name -> (Wan config, clips as (channels, frames, height, width)); latent frame counts are odd where
# the temporal patch is 1, and no clip is square.
CASES = {
    "heads3-d12-p122": (
        dict(patch_size=(1, 2, 2), num_attention_heads=3, attention_head_dim=12, in_channels=4, **BASE),
        [(4, 3, 6, 10), (4, 1, 4, 2), (4, 5, 2, 6)],
    ),
    "heads2-d16-p222-outc5-nocrossnorm": (
        dict(
            patch_size=(2, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=3,
            out_channels=5, cross_attn_norm=False, **BASE,
        ),
        [(3, 4, 6, 4), (3, 2, 2, 8)],
    ),
    "heads4-d8-p122-qknone": (
        dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=8, in_channels=4, qk_norm=None, **BASE),
        [(4, 7, 4, 6), (4, 1, 2, 2), (4, 3, 8, 2)],
    ),
}  # fmt: skip
CAPTION_LENS = [5, 8, 1]


def make_wan(name: str) -> WanTransformer3DModel:
    torch.manual_seed(sum(map(ord, name)))
    return WanTransformer3DModel(**CASES[name][0]).eval()


def make_batch(name: str) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(len(name))
    clips = [torch.randn(*shape, generator=gen) for shape in CASES[name][1]]
    texts = [torch.randn(n, TEXT_DIM, generator=gen) for n in CAPTION_LENS[: len(clips)]]
    timesteps = torch.tensor([999.0, 1.0, 437.5])[: len(clips)]
    return clips, texts, timesteps


@torch.no_grad()
def wan_reference(wan, clips, texts, timesteps) -> list[torch.Tensor]:
    """diffusers on each clip alone, the caption zero-padded to TEXT_LEN as the Wan pipeline does."""
    refs = []
    for clip, text, t in zip(clips, texts, timesteps):
        padded = torch.cat([text, text.new_zeros(TEXT_LEN - text.shape[0], TEXT_DIM)])
        refs.append(wan(clip[None], t[None], padded[None]).sample[0])
    return refs


@torch.no_grad()
def ours_packed(model: VideoDiT, clips, texts, timesteps, attention=None, shard=None) -> list[torch.Tensor]:
    """Our packed forward over every clip -> per-clip (c, f, h, w) outputs. ``shard`` runs under CP."""
    patch = model.patch_size
    packed = pack(clips, patch)
    text, text_lens = torch.cat(texts), torch.tensor([t.shape[0] for t in texts])
    if shard is None:
        out = model(packed.tokens, packed.positions, packed.seq_lens, timesteps, text, text_lens,
                    PackedAttention(packed.seq_lens))  # fmt: skip
    else:
        group, method = shard
        attention, info = make_cp_attention(group, packed.seq_lens, method, model.config.num_attention_heads)
        local = model(info.shard(packed.tokens), info.shard(packed.positions), info.local_seq_lens, timesteps,
                      text, text_lens, attention)  # fmt: skip
        out = gather_shards(local, group, info)
    return unpack(packed, out, patch)


def max_diffs(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[float]:
    assert [g.shape for g in got] == [w.shape for w in want]
    return [float((g - w).abs().max()) for g, w in zip(got, want)]


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


# ----------------------------------------------------------------------------- single process


@pytest.mark.parametrize("name", CASES)
def test_packed_clips_match_diffusers_each_clip_alone(name):
    wan = make_wan(name)
    model = import_wan_state_dict(wan.config, wan.state_dict(), text_pad_len=TEXT_LEN)
    clips, texts, timesteps = make_batch(name)
    refs = wan_reference(wan, clips, texts, timesteps)
    assert max(max_diffs(ours_packed(model, clips, texts, timesteps), refs)) <= TOL
    # one clip alone, and captions padded by the caller instead of the model
    assert max_diffs(ours_packed(model, clips[:1], texts[:1], timesteps[:1]), refs[:1])[0] <= TOL
    model.register_to_config(text_pad_len=None)
    padded = list(
        pad_text(torch.cat(texts), torch.tensor([t.shape[0] for t in texts]), TEXT_LEN)[0].split(TEXT_LEN)
    )
    assert max(max_diffs(ours_packed(model, clips, padded, timesteps), refs)) <= TOL


def test_gradients_match_diffusers():
    """Fine-tuning trains the same function: parameter gradients equal diffusers' on one clip."""
    name = "heads2-d16-p222-outc5-nocrossnorm"
    wan = make_wan(name)
    model = import_wan_state_dict(
        wan.config, {k: v.clone() for k, v in wan.state_dict().items()}, text_pad_len=TEXT_LEN
    )
    clips, texts, timesteps = make_batch(name)
    weight = torch.randn(clips[0].shape[0] + 2, *clips[0].shape[1:])  # out_channels = 5
    packed = pack(clips[:1], model.patch_size)
    out = model(packed.tokens, packed.positions, packed.seq_lens, timesteps[:1], texts[0], torch.tensor([len(texts[0])]),
                PackedAttention(packed.seq_lens))  # fmt: skip
    (unpack(packed, out, model.patch_size)[0] * weight).sum().backward()
    padded = torch.cat([texts[0], texts[0].new_zeros(TEXT_LEN - len(texts[0]), TEXT_DIM)])
    (wan(clips[0][None], timesteps[:1], padded[None]).sample[0] * weight).sum().backward()
    ours = dict(model.named_parameters())
    for key, p in wan.named_parameters():
        grad = ours[key].grad
        if key == "patch_embedding.weight":  # (D, pt*ph*pw*c) -> (D, c, pt, ph, pw)
            grad = grad.reshape(grad.shape[0], *model.patch_size, -1).permute(0, 4, 1, 2, 3)
        torch.testing.assert_close(grad, p.grad, rtol=1e-4, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")


def test_pad_text_layout_and_limit():
    text = torch.arange(10.0).view(5, 2)
    padded, lens = pad_text(text, torch.tensor([2, 0, 3]), 4)
    assert lens.tolist() == [4, 4, 4]
    assert torch.equal(padded[[0, 1, 8, 9, 10]], text) and not padded[[2, 3, 4, 5, 6, 7, 11]].any()
    with pytest.raises(ValueError, match="text_pad_len is 2"):
        pad_text(text, torch.tensor([2, 3]), 2)


def test_load_sharded_folder_and_pipeline_folder(tmp_path):
    name = "heads3-d12-p122"
    wan = make_wan(name)
    ref = import_wan_state_dict(wan.config, wan.state_dict())
    wan.save_pretrained(tmp_path / "pipe" / "transformer", max_shard_size="20KB")  # several shards
    assert (tmp_path / "pipe" / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    (tmp_path / "pipe" / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    for path in (tmp_path / "pipe" / "transformer", tmp_path / "pipe"):
        model = load_pretrained(path)
        assert_same_params(model, ref)
        assert model.config.text_pad_len == 512 and model.config.qk_norm


def test_bf16_load_keeps_fp32_modules(tmp_path):
    wan = make_wan("heads3-d12-p122")
    wan.save_pretrained(tmp_path / "w")
    model = load_pretrained(tmp_path / "w", dtype=torch.bfloat16)
    assert model.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    assert model.blocks[0].scale_shift_table.dtype == torch.float32
    assert model.condition_embedder.time_embedder.linear_1.weight.dtype == torch.float32


@pytest.mark.parametrize("shard_bytes", [2**30, 30_000])
def test_export_loads_in_diffusers_and_reimports_bitwise(tmp_path, shard_bytes):
    name = "heads2-d16-p222-outc5-nocrossnorm"
    wan = make_wan(name)
    model = import_wan_state_dict(wan.config, wan.state_dict())
    export_wan(model, tmp_path / "out", max_shard_bytes=shard_bytes)
    assert_same_params(WanTransformer3DModel.from_pretrained(tmp_path / "out"), wan)
    assert_same_params(load_pretrained(tmp_path / "out"), model)
    assert (tmp_path / "out" / "diffusion_pytorch_model.safetensors.index.json").is_file() == (
        shard_bytes < 2**20
    )


def test_our_format_round_trip_keeps_config(tmp_path):
    wan = make_wan("heads4-d8-p122-qknone")
    model = import_wan_state_dict(wan.config, wan.state_dict(), text_pad_len=TEXT_LEN)
    model.save_pretrained(tmp_path / "ours")
    loaded = load_pretrained(tmp_path / "ours")
    assert_same_params(loaded, model)
    assert loaded.config.text_pad_len == TEXT_LEN


def test_cli_export_from_run_and_import(tmp_path, capsys):
    wan = make_wan("heads3-d12-p122")
    model = import_wan_state_dict(wan.config, wan.state_dict())
    step = tmp_path / "run" / "checkpoints" / "step_000010"
    model.save_pretrained(step / "ema")
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step_000010\n")
    assert (
        main(
            [
                "export",
                "--checkpoint",
                str(tmp_path / "run"),
                "--out",
                str(tmp_path / "wan"),
                "--dtype",
                "bf16",
            ]
        )
        == 0
    )
    with safe_open(tmp_path / "wan" / "diffusion_pytorch_model.safetensors", framework="pt") as f:
        assert f.get_tensor("blocks.0.ffn.net.0.proj.weight").dtype == torch.bfloat16
        assert f.get_tensor("blocks.0.scale_shift_table").dtype == torch.float32  # kept, as diffusers does
    exported = WanTransformer3DModel.from_pretrained(tmp_path / "wan", torch_dtype=torch.bfloat16)
    assert exported.blocks[0].ffn.net[0].proj.weight.dtype == torch.bfloat16
    assert main(["import", "--wan", str(tmp_path / "wan"), "--out", str(tmp_path / "ours")]) == 0
    assert VideoDiT.from_pretrained(tmp_path / "ours").config.text_pad_len == 512
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "wan")]) == 2
    assert "not empty" in capsys.readouterr().err


# Published Wan2.1-T2V configs (transformer/config.json of the -Diffusers repositories).
PUBLISHED = {
    "wan-1.3b": dict(num_attention_heads=12, ffn_dim=8960, num_layers=30),
    "wan-14b": dict(num_attention_heads=40, ffn_dim=13824, num_layers=40),
}


@pytest.mark.parametrize("size", PUBLISHED)
def test_published_sizes_map_on_meta_device(size):
    """Full-size dry run without memory: every diffusers tensor name and shape fits our model."""
    from accelerate import init_empty_weights

    config = {**dict(patch_size=[1, 2, 2], attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096,
                     freq_dim=256, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
                     rope_max_seq_len=1024, image_dim=None, added_kv_proj_dim=None), **PUBLISHED[size]}  # fmt: skip
    with init_empty_weights():
        wan = WanTransformer3DModel(**config)
    shapes = {k: tuple(v.shape) for k, v in wan.state_dict().items()}
    model = _empty_model(videodit_config(config))
    assert sorted(_check_names(model, shapes, size)) == sorted(shapes)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in wan.parameters())
    # the named size the planner and FLOP counts use has the same shape
    assert {k: v for k, v in MODEL_SIZES[size].items() if k != "patch_size"}.items() <= model.config.items()


def test_train_py_fine_tunes_a_wan_folder_and_exports(tmp_path):
    """train.py with model.pretrained=<diffusers pipeline folder>, then export the run to diffusers."""
    wan_cfg = dict(patch_size=(1, 4, 4), num_attention_heads=2, attention_head_dim=16, in_channels=3, out_channels=3,
                   text_dim=64, freq_dim=32, ffn_dim=64, num_layers=2)  # fmt: skip  # tiny.yaml's data
    torch.manual_seed(0)
    WanTransformer3DModel(**wan_cfg).save_pretrained(tmp_path / "pipe" / "transformer")
    overrides = tiny_overrides(tmp_path, **{"train.max_steps": 2, "train.checkpoint_every": 2})
    overrides = [o for o in overrides if not o.startswith("model.overrides")]
    extra = [
        f"model.pretrained={tmp_path / 'pipe'}",
        "model.gradient_checkpointing=true",
        "train.lr=1.0e-5",
        "train.val_every=100",
    ]
    assert train.main(["--config", str(ROOT / "configs" / "tiny.yaml"), *overrides, *extra]) == 0
    assert (
        main(
            [
                "export",
                "--checkpoint",
                str(tmp_path / "run"),
                "--weights",
                "model",
                "--out",
                str(tmp_path / "out"),
            ]
        )
        == 0
    )
    tuned = WanTransformer3DModel.from_pretrained(tmp_path / "out")
    start = WanTransformer3DModel.from_pretrained(tmp_path / "pipe" / "transformer")
    before = start.state_dict()
    change = {k: float((v - before[k]).abs().max()) for k, v in tuned.state_dict().items()}
    assert max(change.values()) > 0  # training changed the weights...
    # ...by two AdamW steps of lr=1e-5 (each moves a weight by about lr) from the pretrained ones: a
    # run that ignored model.pretrained and trained a fresh init would differ by ~0.1 here.
    assert max(change.values()) < 3 * 2 * 1e-5, max(change.values())


# ----------------------------------------------------------------------------- errors


def _state(name="heads3-d12-p122"):
    wan = make_wan(name)
    return dict(wan.config), dict(wan.state_dict())


def test_error_names_mismatching_tensor():
    config, state = _state()
    with pytest.raises(
        ValueError, match=r"blocks\.0\.ffn\.net\.0\.proj\.weight has shape \[40, 36\].*expects \[48, 36\]"
    ):
        import_wan_state_dict({**config, "ffn_dim": 48}, state)


def test_error_names_missing_and_unexpected_tensors():
    config, state = _state()
    del state["blocks.1.attn2.norm_k.weight"]
    with pytest.raises(ValueError, match=r"blocks\.1\.attn2\.norm_k\.weight \[36\] is missing"):
        import_wan_state_dict(config, state)
    config, state = _state()
    state["blocks.2.attn1.to_q.weight"] = torch.zeros(36, 36)
    with pytest.raises(ValueError, match=r"unexpected tensor blocks\.2\.attn1\.to_q\.weight \[36, 36\]"):
        import_wan_state_dict(config, state)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"image_dim": 1280}, "set both"),
        ({"added_kv_proj_dim": 36}, "set both"),
        ({"qk_norm": "layer_norm"}, "rms_norm_across_heads"),
        ({"window_size": [-1, -1]}, "unknown to diffusers"),
        ({"_class_name": "HunyuanVideoTransformer3DModel"}, "not 'WanTransformer3DModel'"),
    ],
)
def test_unsupported_configs(change, match):
    config, state = _state()
    with pytest.raises(ValueError, match=match):
        import_wan_state_dict({**config, **change}, state)


def test_original_wan_format_is_explained():
    config, _ = _state()
    with pytest.raises(ValueError, match="original Wan format"):
        import_wan_state_dict(config, {"blocks.0.self_attn.q.weight": torch.zeros(36, 36)})


def test_folder_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist; download Wan-AI/Wan2.1-T2V-1.3B-Diffusers"):
        load_pretrained(tmp_path / "nowhere")
    make_wan("heads3-d12-p122").save_pretrained(tmp_path / "p" / "transformer")
    (tmp_path / "p" / "model_index.json").write_text(json.dumps({"expand_timesteps": True}))
    # a Wan2.2 TI2V pipeline loads, marked per-token from its model_index.json (also via transformer/)
    assert load_pretrained(tmp_path / "p").config.expand_timesteps
    assert load_pretrained(tmp_path / "p" / "transformer").config.expand_timesteps
    (tmp_path / "p" / "model_index.json").write_text(json.dumps({"transformer_2": ["diffusers", "X"]}))
    with pytest.raises(ValueError, match="two-expert"):
        load_pretrained(tmp_path / "p")
    (tmp_path / "p" / "transformer" / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(ValueError, match="neither diffusion_pytorch_model.safetensors"):
        load_pretrained(tmp_path / "p" / "transformer")


def test_export_errors(tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("")
    config, state = _state()
    with pytest.raises(ValueError, match="not empty"):
        export_wan(import_wan_state_dict(config, state), tmp_path / "busy")
    with pytest.raises(ValueError, match="qk_norm=False"):
        export_wan(VideoDiT(**{**CASES["heads3-d12-p122"][0], "qk_norm": False}), tmp_path / "new")


# ----------------------------------------------------------------------------- context parallelism

WORLD = 4
CP_GROUPS = {"g01": [0, 1], "g0123": [0, 1, 2, 3]}
# 3 heads divide neither 2 nor 4 ranks ("auto" -> ring); 4 heads give Ulysses on both; one forced ring.
CP_CASES = [
    ("g01", "auto", "heads3-d12-p122"),
    ("g0123", "auto", "heads3-d12-p122"),
    ("g01", "auto", "heads4-d8-p122-qknone"),
    ("g0123", "auto", "heads4-d8-p122-qknone"),
    ("g0123", "ring", "heads2-d16-p222-outc5-nocrossnorm"),
]


def cp_worker(rank: int, world_size: int, states: dict) -> dict:
    groups = {
        name: dist.new_group(ranks) for name, ranks in CP_GROUPS.items()
    }  # every rank makes every group
    results = {}
    for group_name, method, name in CP_CASES:
        if rank not in CP_GROUPS[group_name]:
            continue
        key = f"{group_name}-{method}-{name}"
        try:
            model = import_wan_state_dict(CASES[name][0], states[name], text_pad_len=TEXT_LEN)
            clips, texts, timesteps = make_batch(name)
            results[key] = ours_packed(model, clips, texts, timesteps, shard=(groups[group_name], method))
        except Exception:  # reported per case; the group's other ranks then fail on the collective
            results[key] = traceback.format_exc()
    return results


@pytest.fixture(scope="module")
def cp_results() -> dict[str, list]:
    states = {name: make_wan(name).state_dict() for name in CASES}
    merged: dict[str, list] = {}
    for per_rank in run_gloo(cp_worker, WORLD, states):
        for key, value in per_rank.items():
            merged.setdefault(key, []).append(value)
    return merged


@pytest.mark.parametrize("case", CP_CASES, ids="-".join)
def test_cp_output_matches_diffusers(cp_results, case):
    group_name, method, name = case
    outputs = cp_results[f"{group_name}-{method}-{name}"]
    assert len(outputs) == len(CP_GROUPS[group_name])
    refs = wan_reference(make_wan(name), *make_batch(name))
    for got in outputs:  # every rank of the group gathered the whole output
        assert isinstance(got, list), got  # a traceback otherwise
        assert max(max_diffs(got, refs)) <= TOL
