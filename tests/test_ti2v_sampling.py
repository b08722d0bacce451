"""Wan2.2 VAE and TI2V sampling (dit/sampling.py) against diffusers.

The official Wan2.2 VAE config (z 48, 16x spatial via patch 2, residual, base 160, decoder 256)
builds on the meta device and our wrapper reads its 48 channels and (4, 16, 16) stride. A small
random Wan2.2-shaped AutoencoderKLWan (residual, patch 2, decoder wider than encoder, 16x spatial)
encodes and decodes through ``data.vaes.DiffusersVAE`` as the pipelines normalize.

Sampling parity: a small random TI2V-like transformer and that VAE, from the same initial noise, 3
guided Euler steps: ``WanPipeline(expand_timesteps=True)`` (text-to-video) and
``WanImageToVideoPipeline(expand_timesteps=True)`` (image-to-video: frame 0 = the image latent at
t = 0) give the latents of ``dit.sampling.generate`` within 1e-5. fp32: transformer outputs agree
to ~1e-6 (tests/test_wan_ti2v.py); each Euler step adds dt * v with dt <= 1 and guidance 4 amplifies
a velocity difference 7x (4 * cond - 3 * uncond), so 3 steps leave a few 1e-6 on latents of O(1).

Planted and watched fail (then restored): the image latent not put back in frame 0 before each step
(only at the end) -> the I2V latents differ by 0.19; frame-0 tokens at the step's t -> by 0.05.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch
from _wan_parity import TEXT_DIM, FixedText, as_tensor, pil_image
from accelerate import init_empty_weights
from diffusers import (
    AutoencoderKLWan,
    FlowMatchEulerDiscreteScheduler,
    WanImageToVideoPipeline,
    WanPipeline,
    WanTransformer3DModel,
)

from data.vaes import DiffusersVAE
from dit.sampling import generate
from dit.wan_import import import_wan_state_dict

# vae/config.json of Wan-AI/Wan2.2-TI2V-5B-Diffusers (diffusers' scripts/convert_wan_to_diffusers.py)
WAN22_VAE = dict(
    base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
    temperal_downsample=[False, True, True], dropout=0.0, is_residual=True, in_channels=12, out_channels=12,
    patch_size=2, scale_factor_temporal=4, scale_factor_spatial=16,
    latents_mean=[
        -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891,
        0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
        -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723,
        -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
    ],
    latents_std=[
        0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
        0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
        0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
        0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
    ],
)  # fmt: skip

Z = 8  # latent channels of the small VAE
HEIGHT, WIDTH, FRAMES = 64, 96, 5  # latent (2, 4, 6): 2 frames of 2 x 3 patches
WAN = dict(
    patch_size=(1, 2, 2), num_attention_heads=3, attention_head_dim=12, in_channels=Z, out_channels=Z,
    text_dim=TEXT_DIM, freq_dim=32, ffn_dim=40, num_layers=2,
)  # fmt: skip


def small_wan22_vae() -> AutoencoderKLWan:
    torch.manual_seed(0)
    return AutoencoderKLWan(
        base_dim=8, decoder_base_dim=16, z_dim=Z, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
        temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12,
        patch_size=2, scale_factor_temporal=4, scale_factor_spatial=16,
        latents_mean=[0.1 * i - 0.3 for i in range(Z)], latents_std=[0.5 + 0.2 * i for i in range(Z)],
    ).eval()  # fmt: skip


def test_official_vae_config_builds():
    with init_empty_weights():
        vae = AutoencoderKLWan(**WAN22_VAE)
    ours = DiffusersVAE("wan", vae, device="meta")
    assert ours.latent_channels == 48 and ours.stride == (4, 16, 16)
    assert ours._mean.shape == ours._std.shape == (1, 48, 1, 1, 1)
    # a config without scale_factor_spatial still gives 16x: 8x from the blocks, 2x from the patch
    cfg = {k: v for k, v in WAN22_VAE.items() if k != "scale_factor_spatial"}
    with init_empty_weights():
        vae = AutoencoderKLWan(**cfg, scale_factor_spatial=None)
    assert DiffusersVAE("wan", vae, device="meta").stride == (4, 16, 16)


def test_small_vae_encodes_and_decodes_as_the_pipeline():
    vae = small_wan22_vae()
    ours = DiffusersVAE("wan", vae)
    video = torch.rand(1, 3, FRAMES, 32, 48, generator=torch.Generator().manual_seed(1)) * 2 - 1
    mean = torch.tensor(vae.config.latents_mean).view(1, Z, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, Z, 1, 1, 1)
    with torch.no_grad():
        raw = vae.encode(video).latent_dist.mode()
        want = (raw - mean) * inv_std  # the pipelines' normalization (prepare_latents)
        got = ours.encode(video)
        assert got.shape == (1, Z, 2, 2, 3)  # 16x spatial, 4x temporal (causal)
        # x / s vs x * (1 / s): one rounding apart, ~1e-7 relative on values of O(1)
        assert float((got - want).abs().max()) <= 1e-6
        first = want[:, :, :1]  # one latent frame decodes the same way, at a quarter of the cost
        decoded = vae.decode(first / inv_std + mean).sample.clamp(-1, 1)  # the pipelines' decode
        assert float((ours.decode(first) - decoded).abs().max()) <= 1e-5


def make_image(seed: int) -> PIL.Image.Image:
    return pil_image(seed, HEIGHT, WIDTH)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    wan = WanTransformer3DModel(**WAN).eval()
    with torch.no_grad():  # larger than init: the time path and every block matter
        for p in wan.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model = import_wan_state_dict(wan.config, {k: v.clone() for k, v in wan.state_dict().items()})
    model.register_to_config(expand_timesteps=True)
    return wan, model, small_wan22_vae()


@pytest.mark.parametrize("mode", ["t2v", "i2v"])
def test_latents_equal_the_pipelines(models, mode):
    wan, model, vae = models
    text = FixedText()
    noise = torch.randn(1, Z, 2, HEIGHT // 16, WIDTH // 16, generator=torch.Generator().manual_seed(3))
    common = dict(vae=vae, tokenizer=None, text_encoder=None, transformer=wan, expand_timesteps=True,
                  scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0))  # fmt: skip
    call = dict(prompt_embeds=text.padded("a prompt"), negative_prompt_embeds=text.padded(""), height=HEIGHT,
                width=WIDTH, num_frames=FRAMES, num_inference_steps=3, guidance_scale=4.0, latents=noise.clone(),
                output_type="latent")  # fmt: skip
    image = make_image(1) if mode == "i2v" else None
    if image is None:
        want = WanPipeline(**common)(**call).frames[0]
    else:
        want = WanImageToVideoPipeline(**common)(image=image, **call).frames[0]
    got = generate(
        model, text, DiffusersVAE("wan", vae), ["a prompt"], FRAMES, HEIGHT, WIDTH, steps=3, guidance=4.0,
        shift=5.0, image=None if image is None else as_tensor(image), noise=noise, return_latents=True,
    )[0]  # fmt: skip
    assert got.shape == want.shape
    assert float((got - want).abs().max()) <= 1e-5
    assert float((want[:, 1:] - noise[0, :, 1:]).abs().max()) > 0.1  # the steps moved the latents
    if image is not None:  # frame 0 is the image's normalized latent
        latent = DiffusersVAE("wan", vae).encode(as_tensor(image)[None, :, None])[0]
        assert float((got[:, :1] - latent).abs().max()) <= 1e-6


def test_bad_inputs(models):
    _, model, vae = models
    run = dict(steps=1, guidance=1.0)
    image = torch.zeros(3, HEIGHT, WIDTH)
    with pytest.raises(ValueError, match="TI2V takes a first frame only; drop --last-image"):
        generate(model, FixedText(), DiffusersVAE("wan", vae), ["a prompt"], FRAMES, HEIGHT, WIDTH, image=image,
                 last_image=image, **run)  # fmt: skip
    with pytest.raises(ValueError, match=r"--image is 32x64 but the clip is 96x64"):
        generate(model, FixedText(), DiffusersVAE("wan", vae), ["a prompt"], FRAMES, HEIGHT, WIDTH,
                 image=torch.zeros(3, HEIGHT, 32), **run)  # fmt: skip


def test_train_then_sample_cli_with_image(tmp_path, capsys):
    """A tiny pixel-space TI2V run (per-token timesteps, half the clips image-to-video) trains through
    train.py and samples through sample.py --image (text-to-video sampling: the parity test above)."""
    import imageio.v2 as imageio
    from conftest import tiny_overrides

    import sample
    import train

    overrides = tiny_overrides(
        tmp_path,
        **{"train.max_steps": 1, "train.val_every": 1, "model.overrides": "{num_layers: 2, ffn_dim: 128, expand_timesteps: true}",
           "flow.clean_first_frame": 0.5},
    )  # fmt: skip
    config = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
    assert train.main(["--config", str(config), *overrides]) == 0
    png = tmp_path / "first.png"
    imageio.imwrite(png, np.random.default_rng(0).integers(0, 256, (8, 12, 3), dtype=np.uint8))
    args = ["--checkpoint", str(tmp_path / "run"), "--prompt", "a red circle", "--frames", "3", "--height", "8",
            "--width", "12", "--steps", "2", "--out", str(tmp_path / "samples")]  # fmt: skip
    assert sample.main([*args, "--image", str(png)]) == 0
    assert len([p for p in (tmp_path / "samples").iterdir() if p.suffix == ".mp4"]) == 1


def test_vae_kinds_are_told_apart(tmp_path):
    from data.vaes import load_vae, wan_vae_kind
    from dit.config import DataConfig
    from dit.setup import vae_stride

    small_wan22_vae().save_pretrained(tmp_path / "wan22")
    assert wan_vae_kind(tmp_path / "wan22") == "wan2.2"
    assert load_vae("wan2.2", str(tmp_path / "wan22")).stride == (4, 16, 16)
    with pytest.raises(
        ValueError, match=r"is the Wan2.2 VAE \(8 channels, stride \(4, 16, 16\)\); set data.vae=wan2.2"
    ):
        load_vae("wan", str(tmp_path / "wan22"))
    assert vae_stride(DataConfig(vae="wan2.2")) == (4, 16, 16)  # token counts before any VAE loads
    assert vae_stride(DataConfig(vae="wan")) == (4, 8, 8)
    from data.tokens import num_tokens

    # TI2V's 720p, 121 frames: 31 latent frames of 22 x 40 tokens, one token per 4 x 32 x 32 pixels
    assert (
        num_tokens(121, 704, 1280, vae_stride(DataConfig(vae="wan2.2")), (1, 2, 2)) == 31 * 22 * 40 == 27280
    )


def test_config_dry_run_prints_parameters_and_memory(capsys):
    import train

    config = Path(__file__).resolve().parents[1] / "configs" / "wan2.2-ti2v-5b-finetune.yaml"
    assert (
        train.main(["--config", str(config), "--dry-run", "--world-size", "8"]) == 1
    )  # /path/to placeholders
    out = capsys.readouterr().out
    assert "model: 5.00B parameters" in out and "memory per GPU" in out
    assert "model.pretrained=/path/to/Wan2.2-TI2V-5B-Diffusers does not exist" in out


# ----------------------------------------------------------------------------- several processes


def _pixel_ti2v():
    from dit.model import VideoDiT

    torch.manual_seed(0)
    return VideoDiT(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=8, in_channels=3, text_dim=16,
        freq_dim=16, ffn_dim=48, num_layers=2, adaln_zero_init=False, expand_timesteps=True,
    ).eval()  # fmt: skip


def _requests(folder: Path):
    from dit.sample_requests import SampleRequest

    png = folder / "first.png"
    if not png.exists():
        import imageio.v2 as imageio

        imageio.imwrite(png, np.random.default_rng(0).integers(0, 256, (6, 10, 3), dtype=np.uint8))
    return [
        SampleRequest(0, "a", 5, 6, 10, steps=3, guidance=4.0, seed=1, negative_prompt="b", image=str(png)),
        SampleRequest(1, "c", 3, 6, 10, steps=3, guidance=3.0, seed=2, image=str(png)),
        SampleRequest(2, "d", 3, 6, 10, steps=3, guidance=1.0, seed=3),  # text-to-video on the same model
    ]


def _cp_worker(rank, world_size, folder):
    import torch.distributed as dist

    from data.hashed_text import HashedTextEncoder
    from dynamic_cp.planning.sampling_planner import Placement, SamplingPlan
    from dynamic_cp.runtime.groups import build_cp_groups
    from dynamic_cp.runtime.sampling import run_plan

    plan = SamplingPlan(
        2,
        [
            Placement(0, (0, 1), None, (1, 2), 0.0, 0.0),  # ring over 2: frame 0 on rank 0's shard only
            Placement(1, (0,), (1,), (1, 1), 0.0, 0.0),  # CFG-parallel: one branch a rank
            Placement(2, (0, 1), None, (2, 1), 0.0, 0.0),  # Ulysses over 2
        ],
    )
    groups = build_cp_groups(dist.group.WORLD)
    videos = {}
    run_plan(_pixel_ti2v(), HashedTextEncoder(dim=16), None, _requests(folder), plan, groups, None,
             lambda r, v, p, s: videos.__setitem__(r.index, v))  # fmt: skip
    return videos


def test_several_processes_give_the_one_process_clips(tmp_path):
    """TI2V requests on 2 gloo ranks (ring, Ulysses, CFG-parallel) equal one process: each shard
    slices its own token timesteps. Tolerance as tests/test_sampling_parallel.py derives it (float32
    reassociation over 2 layers and 3 Euler steps: ~1e-6, under 1e-5 by design). Planted: the token
    timesteps not sliced to the shard -> the run fails."""
    from data.hashed_text import HashedTextEncoder
    from dit.sampling import sample_request
    from dynamic_cp.runtime.testing import run_gloo

    requests = _requests(tmp_path)
    refs = [sample_request(_pixel_ti2v(), HashedTextEncoder(dim=16), None, r) for r in requests]
    owned = {}
    for videos in run_gloo(_cp_worker, 2, tmp_path):
        owned.update(videos)
    assert sorted(owned) == [0, 1, 2]
    for i, ref in enumerate(refs):
        assert float((owned[i] - ref).abs().max()) <= 1e-5, i
    # frame 0 of image-to-video clips is the image (pixel space: the VAE is the identity)
    from data.image_encoders import read_image

    assert torch.equal(refs[0][:, 0], read_image(requests[0].image).clamp(-1, 1))
