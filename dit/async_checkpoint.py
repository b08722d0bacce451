"""Checkpoints written in the background (``train.async_checkpoint``), for replicated weights.

At the save, training only reads the RNG states and takes references to the live tensors. A thread
then *stages* them (copies weights, EMA and optimizer state into CPU buffers kept from the previous
save) and serializes the copy through the same ``save_checkpoint`` as a synchronous save
(``step_X.tmp``, then rename). Those tensors change only in the optimizer step, so the copy runs
while the next step's forward and backward do, and training waits for it (``wait_staged``) only if
it is not done by that step's optimizer update. A crash during the background write leaves the
previous checkpoint whole and a ``.tmp`` folder that resume skips.

One save is in flight at a time: the next save, and the end of the run, wait for it. A failed
background save (a full disk, say) is raised at the next step by ``check``, not lost in the thread.
The staged copy costs host memory: the bytes of everything the checkpoint holds (``nbytes``).
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from data.cli import RunStopped
from dit.checkpoint import export_pretrained, nbytes, rng_state, save_checkpoint


def stage(obj, buffers: dict | None = None, path: str = ""):
    """A CPU copy of ``obj`` (a tensor, or dicts and lists of them and plain values) that later
    training steps cannot change. ``buffers`` ({path: tensor}) keeps the copies' memory from one save
    to the next: copying into pages already mapped is several times faster than into fresh ones."""
    if isinstance(obj, torch.Tensor):
        held = buffers.get(path) if buffers is not None else None
        if held is None or held.shape != obj.shape or held.dtype != obj.dtype:
            held = torch.empty(obj.shape, dtype=obj.dtype, device="cpu")
            if buffers is not None:
                buffers[path] = held
        return held.copy_(obj.detach())
    if isinstance(obj, dict):
        return {k: stage(v, buffers, f"{path}/{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(stage(v, buffers, f"{path}/{i}") for i, v in enumerate(obj))
    return obj


class StagedModel:
    """What ``save_checkpoint`` calls ``save_pretrained`` on: a staged state dict of a VideoDiT."""

    def __init__(self, config, state: dict[str, torch.Tensor]):
        self.config, self.state = config, state

    def save_pretrained(self, directory: Path) -> None:
        export_pretrained(self.config, self.state, directory)


class BackgroundCheckpointer:
    def __init__(self):
        self._thread: threading.Thread | None = None
        self._staged = threading.Event()
        self._error: BaseException | None = None
        self._step = 0
        self.staged_bytes = 0  # host memory the staged checkpoint holds
        self._buffers: dict[str, torch.Tensor] = {}  # the staging copies, reused by the next save

    def save(
        self,
        root: Path,
        step: int,
        model,
        ema_model,
        trainer_state: dict,
        config: dict,
        keep: int,
        extra_files: dict[str, str] | None = None,
    ) -> None:
        """Take references to what the checkpoint holds, and this step's RNG states; a thread copies
        and writes them. Waits for the previous save first."""
        self.wait()
        live = {"model": model.state_dict(), "trainer": trainer_state}
        if ema_model is not None:
            live["ema"] = ema_model.state_dict()
        configs = (model.config, ema_model.config if ema_model is not None else None)
        self._step = step
        self._staged.clear()
        self._thread = threading.Thread(
            target=self._stage_and_write,
            args=(root, step, live, configs, rng_state(), config, keep, extra_files),
            name="checkpoint-writer",
            daemon=True,
        )
        self._thread.start()

    def _stage_and_write(self, root, step, live, configs, rng, config, keep, extra_files) -> None:
        try:
            try:
                staged = stage(live, self._buffers)  # the buffers are free: the previous write is done
                self.staged_bytes = nbytes(staged)
            finally:
                self._staged.set()  # a failed copy must not leave training waiting
            model = StagedModel(configs[0], staged["model"])
            ema = StagedModel(configs[1], staged["ema"]) if "ema" in staged else None
            state = {**staged["trainer"], "rng": rng}  # the RNG of the saved step, not of the writer's moment
            save_checkpoint(root, step, model, ema, state, config, keep, extra_files)
        except BaseException as err:  # raised in the training thread by check()
            self._error = err

    def wait_staged(self) -> None:
        """Block until the save in flight has copied what it saves: before anything changes it (the
        optimizer step, the EMA update)."""
        if self._thread is not None:
            self._staged.wait()

    def check(self) -> None:
        """Raise the failure of the last background save, if it failed (called at every step)."""
        if self._error is not None:
            err, self._error = self._error, None
            if isinstance(err, RunStopped):
                raise err
            raise RunStopped(f"the background save of checkpoint step {self._step} failed: {err}") from err

    def wait(self) -> None:
        """Block until the save in flight is on disk; raise its failure."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.check()
