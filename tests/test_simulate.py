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
from dynamic_cp.planning.simulator import (
    Schedule,
    best_single_time,
    gantt,
    lower_bound,
    simulate,
    spans_nodes,
)
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


def test_busy_fraction_is_busy_rank_seconds_over_step_times_ranks():
    # rank 0 busy 0-1 and 2-4 s, rank 1 busy 1-2 s, over a 4 s step on 2 ranks: 4 of 8 rank-seconds
    s = Schedule(4.0, [[(0.0, 1.0, 0), (2.0, 4.0, 1)], [(1.0, 2.0, 2)]], [1.0, 2.0, 1.0])
    assert s.busy_fraction() == pytest.approx(0.5)
    assert Schedule(0.5, [[(0.25, 0.5, 0)], []], [0.25]).busy_fraction() == pytest.approx(0.25)
    assert Schedule(0.0, [[], []], []).busy_fraction() == 1.0  # an empty step wastes nothing


@pytest.mark.parametrize(
    "ranks, gpus_per_node, spans",
    [
        ((0,), 8, False),
        (tuple(range(8)), 8, False),
        (tuple(range(8, 16)), 8, False),
        (tuple(range(4, 12)), 8, True),
        ((3, 4, 5), 4, True),  # only the first rank is on node 0
        ((2, 3, 4), 4, True),  # only the last rank is on node 1
        ((0, 2), 8, False),
        ((1, 7), 8, False),
        ((0, 9), 8, True),
        ((7, 0), 8, False),
        ((9, 1), 8, True),
        ((0, 8, 2), 8, True),  # rank 8 is on node 1 whatever the order (was False: first/last only)
        ((0, 2, 8), 8, True),
    ],
)
def test_spans_nodes(ranks, gpus_per_node, spans):
    assert spans_nodes(ranks, gpus_per_node) is spans


def test_barrier_costs_one_collective_latency_inside_or_across_nodes():
    """Default barrier cost: one intra-node latency while the world fits in a node, inter-node beyond."""
    lengths = [30_000, 1_000, 1_000]
    t0, t1, t2 = (CM.micro_batch_time([n], 1) for n in lengths)
    hw = CM.hw
    assert hw.gpus_per_node == 8
    for world, barrier in ((8, hw.intra_node_latency_s), (9, hw.inter_node_latency_s), (8, None)):
        p = Plan([((0,), [0]), ((1,), [1]), ((1,), [2])], world, 40_000, barriers_after=(1,))
        s = simulate(p, lengths, CM) if barrier is not None else simulate(p, lengths, CM, barrier_s=0.5)
        wait = barrier if barrier is not None else 0.5
        # clip 2 on rank 1 starts once rank 0 finished clip 0 and the barrier passed
        assert s.rank_segments[1][1] == pytest.approx((t0 + wait, t0 + wait + t2, 2))
        assert s.step_s == pytest.approx(t0 + wait + t2) and s.mb_times == pytest.approx([t0, t1, t2])


def test_empty_plans_take_no_time():
    s = simulate(Plan([], 4, 1_000), [], CM)
    assert s.step_s == 0.0 and s.rank_segments == [[], [], [], []] and s.busy_fraction() == 1.0
    assert simulate(Plan([], 0, 1_000), [], CM).step_s == 0.0
    assert lower_bound([], CM, 8, 1_000) == 0.0


def test_lower_bound_of_a_clip_that_exactly_fills_its_ranks():
    """60_000 tokens under a 30_000 cap: CP 1 cannot hold it, CP 2 exactly can (cap * c is inclusive)."""
    alone = CM.micro_batch_time([60_000], 2)
    assert best_single_time(60_000, CM, 2, 30_000) == pytest.approx(alone)
    assert best_single_time(60_001, CM, 2, 30_000) == np.inf
    assert lower_bound([60_000], CM, 2, 30_000) == pytest.approx(max(alone, CM.ideal_time([60_000])[0] / 2))
    # with 4 ranks CP 4 is feasible too, and faster
    assert best_single_time(60_000, CM, 4, 30_000) == pytest.approx(CM.micro_batch_time([60_000], 4))


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


def _drawn(monkeypatch, tmp_path, plan, lengths, title=""):
    """Run ``gantt`` and keep its figure open for inspection: -> (schedule, figure, png bytes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kept = []
    monkeypatch.setattr(plt, "close", kept.append)
    s = simulate(plan, lengths, CM)
    path = tmp_path / "g.png"
    gantt(s, plan, lengths, str(path), title)
    monkeypatch.undo()
    (fig,) = kept
    return s, fig, path.read_bytes()


def _bar_boxes(collection):
    """(x0, x1, y0, y1) of each bar of a broken_barh collection."""
    boxes = []
    for path in collection.get_paths():
        v = path.vertices
        boxes.append((v[:, 0].min(), v[:, 0].max(), v[:, 1].min(), v[:, 1].max()))
    return boxes


def test_gantt_draws_each_ranks_micro_batches_barriers_and_legend(monkeypatch, tmp_path):
    import matplotlib.pyplot as plt

    lengths = [1_000, 3_000, 2_000, 500]
    p = Plan([((0, 1), [0]), ((2,), [1]), ((0,), [2]), ((1, 2), [3])], 3, 40_000, barriers_after=(1,))
    s, fig, _ = _drawn(monkeypatch, tmp_path, p, lengths, title="my run")
    ax = fig.axes[0]
    assert len(ax.collections) == 3  # one row of bars per rank
    colour = {}
    top, bottom = np.inf, -np.inf
    for r, coll in enumerate(ax.collections):
        boxes = _bar_boxes(coll)
        # arrays: pytest >= 9.2 refuses nested lists in approx
        assert np.array([b[:2] for b in boxes]) == pytest.approx(
            np.array([seg[:2] for seg in s.rank_segments[r]])
        )
        for (_, _, y0, y1), face, (_, _, i) in zip(boxes, coll.get_facecolor(), s.rank_segments[r]):
            assert (y0 + y1) / 2 == pytest.approx(r) and 0.5 < y1 - y0 < 1  # centred, rows don't touch
            colour.setdefault(len(p.micro_batches[i][0]), set()).add(tuple(face))
            top, bottom = min(top, y0), max(bottom, y1)
    assert all(len(c) == 1 for c in colour.values()) and colour[1] != colour[2]  # one colour per CP size
    legend = ax.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["CP 1", "CP 2"]
    for handle, cp in zip(legend.legend_handles, (1, 2)):
        assert {tuple(handle.get_facecolor())} == colour[cp]
    # the barrier after micro-batch 1 is marked where it happens: when micro-batches 0 and 1 are done
    (line,) = ax.lines
    when = s.mb_times[1]  # micro-batch 1 (3000 tokens on rank 2) ends after micro-batch 0
    assert when > s.mb_times[0]
    assert s.rank_segments[0][1][0] == pytest.approx(when + CM.hw.intra_node_latency_s)  # rank 0 waits
    assert list(line.get_xdata()) == pytest.approx([when, when]) and line.get_color() == "red"
    # the view holds the whole step and every row, rank 0 on top, without much empty space
    x0, x1 = ax.get_xlim()
    assert x0 == 0 and s.step_s < x1 <= 1.05 * s.step_s
    y_bottom, y_top = ax.get_ylim()
    assert y_top < y_bottom  # inverted: rank 0 is the top row
    assert 0 <= top - y_top < 0.5 and 0 <= y_bottom - bottom < 0.5
    assert list(ax.get_yticks()) == [0, 1, 2]
    assert ax.get_title() == "my run"
    # the legend is centred under the axes and inside the image
    renderer = fig.canvas.get_renderer()
    box, axes_box = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
    assert abs((box.x0 + box.x1) / 2 - (axes_box.x0 + axes_box.x1) / 2) < 1 and box.y1 < axes_box.y0
    assert box.x0 >= 0 and box.y0 >= 0 and box.x1 <= fig.bbox.width
    plt.close(fig)


# height: int(110 dpi x clamp(0.22 in per rank + 1.5 in, 3 in, 13.5 in))
@pytest.mark.parametrize("world, height_px", [(2, 330), (16, 552), (32, 939), (33, 963), (64, 1485)])
def test_gantt_image_size_and_rank_labels(monkeypatch, tmp_path, world, height_px):
    import struct

    import matplotlib.pyplot as plt

    p = Plan([((r,), [r]) for r in range(world)], world, 40_000)
    s, fig, png = _drawn(monkeypatch, tmp_path, p, [1_000 + 100 * r for r in range(world)])
    assert png[:4] == b"\x89PNG" and struct.unpack(">II", png[16:24]) == (1320, height_px)
    ticks = list(fig.axes[0].get_yticks())
    assert (ticks == list(range(world))) is (world <= 32)  # every rank labelled up to 32 ranks
    assert fig.axes[0].get_title() == f"step {s.step_s:.3f} s on {world} ranks"
    plt.close(fig)
