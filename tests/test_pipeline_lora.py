"""LoRA under pipeline stages (``parallel.pp_size`` with ``model.lora``) equals one process.

A PP 2 x 2 run (W=4, dynamic CP, 1F1B; the data and model of tests/test_pipeline.py, rank-4
adapters on the attention, the FFN output and the head's ``proj_out``, so both stages hold
adapters and the last one holds the head's) trains 3 steps with checkpoints at steps 2 and 3. Each
step's loss and gradient norm and every weight after step 3 (the adapters; the frozen base stays
the perturbed init) must match the single-process run of tests/test_fsdp.one_process_run, within
tests/test_pipeline.py's reordered-sum bounds (a pipeline and LoRA change no arithmetic inside a
micro-batch: the base is frozen fp32 here and only the order of fp32 sums differs).

Checkpoints: each stage writes its adapters alone (no base), and rank 0 merges every stage's into
the checkpoint's ``model/`` and ``ema/`` LoRA files; the run's export (rank 0's
``pytorch_lora_weights.safetensors``) is the final merge: the full adapter set in diffusers' format,
the keys ``dit.lora.lora_state`` gives a whole model and, for ``model/``, the single-process values.
The step-2 checkpoint resumed at PP 2 x 1 (W=2) and without a pipeline (W=2, pp_size 1) ends at the
single-process adapters of 3 steps within the same bound, its EMA one step on from the saved one.

The data are tests/test_pipeline.py's, whose W=4 dynamic case is checked to plan CP 2 micro-batches.
Planted and seen to fail (commit body): the export written from rank 0's stage alone (blocks 0-1
only), the merge reading stage 0's files only, a stage saving its frozen base too.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dit.config import load_config
from dit.lora import WEIGHT_NAME, lora_state, read_lora
from dynamic_cp.runtime.testing import run_gloo
from tests.test_fsdp import CONFIG, one_process_run
from tests.test_pipeline import (
    GRAD_NORM_REL,
    LOSS_REL,
    STEPS,
    _params_of,
    _train,
    assert_ema_resumed,
    assert_weights_close,
    overrides,
)

pytestmark = pytest.mark.timeout(900)
# tests/test_fsdp.py's model with a random (not adaLN-zero) init under the perturbation: LoRA on the
# seeded init is refused (its zero output layer gives every adapter a zero gradient)
_MODEL = dict(item.split("=", 1) for item in overrides("-"))["model.overrides"]
LORA = {
    "model.lora": "{rank: 4, alpha: 8, target_modules: [to_q, to_k, to_v, to_out.0, ffn.net.2, proj_out]}",
    "model.overrides": _MODEL.removesuffix("}") + ", adaln_zero_init: false}",
}
RUN = {**LORA, "parallel.pp_size": 2, "train.max_steps": STEPS, "train.checkpoint_every": 2}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process: per-step metrics, final weights, and the diffusers-format adapters of a whole model."""
    out = str(tmp_path_factory.mktemp("one"))
    cfg = load_config(CONFIG, overrides(out, **{**LORA, "parallel.mode": "none"}))
    steps, params = one_process_run(cfg, STEPS)
    from dit.trainer import Trainer

    whole = Trainer(cfg, device=torch.device("cpu")).model
    assert not whole.load_state_dict(params, strict=False).unexpected_keys
    return steps, params, lora_state(whole)


def test_lora_stage_checkpoints_export_and_resume_equal_one_process(reference, tmp_path):
    ref_steps, ref_params, ref_lora = reference
    res = run_gloo(_train, 4, str(tmp_path / "pp2"), RUN, None, timeout_s=180)
    assert_weights_close(_params_of(res), ref_params, "PP 2 x 2 LoRA")
    logged = [json.loads(line) for line in (tmp_path / "pp2" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in logged if "loss" in r]
    assert len(logged) == STEPS
    assert all(ref["grad_norm"] > 0 for ref in ref_steps)  # the adapters train
    for s, (got, ref) in enumerate(zip(logged, ref_steps)):
        assert got["loss"] == pytest.approx(ref["loss"], rel=LOSS_REL), f"step {s + 1} loss"
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=GRAD_NORM_REL), f"step {s + 1}"

    # the stage files: each stage's adapters, no base weight
    final = tmp_path / "pp2" / "checkpoints" / f"step_{STEPS:06d}"
    adapters = {n for n, p in ref_params.items() if ".lora_" in n}
    stage_keys = [set(load_file(str(d / "model.safetensors"))) for d in sorted((final / "stages").iterdir())]
    assert all(keys and keys <= adapters for keys in stage_keys), "a stage saved more than its adapters"
    assert set().union(*stage_keys) == adapters and sum(map(len, stage_keys)) == len(adapters)
    # the merged checkpoint files and the export: every stage's adapters, in diffusers' format
    live, _ = read_lora(final / "model")
    assert live.keys() == ref_lora.keys(), f"merged model/ lacks {sorted(ref_lora.keys() - live.keys())[:3]}"
    assert_weights_close(live, ref_lora, "merged model/ LoRA")
    ema, _ = read_lora(final / "ema")
    export = tmp_path / "pp2" / WEIGHT_NAME
    assert export.read_bytes() == (final / "ema" / WEIGHT_NAME).read_bytes(), "the export is not the merge"
    exported, _ = read_lora(export)
    assert exported.keys() == ref_lora.keys(), f"export lacks {sorted(ref_lora.keys() - exported.keys())[:3]}"
    stage_ema = {}
    for d in sorted((final / "stages").iterdir()):
        stage_ema.update(load_file(str(d / "ema.safetensors")))
    assert stage_ema.keys() == adapters
    for key, t in exported.items():  # transformer.{module}.lora_A.weight <- {module}.lora_A.default.weight
        name = key.removeprefix("transformer.").removesuffix(".weight") + ".default.weight"
        assert torch.equal(t, stage_ema[name]), f"export {key} is not stage EMA {name}"
    assert not torch.equal(ema[key], live[key]), "the EMA export holds the live adapters"

    # the step-2 checkpoint resumed on two ranks: PP 2 x 1, and no pipeline
    step_dir = tmp_path / "pp2" / "checkpoints" / "step_000002"
    for pp, cap in ((2, 200), (1, 96)):
        then = {**LORA, "parallel.pp_size": pp, "train.max_steps": STEPS, "parallel.cap_tokens": cap}
        res = run_gloo(_train, 2, str(tmp_path / f"resumed{pp}"), then, str(step_dir), timeout_s=180)
        assert_weights_close(_params_of(res), ref_params, f"LoRA resumed at pp_size={pp}")
        assert_ema_resumed(res, step_dir)


def test_stage_lora_merge_and_export_without_processes(tmp_path):
    """``save_stages_lora`` of every stage's adapters, written from one stage, is ``save_lora`` of the
    whole model (keys, values, peft config); ``stage_export`` copies a stage's checkpoint merge (the
    EMA's or the live one), refuses a stage whose checkpoint has none, and leaves a whole model to
    ``save_model_lora``. No process is spawned."""
    import copy
    import shutil

    from dit.lora import add_lora, freeze_base, peft_config, save_lora, save_stages_lora, stage_export
    from dit.model import VideoDiT
    from dit.model_config import LoraSettings
    from dit.stages import keep_stage

    model = VideoDiT(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
        text_dim=20, freq_dim=16, ffn_dim=40, num_layers=2,
    )  # fmt: skip
    freeze_base(model, torch.float32)
    add_lora(model, peft_config(LoraSettings(rank=2, target_modules=["to_q", "ffn.net.2", "proj_out"])))
    g = torch.Generator().manual_seed(0)
    adapters = {n: p for n, p in model.named_parameters() if ".lora_" in n}
    with torch.no_grad():
        for p in adapters.values():
            p.copy_(torch.randn(p.shape, generator=g))
    save_lora(model, tmp_path / "whole")
    stage = keep_stage(copy.deepcopy(model), range(0, 1), True, False)  # blocks.1 and proj_out elsewhere
    assert any(".lora_" in n for n, _ in stage.named_parameters())
    save_stages_lora(stage, tmp_path / "merged", {n: p.detach() for n, p in adapters.items()})
    (want, want_config), (got, got_config) = read_lora(tmp_path / "whole"), read_lora(tmp_path / "merged")
    assert got.keys() == want.keys() and got_config == want_config
    assert all(torch.equal(got[k], want[k]) for k in want)

    run = tmp_path / "run"
    assert stage_export(model, run, 3, True) is None  # a whole model exports itself
    with pytest.raises(ValueError, match=r"step_000003/ema/pytorch_lora_weights.safetensors is missing"):
        stage_export(stage, run, 3, True)
    ckpt = run / "checkpoints" / "step_000003"
    shutil.copytree(tmp_path / "merged", ckpt / "ema")
    shutil.copytree(tmp_path / "whole", ckpt / "model")
    (ckpt / "model" / WEIGHT_NAME).write_bytes(b"live")  # tell the two apart
    for ema, folder in ((True, "ema"), (False, "model")):
        assert stage_export(stage, run, 3, ema) == [run / WEIGHT_NAME]
        assert (run / WEIGHT_NAME).read_bytes() == (ckpt / folder / WEIGHT_NAME).read_bytes()
