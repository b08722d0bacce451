"""A frozen base that lives in host memory: ``model.offload``, as musubi-tuner's ``--blocks_to_swap``.

``offload_blocks`` of the transformer blocks (the last ones) keep their frozen tensors (the LoRA
base weights, fp8 or not, norms, modulation tables) in pinned host memory. Each is copied to the
compute device just before its forward, and the next offloaded block is copied on a side stream
meanwhile; after the forward it is freed again. Under gradient checkpointing the backward recomputes
a block's forward, so the same hooks bring it back then, prefetching in reverse order, and free it
once the block before it is recomputed (its backward is done by then). At most two offloaded blocks,
the running one and the prefetched one, are on the device at any time.

Only the stream and its events are CUDA's (``_side_stream``, and the wait in ``_ensure``): which block
is copied in, prefetched or freed, and when, is decided the same way on every device, so the tests run
it on the CPU, where each copy is a real one of its own and done when it returns.

Trainable tensors (the adapters) stay where they are: their gradients and AdamW moments live on the
device, and they are a few percent of the base.

``blocks+activations`` also keeps each checkpointed block's input on the host (``checkpoint_on_host``):
with checkpointing those inputs are what remains of the activations, 2 d bytes a token a block
(13 GB for Wan-14B at 480p and 81 frames).

Why not diffusers' ``apply_group_offloading``: it brings a group in before its forward and drops it
after, but it has no backward prefetch; a backward through its hooks would find the weights gone or
bring them in one synchronous copy at a time. The hooks here are what training needs, and nothing else.

An offloaded tensor is swapped in place (``tensor.data = ...``), never replaced: autograd's saved
references and the optimizer see the same objects, and a tensor used while offloaded is empty and
fails loudly rather than computing with stale values.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

OFFLOAD_MODES = ("none", "blocks", "blocks+activations")


def check_offload(model_cfg) -> None:
    """ValueError naming the fix for a ``model.offload`` / ``model.offload_blocks`` that cannot apply."""
    mode, count = model_cfg.offload, model_cfg.offload_blocks
    if mode not in OFFLOAD_MODES:
        raise ValueError(f"model.offload={mode!r}; choose one of {', '.join(OFFLOAD_MODES)}")
    if count != "auto" and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
        raise ValueError(f"model.offload_blocks={count!r}; use a block count (0 or more) or auto")
    if mode != "none" and model_cfg.lora is None:
        raise ValueError(
            f"model.offload={mode} moves a frozen base to host memory; set model.lora (e.g. model.lora={{}}) "
            "or model.offload=none (full training updates every weight on the device)"
        )
    if mode != "none" and model_cfg.compile:
        raise ValueError(f"model.offload={mode} with model.compile: choose one (set model.compile=false)")


def frozen_tensors(block: nn.Module, trainable: bool = False) -> list[tuple[nn.Module, str]]:
    """(module, name) of every tensor of ``block`` that does not train: frozen parameters and buffers;
    with ``trainable`` the trainable parameters too (every tensor: dit/expert_offload.py)."""
    found = []
    for module in block.modules():
        for name, p in module._parameters.items():
            if p is not None and (trainable or not p.requires_grad):
                found.append((module, name))
        found += [(module, name) for name, b in module._buffers.items() if b is not None]
    return found


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of host tensor ``t`` on ``device``, of its own even on the CPU (as a GPU's would be),
    queued on the current stream without the host waiting (``t`` pinned, on CUDA)."""
    return t.to(device, non_blocking=True, copy=True)


class BlockOffloader:
    """Keeps the frozen tensors of ``blocks[len - count:]`` on the host; see the module docstring.

    Create it while the model is still on the CPU, then move the model to ``device``: the offloaded
    tensors are empty placeholders on ``device`` until a block runs.
    """

    def __init__(self, blocks: nn.ModuleList, device: torch.device | str, count: int, checkpointed):
        n = len(blocks)
        if not 0 <= count <= n:
            raise ValueError(f"model.offload_blocks={count}: the model has {n} blocks; use 0 to {n}")
        self.device = torch.device(device)
        self.checkpointed = checkpointed  # () -> bool: whether forwards with grad are recomputed
        self.swapped = set(range(n - count, n))
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._tensors = {i: frozen_tensors(blocks[i]) for i in self.swapped}
        pin = self.device.type == "cuda"
        self._host = {
            i: [getattr(m, name).detach().to("cpu").pin_memory() if pin else getattr(m, name).detach().clone()
                for m, name in ts]
            for i, ts in self._tensors.items()
        }  # fmt: skip
        self._resident: set[int] = set()
        self._events: dict[int, torch.cuda.Event] = {}
        self._graph_task = None
        self.peak_blocks = 0  # most offloaded blocks on the device at once, since the last reset
        for i in self.swapped:
            self._release(i)
        self._handles = []
        for i, block in enumerate(blocks):
            self._handles.append(block.register_forward_pre_hook(lambda _m, _a, i=i: self._before(i)))
            self._handles.append(block.register_forward_hook(lambda _m, _a, _o, i=i: self._after(i)))

    # ---------------------------------------------------------------- what is where
    def host_bytes(self) -> int:
        """Pinned host memory the offloaded blocks take."""
        return sum(t.nbytes for ts in self._host.values() for t in ts)

    def device_bytes(self) -> int:
        """Bytes of offloaded blocks' tensors on the device now, read from the tensors themselves."""
        return sum(getattr(m, name).nbytes for ts in self._tensors.values() for m, name in ts)

    # ---------------------------------------------------------------- moves
    @contextmanager
    def _side_stream(self, i: int):
        """The CUDA part of a prefetch: the enclosed copies run on the side stream, after the compute
        stream's work so far, and an event marks their end (``_ensure`` makes compute wait for it).
        Without a stream (the CPU) the copies are done when they return: nothing to wait for."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield
            self._events[i] = torch.cuda.Event()
            self._events[i].record(self.stream)

    def _onload(self, i: int) -> None:
        if i in self._resident:
            return
        with self._side_stream(i):
            copies = [_to_device(h, self.device) for h in self._host[i]]
        for (m, name), copy in zip(self._tensors[i], copies):
            getattr(m, name).data = copy
        self._resident.add(i)
        self.peak_blocks = max(self.peak_blocks, len(self._resident))

    def _ensure(self, i: int) -> None:
        self._onload(i)
        event = self._events.pop(i, None)
        if event is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(event)
            for m, name in self._tensors[i]:  # allocated on the side stream, freed after compute's use
                getattr(m, name).data.record_stream(compute)

    def _release(self, i: int) -> None:
        for m, name in self._tensors[i]:
            t = getattr(m, name)
            t.data = torch.empty(0, dtype=t.dtype, device=self.device)
        self._events.pop(i, None)
        self._resident.discard(i)

    def release_all(self) -> None:
        for i in list(self._resident):
            self._release(i)

    # ---------------------------------------------------------------- hooks
    def _before(self, i: int) -> None:
        in_backward = torch._C._current_graph_task_id() != -1  # a checkpoint's recompute
        if in_backward:
            task = torch._C._current_graph_task_id()
            if task != self._graph_task:  # free whatever is left once this backward ends
                self._graph_task = task
                torch.autograd.Variable._execution_engine.queue_callback(self.release_all)
            for j in [j for j in self._resident if j > i]:  # blocks after i: their backward is done
                self._release(j)
        if i in self.swapped:
            self._ensure(i)
        ahead = i - 1 if in_backward else i + 1
        if ahead in self.swapped:
            self._onload(ahead)

    def _after(self, i: int) -> None:
        if i not in self.swapped or torch._C._current_graph_task_id() != -1:
            return  # a recompute's tensors serve the backward that follows: freed after it
        if not torch.is_grad_enabled() or self.checkpointed():
            self._release(i)
        # else: autograd saved this block's weights for a backward that is not recomputed; they stay

    def remove(self) -> None:
        """Bring every block back to the device for good and drop the hooks."""
        for h in self._handles:
            h.remove()
        for i in self.swapped:
            self._onload(i)
            self._ensure(i)
        self.swapped = set()


def _block_on_device(block: nn.Module, device: torch.device, x_host: torch.Tensor, *rest):
    return block(_to_device(x_host, device), *rest)


def checkpoint_on_host(block: nn.Module, x: torch.Tensor, *rest):
    """Gradient checkpointing of one block whose saved input, (n, D), waits in host memory.

    The copy to the host (pinned off the CPU) is differentiable (its gradient comes back to ``x``'s
    device), and the recompute copies the input in again before running the block. On the CPU the
    host copy is a copy all the same: the backward never reads ``x``'s memory."""
    pinned = x.device.type != "cpu"
    x_host = torch.empty(x.shape, dtype=x.dtype, pin_memory=pinned).copy_(x, non_blocking=True)
    return checkpoint(_block_on_device, block, x.device, x_host, *rest, use_reentrant=False)


def models_of(model: nn.Module) -> list[nn.Module]:
    """The VideoDiTs of ``model``: itself, or A14B's two experts."""
    return [model.high, model.low] if hasattr(model, "high") else [model]


def offload_model(model: nn.Module, model_cfg, device: torch.device, count: int) -> list[BlockOffloader]:
    """Install ``model.offload`` on a model still on the CPU -> one offloader per VideoDiT (none: [])."""
    if model_cfg.offload == "none":
        return []
    offloaders = []
    for dit in models_of(model):
        offloaders.append(
            BlockOffloader(dit.blocks, device, count, lambda dit=dit: dit.gradient_checkpointing)
        )
        if model_cfg.offload == "blocks+activations":
            dit.checkpoint_fn = checkpoint_on_host
    return offloaders
