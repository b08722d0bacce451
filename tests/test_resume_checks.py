"""What a resume checks before it builds anything (dit/resume_checks.py, dit/checkpoint_whole.py):
which format a checkpoint is in and whether it is whole, that a run with checkpoints never starts
fresh, and that a resume on other data/model/flow settings stops in one line (issue 54, item 2).

The format cases write real files of each kind (safetensors, a torch.save zip, the config) the way
the savers lay them out; the resumes run the tiny model through train.py. The formats' real runs,
resumed under every layout, are in tests/test_resume_formats.py.

Planted and seen to fail: the whole-checkpoint test ignoring stage files; the stage count not read
from config.yaml (a missing stage passes); a free key (data.num_workers) refused; the refusal after
write_config (config.yaml overwritten); ``--resume auto`` starting fresh over damaged checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from conftest import tiny_overrides
from safetensors.torch import save_file

import train
from dit.checkpoint_whole import checkpoint_format, checkpoint_problem
from dit.config import load_config, to_dict
from dit.resume_checks import changed_keys, reads

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")


def _stage_checkpoint(step_dir: Path, pp_size: int, stages: int) -> Path:
    """A pipeline checkpoint as save_pipeline_checkpoint lays it out, with ``stages`` stage folders."""
    for p in range(stages):
        folder = step_dir / "stages" / f"stage_{p}"
        folder.mkdir(parents=True)
        save_file({f"blocks.{p}.w": torch.ones(2)}, str(folder / "model.safetensors"))
        save_file({f"blocks.{p}.w/exp_avg": torch.zeros(2)}, str(folder / "optim.safetensors"))
    torch.save({"step": 2, "lr_schedule": {}, "rng": {}}, step_dir / "trainer.pt")
    cfg = to_dict(load_config(TINY, ["parallel.mode=dynamic", f"parallel.pp_size={pp_size}"]))
    (step_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    return step_dir


def test_a_stage_checkpoint_is_whole_and_named_by_its_files(tmp_path):
    step_dir = _stage_checkpoint(tmp_path / "step_000002", pp_size=2, stages=2)
    assert checkpoint_problem(step_dir) is None  # no model/: the stage files hold the weights
    fmt = checkpoint_format(step_dir)
    assert (fmt.weights, fmt.lora, fmt.experts) == ("stages", False, False)
    assert "pipeline stage files" in str(fmt)
    (step_dir / "stages" / "stage_1" / "optim.safetensors").unlink()
    assert checkpoint_problem(step_dir) == "stages/stage_1/optim.safetensors is missing"


def test_a_stage_checkpoint_missing_a_whole_stage_is_not_whole(tmp_path):
    step_dir = _stage_checkpoint(tmp_path / "step_000002", pp_size=3, stages=2)
    assert checkpoint_problem(step_dir) == "stages/stage_2/model.safetensors is missing"


def test_a_truncated_stage_file_is_not_whole(tmp_path):
    step_dir = _stage_checkpoint(tmp_path / "step_000002", pp_size=2, stages=2)
    path = step_dir / "stages" / "stage_0" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-3])
    assert "stages/stage_0/model.safetensors is truncated" in checkpoint_problem(step_dir)


def test_formats_from_files(tmp_path):
    for name, files in {
        "dcp": ["sharded/.metadata", "model/diffusion_pytorch_model.safetensors"],
        "lora": ["model/pytorch_lora_weights.safetensors"],
        "experts": ["model/transformer/x.safetensors", "model/transformer_2/x.safetensors"],
    }.items():
        for f in files:
            (tmp_path / name / f).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name / f).write_bytes(b"")
    assert checkpoint_format(tmp_path / "dcp").weights == "dcp"
    assert checkpoint_format(tmp_path / "lora") == type(checkpoint_format(tmp_path))(
        "replicated", True, False
    )
    assert checkpoint_format(tmp_path / "experts").experts


def test_which_layout_reads_which_format():
    fmt = type(checkpoint_format(Path("/nonexistent")))
    one = load_config(TINY, [])
    fsdp = load_config(TINY, ["parallel.mode=dynamic", "parallel.fsdp=per_step"])
    replicated = load_config(TINY, ["parallel.mode=dynamic", "parallel.fsdp=none"])
    pp = load_config(TINY, ["parallel.mode=dynamic", "parallel.pp_size=2"])
    table = {
        "replicated": (True, True, True, True),
        "dcp": (False, True, False, False),
        "stages": (True, True, True, True),
    }
    for weights, want in table.items():
        got = tuple(reads(fmt(weights, False, False), cfg) for cfg in (one, fsdp, replicated, pp))
        assert got == want, weights
    # a stage reads a LoRA file or an expert pair from stage files only
    assert not reads(fmt("replicated", True, False), pp) and not reads(fmt("replicated", False, True), pp)
    assert reads(fmt("replicated", True, False), one) and reads(fmt("replicated", False, True), replicated)


def test_changed_keys_names_what_is_learned_and_lets_the_rest_change():
    saved = to_dict(load_config(TINY, []))
    now = to_dict(load_config(TINY, ["data.seed=3", "data.num_workers=2", "model.compile=true",
                                     "train.max_steps=9", "parallel.mode=dynamic",
                                     "model.overrides={num_layers: 2}"]))  # fmt: skip
    assert [k for k, _, _ in changed_keys(saved, now)] == ["data.seed", "model.overrides"]
    del saved["data"]["seed"]  # a config an older version wrote: a key it lacks is not compared
    assert [k for k, _, _ in changed_keys(saved, now)] == ["model.overrides"]


def _trained(tmp_path) -> tuple[list[str], Path]:
    over = tiny_overrides(tmp_path, **{"train.max_steps": 2, "train.checkpoint_every": 2})
    assert train.main(["--config", TINY, *over]) == 0
    return over, tmp_path / "run"


def test_resume_with_other_data_stops_in_one_line_and_keeps_the_run(tmp_path, capsys):
    over, run = _trained(tmp_path)
    files = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert train.main(["--config", TINY, *over, "data.seed=5", "train.max_steps=3", "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert "data.seed=5 (was 0)" in err and "step_000002" in err, err
    assert "--config" in err and "--allow-config-change" in err, err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == files  # config.yaml too
    # a key that does not change what is learned is free; the flag lets a learned one through
    assert train.main(["--config", TINY, *over, "data.num_workers=0", "train.max_steps=3", "--resume"]) == 0
    assert train.main(["--config", TINY, *over, "data.seed=5", "train.max_steps=4", "--resume",
                       "--allow-config-change"]) == 0  # fmt: skip
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 4 and 3 in steps


def test_resume_auto_never_starts_fresh_over_checkpoints_none_of_which_is_whole(tmp_path, capsys):
    over, run = _trained(tmp_path)
    (run / "checkpoints" / "step_000002" / "trainer.pt").write_bytes(b"cut")
    files = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert train.main(["--config", TINY, *over, "train.max_steps=3", "--resume", "auto"]) == 2
    err = capsys.readouterr().err
    assert "none is whole" in err, err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == files  # metrics kept


def test_resume_of_a_sharded_checkpoint_in_one_process_names_the_command(tmp_path):
    over, run = _trained(tmp_path)
    step_dir = run / "checkpoints" / "step_000002"
    (step_dir / "sharded").mkdir()
    (step_dir / "sharded" / ".metadata").write_bytes(b"")  # as DCP leaves it: the format is read from it
    cfg = load_config(TINY, over)
    with pytest.raises(ValueError, match="FSDP shards") as err:
        train.resolve_resume(cfg, "auto", overwrite=False)
    command = f"torchrun --nproc_per_node=N train.py --config {step_dir / 'config.yaml'} --resume {step_dir}"
    assert command in str(err.value)
