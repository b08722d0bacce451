"""CPU training-step time with ``model.compile`` (per-block torch.compile, inductor) against eager.

Both models have the same weights and see the same packed micro-batches of mixed clip sizes; a step
is forward, backward and AdamW. The compiled model's first steps (compilation) are reported apart
and left out of the medians; the timed steps cycle over several packings, so a recompile would show
(the dynamo recompile count is printed). Timings alternate between the two models.

    PYTHONPATH=$PWD python bench/bench_compile.py [--size tiny --repeats 5 --layers 0]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from dit.attention import PackedAttention
from dit.compile import compile_blocks, recompiles
from dit.model import VideoDiT
from dit.sizes import MODEL_SIZES

# packed micro-batches of (t, h, w) patch grids: mixed clips, as the token-budget packer makes them
PACKINGS = [
    [(5, 8, 8), (1, 8, 12), (3, 12, 8)],
    [(5, 12, 8), (5, 8, 8)],
    [(9, 8, 8), (1, 8, 8), (1, 12, 8), (3, 8, 8)],
    [(7, 8, 12), (1, 8, 8)],
]


def batch(grids, cfg, g: torch.Generator) -> dict:
    positions = [
        torch.stack(torch.meshgrid(*(torch.arange(s) for s in grid), indexing="ij"), -1).reshape(-1, 3)
        for grid in grids
    ]
    lens = [p.shape[0] for p in positions]
    patch = cfg["in_channels"] * 4
    return dict(
        tokens=torch.randn(sum(lens), patch, generator=g),
        positions=torch.cat(positions),
        seq_lens=torch.tensor(lens),
        timesteps=torch.rand(len(lens), generator=g) * 1000,
        text=torch.randn(8 * len(lens), cfg["text_dim"], generator=g),
        text_lens=torch.tensor([8] * len(lens)),
        attention=PackedAttention(lens),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="tiny", choices=sorted(MODEL_SIZES))
    ap.add_argument("--layers", type=int, default=0, help="override the size's layer count (0: keep)")
    ap.add_argument("--repeats", type=int, default=5, help="timed passes over all packings")
    ap.add_argument("--heads", type=int, default=0, help="override the size's heads (0: keep)")
    ap.add_argument("--head-dim", type=int, default=0, help="override the size's head dim (0: keep)")
    ap.add_argument("--ffn", type=int, default=0, help="override the size's FFN width (0: keep)")
    args = ap.parse_args()
    cfg = {**MODEL_SIZES[args.size]}
    for key, value in (
        ("num_layers", args.layers),
        ("num_attention_heads", args.heads),
        ("attention_head_dim", args.head_dim),
        ("ffn_dim", args.ffn),
    ):
        if value:
            cfg[key] = value
    torch.manual_seed(0)
    eager = VideoDiT(**cfg, adaln_zero_init=False)
    compiled = compile_blocks(copy.deepcopy(eager))
    g = torch.Generator().manual_seed(0)
    batches = [batch(grids, cfg, g) for grids in PACKINGS]
    models = {"eager": eager, "compiled": compiled}
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}

    def step(name: str, b: dict) -> float:
        started = time.perf_counter()
        opts[name].zero_grad(set_to_none=True)
        models[name](**b).square().mean().backward()
        opts[name].step()
        return time.perf_counter() - started

    first = {name: sum(step(name, b) for b in batches) for name in models}  # compile / warm up
    times = {name: [] for name in models}
    for _ in range(args.repeats):
        for name in models:
            times[name].append(sum(step(name, b) for b in batches))
    tokens = sum(int(b["seq_lens"].sum()) for b in batches)
    med = {name: statistics.median(t) for name, t in times.items()}
    print(
        f"size={args.size} layers={cfg['num_layers']} width={cfg['num_attention_heads'] * cfg['attention_head_dim']}"
        f" threads={torch.get_num_threads()}; {len(batches)} packed micro-batches, {tokens} tokens per pass"
    )
    print(f"first pass (compile/warm-up): eager {first['eager']:.1f} s, compiled {first['compiled']:.1f} s")
    for name in models:
        print(f"{name:9s} {1e3 * med[name]:8.1f} ms per pass, {tokens / med[name]:8.0f} tokens/s")
    print(f"compiled / eager step time: {med['compiled'] / med['eager']:.2f}x; recompiles: {recompiles()}")


if __name__ == "__main__":
    main()
