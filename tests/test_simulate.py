"""Simulator semantics, baselines (static, Megatron as shipped), workloads and the CLI."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dynamic_cp import simulate as cli
from dynamic_cp.planning.baselines import static_plan
from dynamic_cp.planning.cost_model import CostModel
from dynamic_cp.planning.megatron_baseline import megatron_plan
from dynamic_cp.planning.plan_types import Plan, plan_violations
from dynamic_cp.planning.simulator import gantt, lower_bound, simulate
from dynamic_cp.planning.workloads import WORKLOADS, read_lengths, read_manifest, sample_batch, workload

CM = CostModel.from_name("wan-1.3b", "h100")
TRACE = Path(__file__).resolve().parents[2] / "shared" / "workloads" / "wikipedia_lengths.txt"


def test_micro_batch_waits_for_all_its_ranks():
    lengths = [30_000, 1_000, 20_000]
    p = Plan([((0,), [0]), ((1,), [1]), ((0, 1), [2])], 2, 40_000)
    s = simulate(p, lengths, CM)
    t0, t1, t2 = (CM.micro_batch_time([n], c) for n, c in ((30_000, 1), (1_000, 1), (20_000, 2)))
    assert s.step_s == pytest.approx(max(t0, t1) + t2)
    assert s.rank_segments[1][1][0] == pytest.approx(t0)  # rank 1 idles until rank 0 is free
    assert 0 < s.busy_fraction() < 1


def test_barrier_syncs_everyone():
    lengths = [30_000, 1_000, 1_000]
    free = Plan([((0,), [0]), ((1,), [1]), ((1,), [2])], 2, 40_000)
    barred = Plan(free.micro_batches, 2, 40_000, barriers_after=(1,))
    assert simulate(barred, lengths, CM).step_s > simulate(free, lengths, CM).step_s


def test_lower_bound_terms():
    lengths = [200_000, 256, 256]
    lb = lower_bound(lengths, CM, 16, 30_000)
    single = min(CM.micro_batch_time([200_000], c) for c in (8, 16))
    assert lb == pytest.approx(max(single, CM.ideal_time(lengths).sum() / 16))


@pytest.mark.parametrize("balanced", [False, True])
def test_static_baseline(balanced):
    lengths = workload("opensora", 64, seed=0)
    p = static_plan(lengths, 16, 27_000, CM, balanced=balanced)
    assert plan_violations(p, lengths, 27_000) == []
    assert len({len(r) for r, _ in p.micro_batches}) == 1  # one CP size for the whole step
    assert p.info["cp"] * 27_000 >= max(lengths)


def test_megatron_as_shipped_converts_to_a_valid_plan():
    lengths = workload("longtail", 64, seed=2)
    p = megatron_plan(lengths, 16, 27_000, CM)
    # one micro-batch per sub-sample, each sample exactly once, within memory
    assert len(p.micro_batches) == len(lengths)
    assert plan_violations(p, lengths, 27_000, check_groups=False) == []
    assert all(b < len(p.micro_batches) - 1 for b in p.barriers_after)
    assert p.predicted_step_s == pytest.approx(simulate(p, lengths, CM).step_s)


def test_workloads_reproducible_and_distinct():
    for name in WORKLOADS:
        a = workload(name, 200, seed=5)
        assert a == workload(name, 200, seed=5) and min(a) >= 256
    assert np.mean(workload("opensora", 2000)) < np.mean(workload("panda70m", 2000))
    assert max(workload("longtail", 2000)) == 234_000  # 16 s of 720p at 16 fps
    with pytest.raises(ValueError, match="unknown workload"):
        workload("kinetics", 10)


def test_manifest_and_lengths_readers(tmp_path):
    csv = tmp_path / "data.csv"
    csv.write_text(
        "path,text,num_frames,height,width,fps\na.mp4,a cat,81,480,832,16\nb.jpg,a dog,1,256,256,1\n"
    )
    assert read_manifest(str(csv)) == [32_760, 256]
    # the training clip policy applies: 16 fps of a 16 fps source, at most 33 frames, 256 px area
    assert read_manifest(str(csv), {"fps": 16, "max_frames": 33, "resolution": 256}) == [9 * 12 * 21, 256]
    bad = tmp_path / "bad.csv"
    bad.write_text("path,text,frames\na.mp4,x,3\n")
    with pytest.raises(ValueError, match="needs columns"):
        read_manifest(str(bad))
    txt = tmp_path / "l.txt"
    txt.write_text("5\n10\n\n300\n")
    assert read_lengths(str(txt)).tolist() == [5, 10, 300]
    assert sorted(sample_batch([5, 10, 300], 3, seed=0)) == [5, 10, 300]


def test_cli_prints_all_methods_and_writes_gantt(tmp_path, capsys):
    rc = cli.main(
        [
            "--workload",
            "opensora",
            "--gpus",
            "8",
            "--gantt",
            str(tmp_path / "g"),
            "--methods",
            "static",
            "static-balanced",
            "dynamic-cp",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    for word in ("lower bound", "static", "static-balanced", "dynamic-cp", "efficiency", "solver ms"):
        assert word in out
    png = tmp_path / "g_dynamic-cp_8.png"
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"


def test_cli_manifest_and_errors(tmp_path, capsys):
    csv = tmp_path / "data.csv"
    csv.write_text(
        "path,text,num_frames,height,width,fps\n" + "a.mp4,x,129,720,1280,24\n" * 3 + "b.jpg,y,1,256,256,1\n"
    )
    assert cli.main(["--manifest", str(csv), "--gpus", "8", "--methods", "static", "dynamic-cp"]) == 0
    assert "4 clips" in capsys.readouterr().out
    assert cli.main(["--manifest", str(csv), "--gpus", "2", "--cap", "20000", "--methods", "dynamic-cp"]) == 2
    assert "sample 0 has 118800 tokens" in capsys.readouterr().err


@pytest.mark.skipif(not TRACE.exists(), reason="shared wikipedia trace not present")
def test_wikipedia_trace(capsys):
    assert (
        cli.main(["--lengths", str(TRACE), "--gpus", "16", "--batch", "256", "--methods", "dynamic-cp"]) == 0
    )
    assert "dynamic-cp" in capsys.readouterr().out


def test_gantt_png(tmp_path):
    lengths = workload("openvid", 32, seed=1)
    from dynamic_cp.planning.planner import plan

    p = plan(lengths, 8, 27_000, CM)
    path = tmp_path / "g.png"
    gantt(simulate(p, lengths, CM), p, lengths, str(path), "test")
    assert path.stat().st_size > 5_000
