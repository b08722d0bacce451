"""Run a function on a few CPU processes joined by gloo: for tests and benchmarks of CP code.

    results = run_gloo(worker, 4, case_list)   # worker(rank, world_size, case_list) -> picklable

The rendezvous is a FileStore in a fresh temporary directory, so concurrent runs never fight over a
port. Processes are forked where the platform allows: they inherit the imported modules (torch,
diffusers), which otherwise take most of a short test's time to import again in every process. Each process uses one intra-op thread: several processes share few cores, and oversubscribed
threads make gloo timeouts likely rather than anything faster.

Every process a run starts ends with it, whatever happens to its peers or to the caller: each rank
leads its own process group (with whatever it starts: DataLoader workers, subprocesses), the first
rank to fail takes the others down at once, and on the way out, by a return, an exception or an
interruption of the caller (pytest-timeout, Ctrl-C), every group is SIGKILLed and every rank
reaped. A rank also dies with the caller's process (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import gc
import importlib
import os
import pickle
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _die_with_parent() -> None:
    """SIGKILL this process when its parent ends: torch's own SIGINT does not stop a rank blocked in C."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _entry(rank: int, world_size: int, store_dir: str, fn: Callable, args: tuple, timeout_s: float) -> None:
    os.setpgid(0, 0)  # its own group: ending the group ends what this rank started too
    _die_with_parent()
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_dir}/store",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        result = fn(rank, world_size, *args)
        with open(os.path.join(store_dir, f"result{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_gloo(fn: Callable, world_size: int, *args, timeout_s: float = 120.0) -> list:
    """Start ``world_size`` gloo processes running ``fn(rank, world_size, *args)``; return their results.

    ``fn`` should be importable (module level) so that it also works where processes are spawned.
    An exception in any process is raised here.
    """
    if "diffusers" in sys.modules:
        # diffusers imports its hooks (and through them peft and transformers) on a model's first
        # .to(): tens of seconds per process on a loaded machine, paid once here for all children.
        importlib.import_module("diffusers.hooks")
    # A forked child would inherit a process group or a CUDA context of this process: spawn then.
    can_fork = "fork" in mp.get_all_start_methods() and not dist.is_initialized()
    start_method = "fork" if can_fork and not torch.cuda.is_initialized() else "spawn"
    # A process group an earlier test left as garbage here would be collected in a forked child,
    # where its destructor joins gloo threads that fork did not copy: the child hangs (seen in the full
    # suite: ~ProcessGroupGloo under gc in every rank). So collect it here, and freeze what is left:
    # the children's collector never visits the objects they inherit.
    gc.collect()
    gc.freeze()
    with tempfile.TemporaryDirectory() as store_dir:
        try:
            ranks = mp.start_processes(
                _entry,
                args=(world_size, store_dir, fn, args, timeout_s),
                nprocs=world_size,
                join=False,
                start_method=start_method,
            )
        finally:
            gc.unfreeze()
        try:
            for p in ranks.processes:
                _own_group(p.pid)
            # grace_period=0: the first rank to fail takes the others down now, not after 30 s
            while not ranks.join(grace_period=0):
                pass
        finally:
            _end(ranks.processes)
        results = []
        for rank in range(world_size):
            with open(os.path.join(store_dir, f"result{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


def _own_group(pid: int) -> None:
    """Make rank ``pid`` lead its process group from here on (it does so itself too, first thing, but
    it may not have run yet)."""
    try:
        os.setpgid(pid, pid)
    except OSError:  # it did already (EACCES after a spawn's exec) or has ended
        pass


def _running_members(groups: set[int]) -> list[int]:
    """Pids of the processes of ``groups`` that have not ended (zombies have), read from /proc (Linux;
    elsewhere none are known)."""
    found = []
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else ():
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                state, _, group = f.read().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):  # not a process, or ended meanwhile
            continue
        if state != "Z" and int(group) in groups:
            found.append(int(entry.name))
    return found


def _end(processes) -> None:
    """SIGKILL every rank's process group (its DataLoader workers, subprocesses), reap the ranks, and
    return once no member of a group runs: SIGKILL is delivered after kill() returns, and the orphans
    are not ours to wait for.

    A group outlives its leader while any member lives, so a dead rank's orphans are still reached. A
    group id is a rank's pid, which the kernel gives out again only after it has cycled through all
    (pid_max): no other process's group is hit within one run."""
    groups = {p.pid for p in processes}
    while True:
        for pid in groups:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # no member left
                pass
        for p in processes:
            if p.exitcode is None:  # not in its own group yet
                p.kill()
            p.join()
        if not _running_members(groups):
            return
        time.sleep(0.01)


def run_gloo_cases(fn: Callable, world_size: int, *args, timeout_s: float = 120) -> dict[str, list]:
    """Run ``fn`` (returning {case: result}) on every rank; -> {case: [result of rank 0, 1, ...]}."""
    merged: dict[str, list] = {}
    for per_rank in run_gloo(fn, world_size, *args, timeout_s=timeout_s):
        for key, value in per_rank.items():
            merged.setdefault(key, []).append(value)
    return merged


# ----------------------------------------------------------------------------- gradient-level parity
# Weights after one AdamW step hide the scale of the gradient (the update is about lr * sign(g)), so a
# gradient off by a factor of the world size moves them by ~1e-5. Parity tests of a parallel path
# compare the gradients the optimizer is handed instead, and the logged grad_norm and loss.


def _full(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor: DTensors (FSDP2 shards) are gathered, a collective every rank must join."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def record_step_grads(trainer) -> list[dict]:
    """Record, at every ``trainer.finish_step`` call, the gradients it is handed (after the step's
    all-reduce, before clipping) as {parameter name: tensor}, plus the loss under ``"__loss__"``.

    Returns the list the records are appended to. Works for ``Trainer`` and its distributed
    subclasses (ZeRO-1, FSDP shards via ``full_tensor``, LoRA: only parameters with a gradient slot).
    """
    records: list[dict] = []
    finish = trainer.finish_step

    def recording(loss):
        grads = {"__loss__": torch.tensor(float(loss), dtype=torch.float64)}
        for name, p in trainer.model.named_parameters():
            if p.requires_grad:
                g = _full(p.grad) if p.grad is not None else torch.zeros_like(_full(p.detach()))
                grads[name] = g.detach().cpu().clone()
        records.append(grads)
        return finish(loss)

    trainer.finish_step = recording
    return records


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """|got - ref| / |ref| in the Frobenius norm (0 for two empty or two zero tensors)."""
    got, ref = got.double(), ref.double()
    denom = ref.norm()
    if denom == 0:
        return float(got.norm())
    return float((got - ref).norm() / denom)


def assert_grads_match(got: dict, ref: dict, rel_tol: float, label: str = "") -> None:
    """Assert that every gradient in ``got`` equals ``ref``'s within ``rel_tol`` (relative, per tensor).

    ``got`` and ``ref`` map parameter names to gradients (``record_step_grads`` records). The same
    names must be present in both, and the reference must not be all zeros (a vacuous comparison).
    The failure message gives the worst tensor, its error and the ratio |got| / |ref| of the whole
    gradient, so a wrong scale (1/W, W) reads as such.
    """
    prefix = f"{label}: " if label else ""
    if set(got) != set(ref):
        raise AssertionError(
            f"{prefix}gradients of different parameters: only in the run {sorted(set(got) - set(ref))}, "
            f"only in the reference {sorted(set(ref) - set(got))}"
        )
    names = [n for n in ref if not n.startswith("__")]
    ref_norm = sum(float(ref[n].double().norm() ** 2) for n in names) ** 0.5
    if ref_norm == 0:
        raise AssertionError(f"{prefix}the reference gradients are all zero: the comparison is vacuous")
    got_norm = sum(float(got[n].double().norm() ** 2) for n in names) ** 0.5
    errors = {n: relative_error(got[n], ref[n]) for n in ref}
    worst = max(errors, key=errors.get)
    if errors[worst] > rel_tol:
        bad = sum(e > rel_tol for e in errors.values())
        raise AssertionError(
            f"{prefix}gradient of {worst} differs from the single-process reference by {errors[worst]:.2e} "
            f"(relative, tolerance {rel_tol:.0e}); {bad} of {len(errors)} tensors off; "
            f"|grad| / |reference grad| = {got_norm / ref_norm:.6g} over all parameters"
        )


# ----------------------------------------------------------------------------- torchrun's workers


def torchrun_workers(agent_pid: int) -> dict[int, int]:
    """{RANK: pid} of the worker processes a torchrun agent (``agent_pid``) runs now, read from
    /proc (Linux): the fault tests and bench/chaos.py kill or stop one of them."""
    from pathlib import Path

    found = {}
    for task in Path(f"/proc/{agent_pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:  # ended meanwhile
                continue
            ranks = [e.split(b"=", 1)[1] for e in env if e.startswith(b"RANK=")]
            if ranks:
                found[int(ranks[0])] = int(pid)
    return found
