"""Latent + text cache with small random diffusers VAEs and T5/UMT5 encoders saved to local folders."""

import json
import os
import shutil

import pytest
import torch
from _data_media import make_broken, make_clips

from data import cache
from data.build import build_dataset
from data.text_encoders import load_text_encoder
from data.tokens import latent_shape, num_tokens
from data.vaes import IdentityVAE, VideoVAE, load_vae

WORDS = "<pad> </s> <unk> a test pattern at fps".split() + [
    f"{n}x{m}" for n in (32, 40, 48, 64) for m in (24, 32, 36, 56)
]


def save_vae(kind: str, path: str) -> str:
    import diffusers

    torch.manual_seed(0)
    tiny = dict(latent_channels=4, block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4)
    model = {
        "wan": lambda: diffusers.AutoencoderKLWan(
            base_dim=8,
            z_dim=4,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            latents_mean=[0.1, -0.2, 0.3, 0.0],
            latents_std=[1.5, 0.5, 2.0, 1.0],
        ),
        "hunyuan": lambda: diffusers.AutoencoderKLHunyuanVideo(**tiny),
        "cogvideox": lambda: diffusers.AutoencoderKLCogVideoX(**tiny),
    }[kind]()
    model.save_pretrained(path)
    return path


def save_text_encoder(kind: str, path: str) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(path)
    config, cls = (UMT5Config, UMT5EncoderModel) if kind == "umt5" else (T5Config, T5EncoderModel)
    torch.manual_seed(0)
    cls(
        config(vocab_size=len(WORDS), d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
    ).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache_media")
    clips = make_clips(str(root / "videos"))
    make_broken(str(root / "videos"), clips[0])
    return str(root)


POLICY = ["--fps", "12", "--max-frames", "9", "--resolution", "32", "--option", "max_failure_share=0.5"]


@pytest.mark.parametrize("vae_kind,text_kind", [("wan", "umt5"), ("hunyuan", "t5"), ("cogvideox", "umt5")])
def test_cache_round_trip_keeps_token_counts(media, tmp_path, vae_kind, text_kind):
    vae_dir = save_vae(vae_kind, str(tmp_path / "vae"))
    text_dir = save_text_encoder(text_kind, str(tmp_path / "text"))
    out = str(tmp_path / "cache")
    args = ["--source", os.path.join(media, "videos"), "--vae", vae_kind, "--vae-path", vae_dir, "--out", out]
    args += ["--text-encoder", text_kind, "--text-path", text_dir, "--dtype", "float32", "--shard-size", "2"]
    assert cache.main(args + POLICY) == 0

    index = json.load(open(os.path.join(out, "index.json")))
    assert len(index["failed"]) == 4 and index["num_samples"] == 5  # broken files listed, not cached
    ds = build_dataset(out, vae_stride=(4, 8, 8))
    assert len({ds.samples[i]["shard"] for i in range(len(ds))}) == 3  # 5 samples, 2 per shard

    vae = load_vae(vae_kind, vae_dir)
    text = load_text_encoder(text_kind, text_dir, max_length=32)
    assert isinstance(vae, VideoVAE) and vae.stride == (4, 8, 8)
    pixels = build_dataset(
        os.path.join(media, "videos"),
        fps=12,
        max_frames=9,
        resolution=32,
        max_failure_share=0.5,
        vae_stride=vae.stride,
        progress=False,
    )
    assert len(ds) == len(pixels) == 5
    for i in range(len(ds)):
        m, s = ds.meta(i), ds[i]
        assert m == pixels.meta(i) and s["index"] == i
        assert tuple(s["latent"].shape) == (
            vae.latent_channels,
            *latent_shape(m.num_frames, m.height, m.width, vae.stride),
        )
        f, h, w = s["latent"].shape[1:]
        assert num_tokens(m.num_frames, m.height, m.width) == f * (h // 2) * (w // 2)  # metadata == encoded
        video = pixels[i]["video"]
        torch.testing.assert_close(s["latent"], vae.encode(video[None])[0], atol=1e-4, rtol=1e-4)
        emb = text.encode([pixels[i]["caption"]])[0]
        torch.testing.assert_close(s["text_emb"], emb)
        assert s["text_emb"].shape[1] == text.dim == 16
    # caption dropout on cached samples uses what the encoder gives for "", as sampling does
    torch.testing.assert_close(ds.empty_text_emb, text.encode([""])[0])
    back = vae.decode(ds[0]["latent"][None])
    assert back.shape == (1, 3, *vars(ds.meta(0)).values()) and back.abs().max() <= 1


def test_wan_latents_are_normalized_with_mean_and_std(tmp_path):
    vae = load_vae("wan", save_vae("wan", str(tmp_path / "vae")))
    x = torch.rand(1, 3, 5, 16, 16) * 2 - 1
    raw = vae.model.encode(x).latent_dist.mode()
    mean = torch.tensor([0.1, -0.2, 0.3, 0.0]).view(1, 4, 1, 1, 1)
    std = torch.tensor([1.5, 0.5, 2.0, 1.0]).view(1, 4, 1, 1, 1)
    torch.testing.assert_close(vae.encode(x), (raw - mean) / std)


def test_identity_vae_and_bad_kinds(tmp_path):
    v = load_vae("identity")
    assert isinstance(v, IdentityVAE) and v.stride == (1, 1, 1) and v.latent_channels == 3
    with pytest.raises(ValueError, match="wan"):
        load_vae("sd", str(tmp_path))
    with pytest.raises(ValueError, match="local folder"):
        load_vae("wan", str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="umt5"):
        load_text_encoder("clip", str(tmp_path))


def test_hashed_text_cache_matches_the_models_width_and_seed(media, tmp_path):
    from data.hashed_text import HashedTextEncoder

    out = str(tmp_path / "cache")
    args = ["--source", os.path.join(media, "videos"), "--vae", "identity", "--out", out]
    args += ["--text-encoder", "hashed", "--text-dim", "48", "--text-seed", "3", "--dtype", "float32"]
    args += ["--option", "vae_stride=[1,1,1]", "--option", "patch=[1,1,1]"]
    assert cache.main(args + POLICY) == 0
    ds = build_dataset(out)
    captions = build_dataset(os.path.join(media, "videos"), fps=12, max_frames=9, resolution=32,
                             max_failure_share=0.5, progress=False, vae_stride=(1, 1, 1), patch=(1, 1, 1))  # fmt: skip
    want = HashedTextEncoder(dim=48, seed=3).encode([captions[0]["caption"]])[0]
    torch.testing.assert_close(ds[0]["text_emb"], want)  # what training encodes with text_dim 48, seed 3
    with pytest.raises(SystemExit):  # a width for a real encoder is a mistake, not silently ignored
        cache.main(["--source", "x", "--out", str(tmp_path / "c2"), "--vae", "identity",
                    "--text-encoder", "t5", "--text-dim", "48"])  # fmt: skip


def test_cache_refuses_to_overwrite_and_reports_damaged_shards(media, tmp_path, capsys):
    out = str(tmp_path / "cache")
    args = [
        "--source",
        os.path.join(media, "videos"),
        "--vae",
        "identity",
        "--text-encoder",
        "hashed",
        "--out",
        out,
    ]
    pixel = [
        "--option",
        "vae_stride=[1,1,1]",
        "--option",
        "patch=[1,1,1]",
        "--dtype",
        "float32",
        "--shard-size",
        "1",
    ]
    assert cache.main(args + POLICY + pixel) == 0
    assert cache.main(args + POLICY + pixel) == 2  # a user error: one line, no traceback
    assert "already holds a cache" in capsys.readouterr().err
    ds = build_dataset(out, max_failure_share=0.5)
    same_shape = [i for i in range(len(ds)) if ds.meta(i) == ds.meta(0)]
    shutil.copy(os.path.join(out, ds.samples[0]["shard"]), os.path.join(out, "keep"))
    open(os.path.join(out, ds.samples[0]["shard"]), "wb").write(b"broken")
    if len(same_shape) > 1:
        s = ds[0]
        assert s["index"] == 0 and s["failures"][0][1] == "cache_read_error"
    else:
        with pytest.raises(RuntimeError, match="unreadable"):
            ds[0]
    assert len(ds.failures.failed) == 1


def test_columnar_index_reads_rows_lazily_and_version_1_caches_still_load(media, tmp_path):
    out = str(tmp_path / "cache")
    args = ["--source", os.path.join(media, "videos"), "--vae", "identity", "--text-encoder", "hashed"]
    args += ["--out", out, "--dtype", "float32", "--shard-size", "2"]
    assert cache.main(args + ["--option", "vae_stride=[1,1,1]", "--option", "patch=[1,1,1]"] + POLICY) == 0
    new = build_dataset(out, max_failure_share=0.5)
    rows = [new.samples[i] for i in range(len(new))]
    pixels = build_dataset(os.path.join(media, "videos"), fps=12, max_frames=9, resolution=32,
                           max_failure_share=0.5, progress=False, vae_stride=(1, 1, 1), patch=(1, 1, 1))  # fmt: skip
    assert (
        [r["caption"] for r in rows]
        == [new.caption(i) for i in range(5)]
        == [pixels.caption(i) for i in range(5)]
    )
    assert [r["source"] for r in rows] == [pixels.path(i) for i in range(5)]
    assert [new.meta(i) for i in range(5)] == [pixels.meta(i) for i in range(5)]
    # the same cache as version 1 wrote it: every sample listed in index.json, no samples.safetensors
    index = json.load(open(os.path.join(out, "index.json")))
    index.update(version=1, samples=rows)
    json.dump(index, open(os.path.join(out, "index.json"), "w"))
    os.remove(os.path.join(out, "samples.safetensors"))
    old = build_dataset(out, max_failure_share=0.5)
    assert len(old) == len(new) == 5
    for i in range(len(old)):
        assert old.meta(i) == new.meta(i) and old.caption(i) == new.caption(i)
        assert torch.equal(old[i]["latent"], new[i]["latent"]) and torch.equal(
            old[i]["text_emb"], new[i]["text_emb"]
        )
