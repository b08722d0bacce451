"""Wan2.2 A14B: the experts' architecture, loading one expert of a pipeline folder, and sampling with
both, switching where diffusers' WanPipeline / WanImageToVideoPipeline do.

Sampling parity: small random experts (two WanTransformer3DModels of different weights), a small
random AutoencoderKLWan; from the same initial noise, 6 guided Euler steps (the official shifts and
switches: each expert runs some steps, the same ones as in the pipeline) give the pipeline's latents
within 1e-5. fp32:
each transformer output agrees to ~1e-6 (tests/test_wan_parity.py); a step adds dt * v with dt <= 1 and
guidance 4 amplifies a velocity difference 7x (4 cond - 3 uncond), so 6 steps leave some 1e-6.

Planted and caught by test_latents_equal_the_two_expert_pipelines: ExpertPair running the high expert
at every step (its call counts differ from the pipeline's), and guidance_at ignoring guidance_2
(latents off by 1e-2).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from _wan_parity import FixedText, as_tensor, pil_image
from accelerate import init_empty_weights
from test_i2v_sampling import FRAMES, SIZE
from test_image_cond import small_vae

from data.vaes import DiffusersVAE
from dit.experts import ExpertPair
from dit.sampling import generate
from dit.sizes import MODEL_SIZES, model_kwargs
from dit.wan_import import _check_names, _empty_model, import_wan_state_dict, load_pretrained, videodit_config

# transformer/config.json (= transformer_2/config.json) of Wan-AI/Wan2.2-T2V-A14B-Diffusers and
# Wan2.2-I2V-A14B-Diffusers: Wan2.1-T2V-14B's shape; I2V takes 16 noisy + 4 mask + 16 image-latent
# channels and no CLIP tokens (image_dim None). Parameter counts in billions.
T2V_A14B = dict(
    patch_size=[1, 2, 2], num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None, rope_max_seq_len=1024,
)  # fmt: skip
OFFICIAL = {
    "wan2.2-t2v-a14b": (T2V_A14B, 14.288),
    "wan2.2-i2v-a14b": ({**T2V_A14B, "in_channels": 36}, 14.289),
}
SMALL = dict(
    patch_size=(1, 2, 2), num_attention_heads=3, attention_head_dim=12, in_channels=16, out_channels=16,
    text_dim=16, freq_dim=32, ffn_dim=40, num_layers=2,
)  # fmt: skip


@pytest.mark.parametrize("size", OFFICIAL)
def test_official_expert_configs_match_diffusers_on_meta_device(size):
    from diffusers import WanTransformer3DModel

    config, billions = OFFICIAL[size]
    with init_empty_weights():
        wan = WanTransformer3DModel(**config)
    shapes = {k: tuple(v.shape) for k, v in wan.state_dict().items()}
    model = _empty_model(model_kwargs(size))
    assert sorted(_check_names(model, shapes, size)) == sorted(shapes)  # same names, and shapes
    count = sum(p.numel() for p in model.parameters())
    assert count == sum(p.numel() for p in wan.parameters())
    assert round(count / 1e9, 3) == billions
    imported = videodit_config(config)  # the importer maps the published config to the named size
    assert all(imported[k] == v for k, v in MODEL_SIZES[size].items())


def random_expert(seed: int, in_channels: int = 16):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    wan = WanTransformer3DModel(**{**SMALL, "in_channels": in_channels}).eval()
    with torch.no_grad():
        for p in wan.parameters():  # off diffusers' zero inits, and larger than init
            p.add_(0.1 * torch.randn_like(p))
    return wan


def ours(wan):
    return import_wan_state_dict(wan.config, {k: v.clone() for k, v in wan.state_dict().items()})


def save_two_experts(root, ratio: float = 0.875):
    """transformer/ (seed 1), transformer_2/ (seed 2) and model_index.json, as an A14B folder holds them."""
    random_expert(1).save_pretrained(root / "transformer")
    random_expert(2).save_pretrained(root / "transformer_2")
    index = {"_class_name": "WanPipeline", "boundary_ratio": ratio, "expand_timesteps": False,
             "transformer": ["diffusers", "WanTransformer3DModel"],
             "transformer_2": ["diffusers", "WanTransformer3DModel"]}  # fmt: skip
    (root / "model_index.json").write_text(json.dumps(index))
    return root


def test_an_expert_loads_from_the_pipeline_folder(tmp_path):
    from dit.model_config import ModelConfig
    from dit.setup import build_model, expert_of

    root = save_two_experts(tmp_path / "a14b")
    for expert, seed in (("high", 1), ("low", 2)):
        want = random_expert(seed).state_dict()
        got = load_pretrained(root, expert=expert).state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want if k != "patch_embedding.weight"), expert
        cfg = ModelConfig(size="wan2.2-t2v-a14b", pretrained=str(root), expert=expert)
        assert torch.equal(
            build_model(cfg).state_dict()["blocks.0.attn1.to_q.weight"], want["blocks.0.attn1.to_q.weight"]
        )
        assert expert_of(cfg) == (expert, 0.875)  # the switch from model_index.json
    with pytest.raises(ValueError, match="two-expert pipeline; set model.expert=high .* or model.expert=low"):
        load_pretrained(root)
    from dit.wan_import import main

    assert main(["import", "--wan", str(root), "--out", str(tmp_path / "ours"), "--expert", "low"]) == 0
    got, want = (
        load_pretrained(tmp_path / "ours").state_dict(),
        load_pretrained(root, expert="low").state_dict(),
    )
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(ValueError, match=r"model.boundary_ratio=0.9 but .* switches experts at 0.875; drop"):
        expert_of(ModelConfig(pretrained=str(root), expert="low", boundary_ratio=0.9))
    random_expert(1).save_pretrained(tmp_path / "one" / "transformer")
    with pytest.raises(ValueError, match="has one transformer, not Wan2.2's two experts; drop model.expert"):
        load_pretrained(tmp_path / "one", expert="high")


@pytest.mark.parametrize("task", ["t2v", "i2v"])
def test_latents_equal_the_two_expert_pipelines(task):
    from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline, WanPipeline

    i2v = task == "i2v"
    ratio, shift = (0.9, 5.0) if i2v else (0.875, 12.0)  # the official switches and sampling shifts
    high, low = random_expert(1, 36 if i2v else 16), random_expert(2, 36 if i2v else 16)
    vae, text = small_vae(), FixedText()
    first = pil_image(1, SIZE, SIZE)
    noise = torch.randn(1, 16, 2, SIZE // 8, SIZE // 8, generator=torch.Generator().manual_seed(3))
    parts = dict(tokenizer=None, text_encoder=None, transformer=high, transformer_2=low, boundary_ratio=ratio,
                 vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=shift))  # fmt: skip
    pipe = (
        WanImageToVideoPipeline(image_encoder=None, image_processor=None, **parts)
        if i2v
        else WanPipeline(**parts)
    )
    theirs = count_calls({"high": high, "low": low})
    want = pipe(
        **({"image": first} if i2v else {}), prompt_embeds=text.padded("a prompt"),
        negative_prompt_embeds=text.padded(""), height=SIZE, width=SIZE, num_frames=FRAMES, num_inference_steps=6,
        guidance_scale=4.0, guidance_scale_2=3.0, latents=noise.clone(), output_type="latent",
    ).frames[0]  # fmt: skip

    model = ExpertPair(ours(high), ours(low), ratio)
    calls = count_calls({"high": model.high, "low": model.low})
    got = generate(
        model, text, DiffusersVAE("wan", vae), ["a prompt"], FRAMES, SIZE, SIZE, steps=6, guidance=4.0,
        guidance_2=3.0, shift=shift, image=as_tensor(first) if i2v else None, noise=noise, return_latents=True,
    )[0]  # fmt: skip
    # each expert at the pipeline's steps: its two branches in one packed call, the pipeline's in two
    assert {k: 2 * n for k, n in calls.items()} == theirs and min(calls.values()) > 0, (calls, theirs)
    assert got.shape == want.shape
    assert float((got - want).abs().max()) <= 1e-5
    assert float((want - noise[0]).abs().max()) > 0.1  # the steps moved the latents


def count_calls(modules: dict) -> dict:
    calls = dict.fromkeys(modules, 0)
    for name, module in modules.items():
        module.register_forward_hook(lambda *_, n=name: calls.__setitem__(n, calls[n] + 1))
    return calls


def test_guidance_2_needs_two_experts():
    vae, text = DiffusersVAE("wan", small_vae()), FixedText()
    with pytest.raises(
        ValueError, match="guidance_2 is the low-noise expert's guidance .* drop --guidance-2"
    ):
        generate(ours(random_expert(1)), text, vae, ["a prompt"], FRAMES, SIZE, SIZE, steps=1, guidance_2=3.0)


def test_sample_cli_on_a_two_expert_folder(tmp_path, capsys):
    """sample.py --pretrained on an A14B-shaped folder: both experts, --guidance-2 and a queue's guidance_2."""
    import imageio.v3 as iio
    from diffusers import WanTransformer3DModel
    from test_sample_pretrained import WAN, save_wan_pipeline

    import sample
    from dit.sampler_setup import load_pretrained_sampler

    root = save_wan_pipeline(tmp_path / "Wan2.2-tiny")
    torch.manual_seed(1)
    WanTransformer3DModel(**WAN).save_pretrained(root / "transformer_2")
    index = {"_class_name": "WanPipeline", "boundary_ratio": 0.875, "transformer_2": ["diffusers", "X"]}
    (root / "model_index.json").write_text(json.dumps(index))
    sampler = load_pretrained_sampler(str(root), None, 1.0, "cpu")
    assert isinstance(sampler.model, ExpertPair) and sampler.model.boundary_ratio == 0.875
    (tmp_path / "q.jsonl").write_text('{"prompt": "a dog", "guidance_2": 1.5}\n')
    argv = ["--pretrained", str(root), "--prompt", "a cat", "--prompts-file", str(tmp_path / "q.jsonl"),
            "--guidance-2", "2.0", "--frames", "1", "--height", "16", "--width", "16", "--steps", "3",
            "--shift", "12", "--out", str(tmp_path / "out")]  # fmt: skip
    assert sample.main(argv) == 0
    clips = [iio.imread(c) for c in sorted((tmp_path / "out").glob("*.mp4"))]
    assert [c.shape[:3] for c in clips] == [(1, 16, 16)] * 2
    argv_host = [*argv[:-1], str(tmp_path / "host"), "--idle-expert", "cpu"]  # the idle expert on the host
    assert sample.main(argv_host) == 0
    for clip, host in zip(clips, sorted((tmp_path / "host").glob("*.mp4")), strict=True):
        np.testing.assert_array_equal(clip, iio.imread(host))
    on_host = load_pretrained_sampler(str(root), None, 1.0, "cpu", lowmem=("auto", "auto", None, "cpu"))
    assert on_host.idle_host.on_host == {"low"} and on_host.idle_host.device_bytes("low") == 0
    capsys.readouterr()
    assert sample.main([*argv, "--lora", str(tmp_path / "x.safetensors")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "two-expert (Wan2.2 A14B) folder, is not supported yet" in err[0], err


@pytest.mark.parametrize("task, switch", [("t2v", 875), ("i2v", 900)])
def test_a14b_config_dry_run_prints_parameters_per_expert_and_memory(capsys, task, switch):
    """The shipped recipes: 14.29B for its one expert, its side of the switch, and the LoRA memory of a
    frozen bf16 base (28.7 GB of weights; planted: pricing it as full training, 57.2 fp32, fails)."""
    from pathlib import Path

    import train

    config = Path(__file__).resolve().parents[1] / "configs" / f"wan2.2-{task}-a14b-lora.yaml"
    assert train.main(["--config", str(config), "--dry-run"]) == 1  # the /path/to placeholders are missing
    out = capsys.readouterr().out
    assert "model: 14.29B parameters" in out and f"model.expert=high (t >= {switch})" in out
    assert "memory per GPU" in out and "weights 28.7," in out
    assert f"model.pretrained=/path/to/Wan2.2-{task.upper()}-A14B-Diffusers does not exist" in out
