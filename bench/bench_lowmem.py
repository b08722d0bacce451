"""fp8 base + block offload against a plain base, on one LoRA model (CPU, one run).

    PYTHONPATH=$PWD python bench/bench_lowmem.py [--steps 8] [--layers 8] [--dim 256]

Builds one VideoDiT with LoRA adapters and three copies of it: the base as is (fp32: CPU's compute
dtype, the baseline), the base in fp8_scaled, and fp8_scaled with every block offloaded
(``BlockOffloader``, gradient checkpointing on in all three). Runs a forward and backward of the
same packed clips on each, alternating the variants step by step so machine load hits all alike,
and prints the median step time as a ratio to the baseline and the bytes of base weights on the
compute device: all of the base for the first two, and the most the offloader held at once for the
third, read from the tensors themselves.

On CPU the host and the device are one memory, so the offload's copies are synchronous memcpys and
its cost here is the copy time, not a PCIe transfer hidden behind compute; the GPU's figure comes
from ``bench/gpu_check.py`` when a GPU is lent.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

# isort: off
from dit.attention import PackedAttention  # first: importing dit hides bitsandbytes' stderr line
from dit.block_offload import BlockOffloader, frozen_tensors
from dit.fp8_base import store_base_in_fp8
from dit.model import VideoDiT
from dit.packing import pack
from peft import LoraConfig, inject_adapter_in_model  # after dit, see above

# isort: on


def build(layers: int, dim: int) -> VideoDiT:
    torch.manual_seed(0)
    heads = dim // 64
    model = VideoDiT(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=64, in_channels=16,
                     out_channels=16, text_dim=64, freq_dim=64, ffn_dim=4 * dim, num_layers=layers)  # fmt: skip
    model.requires_grad_(False)
    targets = ["to_q", "to_k", "to_v", "to_out.0"]
    inject_adapter_in_model(LoraConfig(r=16, target_modules=targets, init_lora_weights=False), model)
    for n, p in model.named_parameters():
        p.requires_grad_(".lora_" in n)
    model.gradient_checkpointing = True
    return model


def inputs(model: VideoDiT):
    g = torch.Generator().manual_seed(1)
    clips = [torch.randn(16, f, 16, 24, generator=g) for f in (5, 3, 9)]
    texts = [torch.randn(n, 64, generator=g) for n in (12, 7, 20)]
    packed = pack(clips, model.patch_size)
    text, lens = torch.cat(texts), torch.tensor([t.shape[0] for t in texts])
    return packed, text, lens, torch.tensor([900.0, 400.0, 20.0])


def step(model: VideoDiT, batch) -> float:
    packed, text, lens, t = batch
    start = time.perf_counter()
    out = model(
        packed.tokens, packed.positions, packed.seq_lens, t, text, lens, PackedAttention(packed.seq_lens)
    )
    out.square().mean().backward()
    return time.perf_counter() - start


def base_bytes(model: VideoDiT) -> int:
    return sum(getattr(m, n).nbytes for b in model.blocks for m, n in frozen_tensors(b))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=256)
    args = ap.parse_args(argv)
    plain = build(args.layers, args.dim)
    fp8 = copy.deepcopy(plain)
    store_base_in_fp8(fp8, per_row=True, compute_dtype=torch.float32)
    offloaded = copy.deepcopy(fp8)
    offloader = BlockOffloader(offloaded.blocks, "cpu", args.layers, lambda: True)
    variants = {"fp32 base (baseline)": plain, "fp8_scaled": fp8, "fp8_scaled + offload all": offloaded}
    batch = inputs(plain)
    bytes_on_device = {name: base_bytes(m) for name, m in variants.items()}
    times = {name: [] for name in variants}
    for m in variants.values():
        step(m, batch)  # warm-up
    offloader.peak_blocks = 0
    peak = 0
    for _ in range(args.steps):
        for name, m in variants.items():
            times[name].append(step(m, batch))
            if m is offloaded:
                peak = max(peak, offloader.peak_blocks)
    per_block = offloader.host_bytes() / args.layers
    bytes_on_device["fp8_scaled + offload all"] = int(peak * per_block)
    base = statistics.median(times["fp32 base (baseline)"])
    print(f"VideoDiT d={args.dim}, {args.layers} blocks, LoRA r16, {sum(batch[0].seq_lens.tolist())} tokens, "
          f"{args.steps} steps each, interleaved, {torch.get_num_threads()} threads")  # fmt: skip
    print(f"{'variant':28s} {'median step':>12s} {'ratio':>7s} {'base bytes on device':>22s}")
    for name in variants:
        med = statistics.median(times[name])
        print(f"{name:28s} {med * 1e3:10.1f} ms {med / base:6.2f}x {bytes_on_device[name] / 1e6:18.2f} MB")
    print(
        f"offloaded: at most {peak} of {args.layers} blocks resident; {offloader.host_bytes() / 1e6:.2f} MB on the host"
    )


if __name__ == "__main__":
    main()
