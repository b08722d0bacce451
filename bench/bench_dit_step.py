"""Training-step speed of our packed VideoDiT against diffusers' WanTransformer3DModel.

Both models get equal width, depth, heads, FFN and patch, the same weights and the same tokens; a
step is forward + backward of a mean-squared loss. Two questions, each answered by a ratio measured
in one run (timings alternate between the contenders, medians of --repeats):
  1. one clip: our step against Wan's step on the same clip;
  2. a batch of mixed clip sizes: our packed step against the same clips zero-padded to the largest
     shape and run as one padded batch through Wan (what a stack without packing has to do).

    python bench/bench_dit_step.py [--dim 256 --layers 4 --repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from diffusers import WanTransformer3DModel

from dit.attention import PackedAttention
from dit.model import VideoDiT
from dit.packing import pack


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = dict(
        patch_size=(1, 2, 2), num_attention_heads=args.heads, attention_head_dim=args.dim // args.heads,
        in_channels=16, out_channels=16, text_dim=64, freq_dim=64, ffn_dim=4 * args.dim, num_layers=args.layers,
    )  # fmt: skip
    wan = WanTransformer3DModel(**cfg, qk_norm="rms_norm_across_heads")
    ours = VideoDiT(**cfg, adaln_zero_init=False)
    state = wan.state_dict()
    w = state.pop("patch_embedding.weight")
    state["patch_embedding.weight"] = w.permute(0, 2, 3, 4, 1).reshape(w.shape[0], -1)
    ours.load_state_dict(state)
    text_len = 16

    def our_step(clips):
        packed = pack(clips, (1, 2, 2))
        b = len(clips)
        text = torch.randn(b * text_len, 64)
        out = ours(packed.tokens, packed.positions, packed.seq_lens, torch.full((b,), 500.0), text,
                   torch.full((b,), text_len), PackedAttention(packed.seq_lens))  # fmt: skip
        F.mse_loss(out, packed.tokens).backward()

    def wan_step(batch):
        out = wan(
            batch, torch.full((batch.shape[0],), 500.0), torch.randn(batch.shape[0], text_len, 64)
        ).sample
        F.mse_loss(out, batch).backward()

    print(f"models: dim={args.dim} heads={args.heads} layers={args.layers} ffn={4 * args.dim}, fp32 CPU, "
          f"{torch.get_num_threads()} threads")  # fmt: skip

    # 1. one clip
    clip = torch.randn(16, 9, 24, 24)  # 9 * 12 * 12 = 1296 tokens
    our_times, wan_times = [], []
    our_step([clip]), wan_step(clip[None])  # warm-up
    for _ in range(args.repeats):
        our_times += timed(lambda: our_step([clip]), 1)
        wan_times += timed(lambda: wan_step(clip[None]), 1)
    a, b = statistics.median(our_times), statistics.median(wan_times)
    print(
        f"single clip (1296 tokens): ours {a * 1e3:.0f} ms, diffusers Wan {b * 1e3:.0f} ms, speedup {b / a:.2f}x"
    )

    # 2. mixed sizes: packed against padded to the largest clip
    shapes = [(9, 24, 24), (1, 16, 16), (5, 16, 24), (1, 24, 16), (3, 8, 8), (9, 16, 16)]
    clips = [torch.randn(16, *s) for s in shapes]
    big = [max(s[i] for s in shapes) for i in range(3)]
    padded = torch.stack(
        [F.pad(c, (0, big[2] - c.shape[3], 0, big[1] - c.shape[2], 0, big[0] - c.shape[1])) for c in clips]
    )
    tokens = sum(f * (h // 2) * (w // 2) for f, h, w in shapes)
    pad_tokens = len(shapes) * big[0] * (big[1] // 2) * (big[2] // 2)
    our_times, wan_times = [], []
    our_step(clips), wan_step(padded)
    for _ in range(args.repeats):
        our_times += timed(lambda: our_step(clips), 1)
        wan_times += timed(lambda: wan_step(padded), 1)
    a, b = statistics.median(our_times), statistics.median(wan_times)
    print(f"mixed batch ({len(shapes)} clips, {tokens} tokens packed vs {pad_tokens} padded): "
          f"ours packed {a * 1e3:.0f} ms, Wan padded {b * 1e3:.0f} ms, speedup {b / a:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
