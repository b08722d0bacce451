"""Wan2.2 TI2V training: image-to-video clips keep latent frame 0 clean at t = 0, out of the loss.

A tiny per-token model (``expand_timesteps``) trains a packed micro-batch of image-to-video clips and a
text-to-video one. Checked: frame-0 tokens of image-to-video clips enter the model clean (their x0)
with token timestep 0 and every other token with its clip's 1000 * sigma; their loss weight is zero
and each clip averages over its remaining tokens; the noise drawn for those tokens changes neither the
loss nor any gradient; text-to-video clips run without per-token timesteps. Also under CP (2 gloo
ranks, ring and Ulysses) the loss and gradients equal one process's.

Planted and watched fail (then restored): frame 0 noised like the rest (``replace_first_frame``
dropped) -> the clean-input and noise-independence checks fail; frame-0 tokens left in the loss ->
the weight and noise-independence checks fail.
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist

from dit.attention import PackedAttention
from dit.clips import TrainClip, micro_batch_loss, prepare_clip
from dit.config import FlowConfig
from dit.model import VideoDiT
from dit.packing import grid_positions
from dit.ti2v import check_ti2v_data
from dynamic_cp.attention.cp_attention import make_cp_attention
from dynamic_cp.runtime.testing import run_gloo

TINY = dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, text_dim=8,
    freq_dim=16, ffn_dim=24, num_layers=2, adaln_zero_init=False, expand_timesteps=True,
)  # fmt: skip
GRIDS = [(3, 2, 3), (2, 3, 2), (4, 1, 2)]  # latent (f, h, w) after patching
CLEAN = [True, False, True]
SIGMAS = [0.7, 0.3, 0.9]
P = 4 * 4  # patch values: 4 channels x (1 x 2 x 2)


def make_model() -> VideoDiT:
    torch.manual_seed(0)
    return VideoDiT(**TINY)


def make_clips(noise_seed: int = 1) -> list[TrainClip]:
    gen = torch.Generator().manual_seed(3)
    clips = []
    for i, (grid, clean, sigma) in enumerate(zip(GRIDS, CLEAN, SIGMAS)):
        n = grid[0] * grid[1] * grid[2]
        x0 = torch.randn(n, P, generator=gen)
        text = torch.randn(3 + i, 8, generator=gen)
        noise = torch.randn(n, P, generator=torch.Generator().manual_seed(noise_seed + i))
        clips.append(TrainClip(i, x0, noise, sigma, grid_positions(grid), text, clean_first=clean))
    return clips


def frame0(clip: TrainClip) -> torch.Tensor:
    return (clip.positions[:, 0] == 0) & clip.clean_first


def loss_and_grads(model, clips):
    model.zero_grad()
    attention = PackedAttention([c.num_tokens for c in clips])
    loss = micro_batch_loss(model, clips, attention, num_clips_global=len(clips))
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def test_frame0_is_clean_at_t0_and_out_of_the_loss():
    model = make_model()
    clips = make_clips()
    seen = {}
    model.register_forward_pre_hook(
        lambda m, args, kwargs: seen.update(args=args, kwargs=kwargs), with_kwargs=True
    )
    loss, grads = loss_and_grads(model, clips)
    tokens, timesteps = seen["args"][0], seen["kwargs"]["token_timesteps"]
    clean = torch.cat([frame0(c) for c in clips])
    x0 = torch.cat([c.x0 for c in clips])
    sigma = torch.cat([torch.full((c.num_tokens,), c.sigma) for c in clips])
    assert clean.sum() == 3 * 2 + 1 * 2  # frame 0 of clips 0 and 2
    assert torch.equal(tokens[clean], x0[clean])  # the clean image latent, no noise
    assert torch.equal(timesteps[clean], torch.zeros(int(clean.sum())))
    assert torch.allclose(timesteps[~clean], sigma[~clean] * 1000)

    # the same loss by hand: each clip's mean over its noisy tokens, averaged over the clips
    model.zero_grad()
    with torch.no_grad():
        pred = model(*seen["args"], **seen["kwargs"])
    target = torch.cat([c.noise - c.x0 for c in clips])
    err = (pred - target).pow(2).mean(1)
    by_hand, start = 0.0, 0
    for c in clips:
        e, keep = err[start : start + c.num_tokens], ~frame0(c)
        by_hand += e[keep].mean() / len(clips)
        start += c.num_tokens
    # fp32 sums of ~30 terms of O(1) in two orders: 1e-6 relative is ~10x fp32 rounding
    assert abs(float(loss) - float(by_hand)) <= 1e-6 * abs(float(by_hand))

    # the noise drawn for clean tokens reaches neither the loss nor any gradient (bitwise: it is
    # replaced before the model and weighted by exactly zero after it)
    other = make_clips(noise_seed=100)
    for c, o in zip(clips, other):
        keep = ~frame0(c)
        o.noise[keep] = c.noise[keep]
    loss2, grads2 = loss_and_grads(model, other)
    assert torch.equal(loss, loss2)
    assert all(torch.equal(grads[k], grads2[k]) for k in grads)
    # ...while noise on a noisy token does change them (the check can fail)
    other[0].noise[-1] += 1.0
    assert not torch.equal(loss_and_grads(model, other)[0], loss)


def test_text_to_video_clips_run_per_clip():
    model = make_model()
    clips = make_clips()
    for c in clips:
        c.clean_first = False
    seen = {}
    model.register_forward_pre_hook(lambda m, args, kwargs: seen.update(kwargs=kwargs), with_kwargs=True)
    loss_and_grads(model, clips)
    assert "token_timesteps" not in seen["kwargs"]


def test_prepare_clip_draws_image_to_video_and_checks_the_model():
    sample = {"index": 4, "latent": torch.randn(4, 3, 4, 6), "text_emb": torch.randn(2, 8)}
    enc = type(
        "Cached", (), {"encode": lambda self, s, drop: (s["latent"], s["text_emb"]), "conditioning": None}
    )()
    always = FlowConfig(clean_first_frame=1.0)
    assert prepare_clip(sample, enc, (1, 2, 2), always, 0.0, 0, 0).clean_first
    assert not prepare_clip(sample, enc, (1, 2, 2), FlowConfig(), 0.0, 0, 0).clean_first
    image = {**sample, "latent": torch.randn(4, 1, 4, 6)}  # one frame: nothing left to denoise
    assert not prepare_clip(image, enc, (1, 2, 2), always, 0.0, 0, 0).clean_first
    # the T2V draws are unchanged by the option existing: same sigma and noise as before
    a = prepare_clip(sample, enc, (1, 2, 2), always, 0.0, 0, 0)
    b = prepare_clip(sample, enc, (1, 2, 2), FlowConfig(), 0.0, 0, 0)
    assert a.sigma == b.sigma and torch.equal(a.noise, b.noise)
    with pytest.raises(ValueError, match="needs a model with per-token timesteps"):
        check_ti2v_data(VideoDiT(**{**TINY, "expand_timesteps": False}).config, 4, 0.5, cached=True)
    with pytest.raises(ValueError, match="16-channel latents .the Wan2.1 VAE's. .*rebuild the cache"):
        check_ti2v_data({**TINY, "in_channels": 48}, 16, 0.5, cached=True)
    with pytest.raises(ValueError, match="temporal patch of 1"):
        check_ti2v_data({**TINY, "patch_size": (2, 2, 2)}, 4, 0.5, cached=True)


def _cp_worker(rank, world_size, out):
    try:
        model = make_model()
        clips = make_clips()
        n = sum(c.num_tokens for c in clips)
        results = {}
        for method in ("ring", "ulysses"):
            seq_lens = torch.tensor([c.num_tokens for c in clips])
            attention, info = make_cp_attention(
                dist.group.WORLD, seq_lens, method, TINY["num_attention_heads"]
            )
            model.zero_grad()
            loss = micro_batch_loss(model, clips, attention, len(clips), (info.start, info.end))
            loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total)
            grads = torch.cat([p.grad.flatten() for p in model.parameters()])
            dist.all_reduce(grads)
            results[method] = (float(total), grads)
        assert n > 0
        if rank == 0:
            torch.save(results, out)
    except Exception:
        traceback.print_exc()
        raise


def test_cp_equals_one_process(tmp_path):
    model = make_model()
    loss, grads = loss_and_grads(model, make_clips())
    flat = torch.cat([g.flatten() for g in grads.values()])
    out = tmp_path / "cp.pt"
    run_gloo(_cp_worker, 2, out)
    for method, (cp_loss, cp_grads) in torch.load(out).items():
        # fp32: the shards sum the same per-token terms in two parts; rounding ~1e-7 relative
        assert abs(cp_loss - float(loss)) <= 1e-6 * abs(float(loss)), method
        assert float((cp_grads - flat).abs().max()) <= 1e-5 * float(flat.abs().max()), method


def test_wan21_cache_under_ti2v_names_the_fix(tmp_path):
    """A latent cache encoded with the Wan2.1 VAE (16 channels, 4x8x8) under data.vae=wan2.2: one
    line naming the command that rebuilds it. (Under data.vae=wan, check_ti2v_data above catches the
    16 channels instead.)"""
    import json

    from data.cache_dataset import FORMAT, INDEX
    from dit.config import DataConfig
    from dit.setup import build_datasets

    index = {"format": FORMAT, "samples": [{"index": 0}], "vae": {"kind": "wan", "stride": [4, 8, 8]},
             "latent_channels": 16, "text_dim": 8}  # fmt: skip
    (tmp_path / INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"Wan2.1 VAE latents .* --vae wan2.2 --vae-path") as err:
        build_datasets(DataConfig(source=str(tmp_path), vae="wan2.2"), (1, 2, 2))
    assert "\n" not in str(err.value)


def test_routed_clips_keep_their_mode():
    """Dynamic-CP routes clips between ranks as a header plus one flat tensor: the image-to-video flag
    must survive (planted: _unflatten ignoring it -> fails)."""
    from dynamic_cp.runtime.routing import _flatten, _header, _unflatten

    for clip in make_clips():
        back = _unflatten(_header(7, clip), _flatten(clip))
        assert back.clean_first == clip.clean_first
        assert torch.equal(back.x0, clip.x0) and torch.equal(back.positions, clip.positions)


def test_wan21_checkpoint_under_the_ti2v_size_is_refused(tmp_path):
    """A Wan2.1 transformer (16 channels here 4) as model.pretrained under model.size=wan2.2-ti2v-5b:
    one line naming the fix (planted: the check removed -> the model loads with per-token timesteps)."""
    from diffusers import WanTransformer3DModel

    from dit.model_config import ModelConfig
    from dit.setup import build_model

    small = {k: v for k, v in TINY.items() if k not in ("adaln_zero_init", "expand_timesteps")}
    small["out_channels"] = 4  # diffusers defaults to 16
    WanTransformer3DModel(**small).save_pretrained(tmp_path / "t2v")
    with pytest.raises(
        ValueError, match=r"takes 4 latent channels but model.size=wan2.2-ti2v-5b is Wan2.2 TI2V"
    ):
        build_model(ModelConfig(size="wan2.2-ti2v-5b", pretrained=str(tmp_path / "t2v")))
    # the same folder marked as a TI2V pipeline loads per-token under its own size
    (tmp_path / "model_index.json").write_text('{"expand_timesteps": true}')
    WanTransformer3DModel(**small).save_pretrained(tmp_path / "transformer")
    assert build_model(ModelConfig(size="tiny", pretrained=str(tmp_path))).config.expand_timesteps
