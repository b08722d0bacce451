"""An image-to-video latent cache (python -m data.cache --image-condition ...) trains as the videos do.

Real mp4/webm clips (imageio-ffmpeg), a small random AutoencoderKLWan, UMT5 encoder and CLIPVisionModel
saved to local folders. One training step of a tiny I2V (and FLF2V) model from the cache must give the
loss and gradients of the same step from the videos; a cache made for another model is refused at
start-up with one line naming the data.cache flags that fix it.

A LoRA trained here from that cache loads into a fully built WanImageToVideoPipeline.

Planted and caught: the cache's condition video built from frame 1 instead of frame 0 (the I2V and
FLF2V cases fail: the loss moves by 5e-3 and 1.4e-3 against an allowance of 2e-5); the start-up check
removed (a T2V cache under the I2V config is no longer refused); the LoRA exported with "add_k" for
"add_k_proj" (diffusers then adds zero image K/V adapters the file lacks: the key sets differ).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from _data_media import make_clips
from conftest import save_small_clip
from test_data_cache import save_text_encoder, save_vae

from data import cache
from dit.config import load_config
from dit.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
POLICY = ["--fps", "12", "--max-frames", "5", "--resolution", "32"]
# width 32 (2 heads of 16): 4 noisy + 4 mask + 4 image-latent channels in (the small Wan VAE's z_dim 4,
# temporal stride 4), text 16 wide (the UMT5), image 12 wide (the small CLIP's hidden size)
MODEL = (
    "{num_layers: 2, ffn_dim: 64, num_attention_heads: 2, attention_head_dim: 16, in_channels: 12, "
    "out_channels: 4, text_dim: 16, image_dim: 12, added_kv_proj_dim: 32"
)
T2V_MODEL = "{num_layers: 2, ffn_dim: 64, num_attention_heads: 2, attention_head_dim: 16, text_dim: 16, in_channels: 4"
NO_CLIP_MODEL = MODEL.replace(", image_dim: 12, added_kv_proj_dim: 32", "")  # Wan2.2-I2V style


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    root = tmp_path_factory.mktemp("i2v_cache")
    make_clips(str(root / "videos"))  # 5 clips of 5 shapes, 1 or 5 frames after the policy
    return {
        "root": root,
        "videos": str(root / "videos"),
        "vae": save_vae("wan", str(root / "vae")),
        "text": save_text_encoder("umt5", str(root / "text")),
        "clip": save_small_clip(root / "clip"),
    }


def cache_args(parts, *flags: str) -> list[str]:
    args = ["--source", parts["videos"], "--vae", "wan", "--vae-path", parts["vae"]]
    args += ["--text-encoder", "umt5", "--text-path", parts["text"], "--max-length", "32"]
    # float32 storage: nothing rounds on the way; --vae-batch 2 puts a clip and its condition video
    # through the VAE in one call
    return args + ["--dtype", "float32", "--shard-size", "2", "--vae-batch", "2", *POLICY, *flags]


def build(parts, name: str, *flags: str) -> str:
    out = str(parts["root"] / name)
    if not os.path.isfile(os.path.join(out, "index.json")):
        assert cache.main(["--out", out, *cache_args(parts, *flags)]) == 0
    return out


def overrides_for(parts, tmp_path, source: str, flf2v: bool = False, model: str = MODEL) -> list[str]:
    model += ", pos_embed_seq_len: 10}" if flf2v else "}"  # FLF2V: 2 images x 5 CLIP tokens
    overrides = {
        "output_dir": str(tmp_path / "run"),
        "model.overrides": model,
        "data.source": source,
        "data.vae": "wan",
        "data.vae_path": parts["vae"],
        "data.text_encoder": "umt5",
        "data.text_encoder_path": parts["text"],
        "data.text_max_length": 32,
        "data.image_encoder_path": parts["clip"],
        "data.num_val_clips": 1,
        "data.caption_dropout": 0.5,  # both the cached "" embedding and cached captions get used
        "train.mixed_precision": "no",
        "train.sample_every": 0,
        "train.ema_decay": 0,
    }
    if source == parts["videos"]:  # the clip policy the cache was made with
        overrides["data.options"] = f"{{fps: 12, max_frames: 5, resolution: 32, min_frames: {1 + flf2v}}}"
    return [f"{k}={v}" for k, v in overrides.items()]


def trainer(parts, tmp_path, source: str, flf2v: bool = False, model: str = MODEL) -> Trainer:
    cfg = load_config(ROOT / "configs" / "tiny.yaml", overrides_for(parts, tmp_path, source, flf2v, model))
    return Trainer(cfg, device=torch.device("cpu"))


def one_step(t: Trainer) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of step 0 over the training clips (the trainer's own prepare and step)."""
    samples = [t.train_set[i] for i in t.train_indices]
    clips = t.prepare(samples, step=0)
    assert all(c.condition is not None and c.image is not None for c in clips)
    assert any(c.text.shape[0] == 1 for c in clips) and any(c.text.shape[0] > 1 for c in clips)
    loss = t.train_step(clips)["loss"]
    return loss, {n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("flf2v", [False, True], ids=["i2v", "flf2v"])
def test_a_step_from_the_cache_equals_the_step_from_the_videos(parts, tmp_path, flf2v, capsys):
    frames = "first-last" if flf2v else "first"
    flags = ["--image-condition", frames, "--image-encoder", parts["clip"]]
    if flf2v:  # a 1-frame clip has no first and last frame: refused, then left out by the policy
        capsys.readouterr()
        assert cache.main(["--out", str(tmp_path / "no"), *cache_args(parts, *flags)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "add --option min_frames=2" in err[0], err
        flags += ["--option", "min_frames=2"]
    out = build(parts, f"cache-{frames}", *flags)
    index = json.load(open(os.path.join(out, "index.json")))
    assert index["version"] == 3 and index["image_condition"] == {"frames": frames, "image_dim": 12}

    videos = trainer(parts, tmp_path / "videos", parts["videos"], flf2v)
    cached = trainer(parts, tmp_path / "cached", out, flf2v)
    assert len(videos.train_set) == len(cached.train_set) == 5 - flf2v  # FLF2V: the 1-frame clip is out
    assert [videos.train_set.meta(i) for i in range(5 - flf2v)] == [
        cached.train_set.meta(i) for i in range(5 - flf2v)
    ]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # off the init's zeros (output projections), so every path gets a gradient
        for p in videos.model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    cached.model.load_state_dict(videos.model.state_dict())
    loss_v, grads_v = one_step(videos)
    loss_c, grads_c = one_step(cached)
    # Both paths run the same VAE, CLIP and UMT5 on the same decoded pixels and store float32, so
    # what differs is summation order: the VAE and the text encoder see batches of 2 in the cache and
    # of 1 in training (fp32, ~1e-7 relative per op over a few dozen ops in sequence: ~1e-6 of the
    # O(1) latents and embeddings). Through the 2-block model that stays ~1e-6 relative, in the loss
    # and in every gradient measured against the largest gradient entry G. 1e-5 leaves 10x margin; a
    # condition taken from another frame moves the loss by > 1e-3.
    assert abs(loss_c - loss_v) <= 1e-5 * abs(loss_v)
    assert grads_c.keys() == grads_v.keys()
    largest = max(float(g.abs().max()) for g in grads_v.values())
    for name, g in grads_v.items():
        assert float((grads_c[name] - g).abs().max()) <= 1e-5 * largest, name
    assert float(grads_v["blocks.1.attn2.add_k_proj.weight"].abs().max()) > 0  # CLIP tokens are used


def test_a_cache_for_another_model_is_refused(parts, tmp_path, capsys):
    t2v_cache = build(parts, "cache-t2v")
    i2v_cache = build(parts, "cache-first", "--image-condition", "first", "--image-encoder", parts["clip"])
    fix = rf"re-run python -m data.cache with --image-condition first --image-encoder {parts['clip']}"
    with pytest.raises(ValueError, match=rf"cached for a text-to-video model .* but this model is .*{fix}"):
        trainer(parts, tmp_path / "a", t2v_cache)
    with pytest.raises(ValueError, match="this model is a text-to-video .* without --image-condition"):
        trainer(parts, tmp_path / "b", i2v_cache, model=T2V_MODEL)
    with pytest.raises(ValueError, match="first and last frames .* --image-condition first-last"):
        trainer(parts, tmp_path / "c", i2v_cache, flf2v=True)
    with pytest.raises(
        ValueError,
        match="no CLIP tokens: re-run python -m data.cache with --image-condition first and no --image-encoder",
    ):
        trainer(parts, tmp_path / "d", i2v_cache, model=NO_CLIP_MODEL)
    # another VAE: the cache says which one encoded it
    index = json.load(open(os.path.join(i2v_cache, "index.json")))
    index["vae"]["kind"] = "hunyuan"
    json.dump(index, open(os.path.join(tmp_path, "index.json"), "w"))
    os.replace(os.path.join(i2v_cache, "index.json"), os.path.join(tmp_path, "kept.json"))
    os.replace(os.path.join(tmp_path, "index.json"), os.path.join(i2v_cache, "index.json"))
    try:
        with pytest.raises(
            ValueError, match="encoded with the hunyuan VAE but data.vae=wan: set data.vae=hunyuan"
        ):
            trainer(parts, tmp_path / "e", i2v_cache)
    finally:
        os.replace(os.path.join(tmp_path, "kept.json"), os.path.join(i2v_cache, "index.json"))
    # train.py --dry-run says the same before any GPU hour (it used to count 12 model channels against
    # the cache's 4 and call every image-to-video model a mismatch)
    import train

    capsys.readouterr()
    config = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--dry-run"]
    assert train.main([*config, *overrides_for(parts, tmp_path / "g", t2v_cache)]) == 1
    assert re.search(rf"cached for a text-to-video model .*{fix}", capsys.readouterr().out)
    assert train.main([*config, *overrides_for(parts, tmp_path / "h", i2v_cache)]) == 0
    assert "no problems found" in capsys.readouterr().out
    # the T2V cache still trains a T2V model (the check lets a matching cache through)
    trainer(parts, tmp_path / "f", t2v_cache, model=T2V_MODEL)


def test_lora_trained_from_the_cache_loads_into_wan_image_to_video_pipeline(parts, tmp_path):
    """Issue 28's LoRA acceptance on a whole pipeline: a LoRA trained here (2 steps of train.py's
    Trainer on the I2V cache, image K/V targeted too) loads through WanImageToVideoPipeline.load_lora_weights
    with no missing or unexpected keys, and changes the pipeline's output. The pipeline is fully built
    from the same small random parts: the base transformer, AutoencoderKLWan, CLIP, UMT5 and tokenizer
    (prompt embeddings are passed in: the pipeline's own prompt cleaning needs ftfy, not installed)."""
    import PIL.Image
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanImageToVideoPipeline,
        WanTransformer3DModel,
    )
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, CLIPImageProcessor, CLIPVisionModel, UMT5EncoderModel

    from data.text_encoders import load_text_encoder

    torch.manual_seed(0)
    base = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=12, out_channels=4,
        text_dim=16, freq_dim=32, ffn_dim=64, num_layers=2, image_dim=12, added_kv_proj_dim=32,
    )  # fmt: skip
    base.save_pretrained(tmp_path / "base")
    out = build(parts, "cache-first", "--image-condition", "first", "--image-encoder", parts["clip"])
    overrides = {
        "output_dir": str(tmp_path / "run"),
        "model.size": "wan-i2v-14b",  # the checkpoint's own config gives the widths
        "model.overrides": "{}",
        "model.pretrained": str(tmp_path / "base"),
        "model.lora": "{rank: 2, target_modules: [to_q, to_k, to_v, to_out.0, add_k_proj, add_v_proj]}",
        "data.source": out,
        "data.vae": "wan",
        "data.image_encoder_path": parts["clip"],
        "data.text_encoder": "umt5",
        "data.num_val_clips": 1,
        "train.max_steps": 2,
        "train.global_batch_size": 2,
        "train.lr": 0.01,
        "train.warmup_steps": 0,
        "train.mixed_precision": "no",
        "train.sample_every": 0,
        "train.ema_decay": 0,
        "train.val_every": 100,
        "train.checkpoint_every": 100,
    }
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [f"{k}={v}" for k, v in overrides.items()])
    Trainer(cfg, device=torch.device("cpu")).train()
    lora_file = tmp_path / "run" / "pytorch_lora_weights.safetensors"
    assert lora_file.is_file()

    pipe = WanImageToVideoPipeline(
        tokenizer=AutoTokenizer.from_pretrained(parts["text"]),
        text_encoder=UMT5EncoderModel.from_pretrained(parts["text"]),
        image_encoder=CLIPVisionModel.from_pretrained(parts["clip"]),
        image_processor=CLIPImageProcessor.from_pretrained(parts["clip"]),
        transformer=WanTransformer3DModel.from_pretrained(tmp_path / "base"),
        vae=AutoencoderKLWan.from_pretrained(parts["vae"]),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )
    text = load_text_encoder("umt5", parts["text"], max_length=32)
    embs = [text.encode([c])[0] for c in ("a test pattern", "")]
    padded = [torch.cat([e, e.new_zeros(512 - len(e), e.shape[1])])[None] for e in embs]  # as Wan pads
    image = PIL.Image.fromarray(
        (torch.rand(32, 32, 3, generator=torch.Generator().manual_seed(1)) * 255).byte().numpy()
    )
    noise = torch.randn(1, 4, 2, 4, 4, generator=torch.Generator().manual_seed(2))

    def run():
        return pipe(
            image=image, prompt_embeds=padded[0], negative_prompt_embeds=padded[1], height=32, width=32,
            num_frames=5, num_inference_steps=2, guidance_scale=3.0, latents=noise.clone(), output_type="latent",
        ).frames[0]  # fmt: skip

    before = run()
    pipe.load_lora_weights(str(tmp_path / "run"))
    (adapter,) = pipe.transformer.peft_config
    live = set(get_peft_model_state_dict(pipe.transformer, adapter_name=adapter))
    in_file = {k.removeprefix("transformer.") for k in load_file(lora_file)}
    assert live == in_file  # no missing and no unexpected keys
    assert any("add_k_proj" in k for k in live)  # the image K/V adapters were trained and loaded
    after = run()
    # The pipeline is deterministic fp32 on the same noise, so without the LoRA the two runs agree to
    # the last bit; 2 AdamW steps at lr 1e-2 move the zero-initialised B matrices by ~1e-2 per entry,
    # which moves the latents by far more than 1e-4 (measured: 0.14 on latents of up to 3.5).
    assert float((after - before).abs().max()) > 1e-4


def test_bad_image_flags_get_one_line(parts, tmp_path, capsys):
    out = ["--out", str(tmp_path / "c")]
    with pytest.raises(SystemExit):  # argparse: a CLIP folder alone caches nothing
        cache.main([*out, *cache_args(parts, "--image-encoder", parts["clip"])])
    assert "--image-encoder needs --image-condition first" in capsys.readouterr().err
    assert (
        cache.main([*out, *cache_args(parts, "--image-condition", "first", "--image-encoder", "nope")]) == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--image-encoder nope is not a folder" in err[0], err
    assert not (tmp_path / "c").exists()  # refused before anything is written
