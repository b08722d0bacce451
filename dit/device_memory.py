"""Peak memory of the training process, for metrics.jsonl and the progress bar.

CUDA: the caching allocator's peak allocated and reserved bytes since the last ``reset_peak``
(one step). CPU: the process's peak resident set size (``getrusage``), which the OS cannot reset,
so it is the peak since start-up.
"""

from __future__ import annotations

import resource
import sys

import torch

GIB = 2**30


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict[str, float]:
    """{'mem_alloc_gb', 'mem_reserved_gb'} on CUDA, {'peak_rss_gb'} elsewhere; GiB, 3 decimals."""
    if device.type == "cuda":
        return {
            "mem_alloc_gb": round(torch.cuda.max_memory_allocated(device) / GIB, 3),
            "mem_reserved_gb": round(torch.cuda.max_memory_reserved(device) / GIB, 3),
        }
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_bytes = rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB, macOS bytes
    return {"peak_rss_gb": round(rss_bytes / GIB, 3)}


def bar_text(memory: dict[str, float]) -> str:
    """Short progress-bar form: the peak allocated on CUDA, the peak RSS elsewhere."""
    return f"{memory.get('mem_alloc_gb', memory.get('peak_rss_gb', 0.0)):.2f}G"
