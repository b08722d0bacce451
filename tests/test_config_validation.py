"""dit/config.py: every validation rule at its boundary (the last accepted value and the first rejected
one, the message naming the field), the documented defaults, and the loader's type handling."""

from __future__ import annotations

import re

import pytest

from dit.config import Config, TrainConfig, from_dict, load_config, to_dict
from dit.model_config import LoraSettings

LORA = "model.lora={rank: 4}"

# (overrides, None when accepted or the words the ValueError must contain)
CASES = [
    (["model.lora={rank: 1}"], None),
    (["model.lora={rank: 0}"], "model.lora.rank=0"),
    (["model.lora={rank: 4, alpha: 0.5}"], None),
    (["model.lora={rank: 4, alpha: 0}"], "model.lora.alpha=0"),
    (["model.lora={rank: 4, alpha: null}"], None),
    (["model.lora={target_modules: []}"], "model.lora.target_modules=[]"),
    (["model.lora={target_modules: ['']}"], "model.lora.target_modules"),
    (["model.lora={target_modules: [to_q, 3]}"], "model.lora.target_modules"),
    (["model.lora={dropout: 0.0}"], None),
    (["model.lora={dropout: 0.99}"], None),
    (["model.lora={dropout: 1.0}"], "model.lora.dropout=1.0"),
    (["model.lora={dropout: -0.1}"], "model.lora.dropout=-0.1"),
    (["model.size=huge"], "model.size='huge'"),
    (["model.lora_init=a.safetensors"], "needs model.lora"),
    (["model.lora_init=a.safetensors", LORA], None),
    (["data.caption_dropout=0"], None),
    (["data.caption_dropout=1"], "data.caption_dropout=1"),
    (["data.caption_dropout=-0.1"], "data.caption_dropout=-0.1"),
    (["data.num_workers=0"], None),
    (["data.num_workers=-1"], "data.num_workers=-1"),
    (["data.num_val_clips=1"], None),
    (["data.num_val_clips=0"], "data.num_val_clips=0"),
    (["flow.timestep_sampling=uniform"], None),
    (["flow.timestep_sampling=normal"], "flow.timestep_sampling='normal'"),
    (["flow.shift=0.1"], None),
    (["flow.shift=0"], "flow.shift=0"),
    (["flow.shift=null"], None),
    *[
        ([f"train.{n}=1"], None)
        for n in ("max_steps", "global_batch_size", "micro_batch_tokens", "log_every", "val_every")
    ],
    *[
        ([f"train.{n}=0"], f"train.{n}=0")
        for n in ("max_steps", "global_batch_size", "micro_batch_tokens", "log_every", "val_every")
    ],
    (["train.checkpoint_every=1", "train.keep_checkpoints=1"], None),
    (["train.checkpoint_every=0"], "train.checkpoint_every"),
    (["train.keep_checkpoints=0"], "train.keep_checkpoints"),
    (["train.lr=1e-9"], None),
    (["train.lr=0"], "train.lr=0"),
    (["train.ema_decay=0"], None),
    (["train.ema_decay=0.999"], None),
    (["train.ema_decay=1"], "train.ema_decay=1"),
    (["train.ema_decay=-0.1"], "train.ema_decay=-0.1"),
    (["train.mixed_precision=fp16"], "train.mixed_precision='fp16'"),
    (["train.mixed_precision=bf16"], None),
    (["train.betas=[0.9]"], "train.betas=[0.9]"),
    (["train.betas=[0.9, 0.99, 0.999]"], "train.betas"),
    (["train.lr_schedule=cosine"], None),
    (["train.lr_schedule=step"], "train.lr_schedule='step'"),
    (["train.warmup_steps=5", "train.lr_decay_steps=6"], None),
    (["train.warmup_steps=5", "train.lr_decay_steps=5"], "train.lr_decay_steps=5"),
    (["train.optimizer=adamw_8bit"], None),
    (["train.optimizer=sgd"], "train.optimizer='sgd'"),
    (["train.report_to=[jsonl, wandb, tensorboard]"], None),
    (["train.report_to=[jsonl, mlflow]"], "'mlflow'"),
    (["train.sample_every=0"], None),
    (["train.sample_every=-1"], "train.sample_every=-1"),
    (["train.sample_every=5"], "needs train.sample_prompts"),
    (["train.sample_every=5", "train.sample_prompts=[a red circle]"], None),
    (["train.sample_shape=[9, 16]"], "train.sample_shape=[9, 16]"),
    (["train.sample_steps=1"], None),
    (["train.sample_steps=0"], "train.sample_steps=0"),
    (["parallel.mode=pipeline"], "parallel.mode='pipeline'"),
    (["parallel.fsdp=zero3"], "parallel.fsdp='zero3'"),
    (["parallel.fsdp=per_step"], "parallel.fsdp=per_step shards"),
    (["parallel.fsdp=per_layer"], "parallel.fsdp=per_layer shards"),
    (["parallel.mode=static", "parallel.fsdp=per_step"], None),
    (["parallel.fsdp=none"], None),
    (["parallel.memory_gb=0.5"], None),
    (["parallel.memory_gb=0"], "parallel.memory_gb=0"),
    (["parallel.cp_method=ring"], None),
    (["parallel.cp_method=tree"], "parallel.cp_method='tree'"),
    (["parallel.static_cp_size=1"], None),
    (["parallel.static_cp_size=0"], "parallel.static_cp_size=0"),
    (["parallel.refit_every=1"], None),
    (["parallel.refit_every=0"], "parallel.refit_every=0"),
    (["parallel.explore_budget=0"], None),
    (["parallel.explore_budget=1"], None),
    (["parallel.explore_budget=-0.1"], "parallel.explore_budget=-0.1"),
    (["parallel.explore_budget=1.1"], "parallel.explore_budget=1.1"),
]


@pytest.mark.parametrize("items, error", CASES, ids=[" ".join(i) for i, _ in CASES])
def test_each_rule_at_its_boundary(items, error):
    if error is None:
        load_config(None, items)
    else:
        with pytest.raises(
            ValueError, match=error.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")
        ):
            load_config(None, items)


def test_yaml_no_means_mixed_precision_no():
    assert load_config(None, ["train.mixed_precision=no"]).train.mixed_precision == "no"  # YAML 1.1 false


def test_documented_defaults():
    cfg = load_config(None, [])
    assert to_dict(cfg) == to_dict(Config())
    t = cfg.train
    assert (t.max_steps, t.global_batch_size, t.micro_batch_tokens, t.lr, t.weight_decay, t.betas) == (
        300, 8, 4096, 3e-4, 0.0, [0.9, 0.99]
    )  # fmt: skip
    assert (t.warmup_steps, t.lr_schedule, t.lr_decay_steps, t.optimizer, t.grad_clip, t.ema_decay) == (
        20, "constant", None, "adamw", 1.0, 0.99
    )  # fmt: skip
    assert (t.mixed_precision, t.seed, t.log_every, t.val_every, t.checkpoint_every, t.keep_checkpoints) == (
        "auto", 0, 10, 50, 100, 2
    )  # fmt: skip
    assert (t.max_bad_steps, t.peak_tflops, t.report_to, t.sample_every, t.sample_prompts) == (
        20,
        None,
        ["jsonl"],
        0,
        [],
    )
    assert (t.sample_shape, t.sample_steps, t.sample_guidance) == ([9, 16, 16], 20, 4.0)
    lora = LoraSettings()
    assert (lora.rank, lora.alpha, lora.target_modules, lora.dropout) == (
        16,
        None,
        ["to_q", "to_k", "to_v", "to_out.0"],
        0.0,
    )
    f = cfg.flow
    assert (f.timestep_sampling, f.logit_mean, f.logit_std, f.shift, f.val_sigmas) == (
        "logit_normal", 0.0, 1.0, None, [0.1, 0.3, 0.5, 0.7, 0.9]
    )  # fmt: skip
    p = cfg.parallel
    assert (p.mode, p.cp_method, p.static_cp_size, p.cp_sizes, p.cap_tokens, p.hardware) == (
        "none", "auto", 1, None, None, "auto"
    )  # fmt: skip
    assert (p.learn_costs, p.refit_every, p.explore_budget, p.plan_ahead, p.shard_optimizer, p.fsdp, p.memory_gb) == (
        True, 10, 0.1, True, True, "auto", None
    )  # fmt: skip
    m, d = cfg.model, cfg.data
    assert (m.size, m.overrides, m.pretrained, m.gradient_checkpointing, m.lora, m.lora_init, m.compile) == (
        "tiny", {}, None, False, None, None, False
    )  # fmt: skip
    assert (d.source, d.num_clips, d.frame_counts, d.resolutions, d.max_shapes, d.vae, d.text_encoder) == (
        "synthetic", 2048, [1, 5, 9], [[16, 16], [16, 24], [24, 16]], 2, "identity", "hashed"
    )  # fmt: skip
    assert (d.text_max_length, d.caption_dropout, d.num_workers, d.num_val_clips, d.seed, cfg.output_dir) == (
        512, 0.1, 0, 16, 0, "runs/tiny"
    )  # fmt: skip


def test_values_are_converted_or_rejected_by_their_type():
    cfg = load_config(
        None, ["train.lr=1", "train.weight_decay=1e-5", "train.betas=[0.8, 0.9]", "flow.shift=2"]
    )
    assert (cfg.train.lr, cfg.train.weight_decay, cfg.flow.shift) == (1.0, 1e-5, 2.0)
    assert all(isinstance(x, float) for x in (cfg.train.lr, cfg.train.weight_decay, cfg.flow.shift))
    assert from_dict(TrainConfig, {"weight_decay": "1e-5", "betas": (0.8, 0.9)}).betas == [0.8, 0.9]
    assert from_dict(TrainConfig, {"weight_decay": "1e-5"}).weight_decay == 1e-5  # YAML 1.1 reads it as text
    for items, words in [
        (["train.max_steps=true"], "train.max_steps=True must be"),
        (["train.max_steps=1.5"], "train.max_steps=1.5 must be of type int"),
        (["train.lr=fast"], "train.lr='fast'"),
        (["flow.shift=[1]"], "flow.shift=[1] does not fit"),
        (
            ["train.compile=true"],
            "unknown config key train.compile; valid keys here are: async_checkpoint, betas, checkpoint_every",
        ),
        (["train=3"], "train must be a mapping, got 3"),
        (["model.lora=5"], "model.lora must be a mapping"),
        (["train.max_steps"], "must look like section.key=value"),
        (["train.max_steps=3", "train.max_steps.x=1"], "max_steps is not a section"),
        (["train.betas=[0.9"], "is not valid YAML at line 1"),
    ]:
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace(".", r"\.")):
            load_config(None, items)
    assert load_config(None, ["output_dir=runs/lr=1e-4"]).output_dir == "runs/lr=1e-4"  # '=' in a value
    assert load_config(None, ["model.lora={}"]).model.lora == LoraSettings()  # an empty section: defaults
    assert load_config(None, ["model.lora=null"]).model.lora is None


def test_config_files_are_checked(tmp_path):
    with pytest.raises(ValueError, match="does not exist; pass --config"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"output_dir: caf\xe9\n")
    with pytest.raises(ValueError, match="is not UTF-8 text"):
        load_config(bad)
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="must hold a mapping of sections, got list"):
        load_config(tmp_path / "list.yaml")
    (tmp_path / "empty.yaml").write_text("")
    assert load_config(tmp_path / "empty.yaml") == Config()
    (tmp_path / "run.yaml").write_text("train:\n  max_steps: 7\n")
    assert (
        load_config(str(tmp_path / "run.yaml"), ["train.max_steps=9"]).train.max_steps == 9
    )  # overrides last
    assert load_config(tmp_path / "run.yaml").train.max_steps == 7


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.pp_size=0"], "pp_size=0 must be >= 1"),
        (["parallel.pp_size=2"], "set parallel.mode=static or dynamic"),
        (["parallel.mode=dynamic", "parallel.pp_size=2", "parallel.pp_layers=[2]"], "must list pp_size=2"),
        (["parallel.mode=dynamic", "parallel.pp_size=2", "parallel.pp_layers=[2,0]"], "at least 1 each"),
        (["parallel.pp_schedule=zb"], "use '1f1b' or 'gpipe'"),
    ],
)
def test_pipeline_settings_are_checked(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(None, overrides)
    cfg = load_config(None, ["parallel.mode=dynamic", "parallel.pp_size=2", "parallel.pp_layers=[1,1]"])
    assert (cfg.parallel.pp_size, cfg.parallel.pp_layers, cfg.parallel.pp_schedule) == (2, [1, 1], "1f1b")
