"""Image-to-video sampling (dit/sampling.py) equals diffusers' WanImageToVideoPipeline.

A small random I2V (and FLF2V) WanTransformer3DModel, a small random AutoencoderKLWan and a small
random CLIPVisionModel (from a config, saved to a local folder as data.image_encoder_path would name
it): from the same initial noise, 3 guided Euler steps give the same latents within 1e-5. fp32: the
transformer outputs agree to ~1e-6 (tests/test_wan_i2v.py); each Euler step adds dt * v with dt <= 1
and guidance 4 amplifies a velocity difference 7x (4 * cond - 3 * uncond), so 3 steps leave a few
1e-6 on latents of O(1), under 1e-5 with margin. Bad inputs get one-line errors.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch
from _wan_parity import TEXT_DIM, FixedText, as_tensor, pil_image
from conftest import save_small_clip
from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline, WanTransformer3DModel
from test_image_cond import small_vae

from data.image_encoders import load_image_encoder
from data.vaes import DiffusersVAE
from dit.sampling import generate
from dit.wan_import import import_wan_state_dict

SIZE = 32  # the small CLIP's input size: the processor's resize and crop are no-ops
FRAMES = 5
WAN = dict(
    patch_size=(1, 2, 2), num_attention_heads=3, attention_head_dim=12, in_channels=36, out_channels=16,
    text_dim=TEXT_DIM, freq_dim=32, ffn_dim=40, num_layers=2, image_dim=12, added_kv_proj_dim=36,
)  # fmt: skip


def make_image(seed: int) -> PIL.Image.Image:
    return pil_image(seed, SIZE, SIZE)


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    return load_image_encoder(save_small_clip(tmp_path_factory.mktemp("clip") / "image_encoder"))


@pytest.mark.parametrize("flf2v", [False, True], ids=["i2v", "flf2v"])
def test_latents_equal_the_pipelines(clip, flf2v):
    torch.manual_seed(0)
    wan = WanTransformer3DModel(**WAN, pos_embed_seq_len=10 if flf2v else None).eval()
    with torch.no_grad():
        for p in wan.parameters():  # off diffusers' zero pos_embed, and larger than init
            p.add_(0.1 * torch.randn_like(p))
    vae, text = small_vae(), FixedText()
    first, last = make_image(1), (make_image(2) if flf2v else None)
    noise = torch.randn(1, 16, 2, SIZE // 8, SIZE // 8, generator=torch.Generator().manual_seed(3))
    pipe = WanImageToVideoPipeline(
        tokenizer=None, text_encoder=None, image_encoder=clip.model, image_processor=clip.processor,
        transformer=wan, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )  # fmt: skip
    want = pipe(
        image=first, last_image=last, prompt_embeds=text.padded("a prompt"), negative_prompt_embeds=text.padded(""),
        height=SIZE, width=SIZE, num_frames=FRAMES, num_inference_steps=3, guidance_scale=4.0,
        latents=noise.clone(), output_type="latent",
    ).frames[0]  # fmt: skip

    model = import_wan_state_dict(wan.config, {k: v.clone() for k, v in wan.state_dict().items()})
    got = generate(
        model, text, DiffusersVAE("wan", vae), ["a prompt"], FRAMES, SIZE, SIZE, steps=3, guidance=4.0,
        shift=3.0, image=as_tensor(first), last_image=None if last is None else as_tensor(last),
        image_encoder=clip, noise=noise, return_latents=True,
    )[0]  # fmt: skip
    assert got.shape == want.shape
    assert float((got - want).abs().max()) <= 1e-5
    assert float((want - noise[0]).abs().max()) > 0.1  # the steps moved the latents


def test_bad_inputs(clip):
    torch.manual_seed(0)
    model = import_wan_state_dict(
        WanTransformer3DModel(**WAN).config, WanTransformer3DModel(**WAN).state_dict()
    )
    vae, text = DiffusersVAE("wan", small_vae()), FixedText()
    run = dict(steps=1, guidance=1.0, image_encoder=clip)
    with pytest.raises(ValueError, match="image-to-video model: pass the first frame with --image PATH"):
        generate(model, text, vae, ["a prompt"], FRAMES, SIZE, SIZE, **run)
    with pytest.raises(ValueError, match=r"--image is 16x32 but the clip is 32x32.*--width 16 --height 32"):
        generate(model, text, vae, ["a prompt"], FRAMES, SIZE, SIZE, image=torch.zeros(3, 32, 16), **run)
    with pytest.raises(ValueError, match="takes no --last-image"):
        image = torch.zeros(3, SIZE, SIZE)
        generate(model, text, vae, ["a prompt"], FRAMES, SIZE, SIZE, image=image, last_image=image, **run)


def test_train_then_sample_cli_with_image(tmp_path, capsys):
    """A tiny pixel-space image-to-video run (3 + 1 mask + 3 channels, no CLIP: Wan2.2-I2V style) trains
    through train.py and samples through sample.py --image; without --image it says so in one line."""
    import imageio.v2 as imageio
    from conftest import tiny_overrides

    import sample
    import train

    overrides = tiny_overrides(
        tmp_path,
        **{
            "train.max_steps": 2,
            "model.overrides": "{num_layers: 2, ffn_dim: 128, in_channels: 7, out_channels: 3}",
        },
    )
    assert (
        train.main(
            ["--config", str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"), *overrides]
        )
        == 0
    )
    png = tmp_path / "first.png"
    imageio.imwrite(png, np.random.default_rng(0).integers(0, 256, (8, 12, 3), dtype=np.uint8))
    args = ["--checkpoint", str(tmp_path / "run"), "--prompt", "a red circle", "--frames", "3", "--height", "8",
            "--width", "12", "--steps", "2", "--out", str(tmp_path / "samples")]  # fmt: skip
    capsys.readouterr()
    assert sample.main([*args, "--image", str(png)]) == 0
    assert any(p.suffix == ".mp4" for p in (tmp_path / "samples").iterdir())
    capsys.readouterr()
    assert sample.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pass the first frame with --image PATH" in err[0], err
    assert sample.main([*args, "--image", str(tmp_path / "nope.png")]) == 2
    assert "does not exist" in capsys.readouterr().err
    from dit.config import load_config
    from dit.trainer import Trainer

    config = load_config(
        Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml",
        [*overrides, "train.sample_every=5", "train.sample_prompts=[a red circle]"],
    )
    with pytest.raises(ValueError, match="train.sample_every=5: .* set train.sample_every=0"):
        Trainer(config, device=torch.device("cpu"))
