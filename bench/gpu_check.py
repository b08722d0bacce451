"""One prepared check for the first GPU: every path that only a GPU takes, in one run, one table.

    PYTHONPATH=$PWD python bench/gpu_check.py [--out DIR] [--layers 4] [--tokens 8448 32760]

Sections (each in its own try/except: a failure prints its traceback and the run goes on):
1. attention: each local backend (flash-attn, torch varlen_attn, SDPA per clip) in bf16 against fp32
   SDPA per clip on packed odd-length clips, forward and backward (max error relative to the largest
   reference value), plus the LSE kernels of ring attention (forward output and LSE, and the backward
   from a given output and LSE) per backend; fwd+bwd time of each;
2. step: a bf16 training step (forward, backward, AdamW) at Wan-1.3B width (d 1536, 12 heads, FFN
   8960, text 4096) and a few layers, at about 8K and 32K tokens, eager and with ``model.compile``
   (one compiled model serves both lengths: its recompile count is in the table): tokens/s, TFLOP/s
   (``dit/flops.py``), MFU against the device's bf16 peak, peak memory;
3. calibrate: ``python -m dynamic_cp.calibrate --quick`` writes a hardware profile into --out.

Without CUDA (or with --dry-run) it prints what it would run and exits 0. Budget: under 8 minutes
on one H100/H200 (compiling the block takes most of it). Results also go to ``DIR/gpu_check.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: import this checkout's packages, not an installed one
    sys.path.insert(0, str(ROOT))

from dit.attention import (  # noqa: E402
    attention_backend,
    cu_seqlens_from_lengths,
    flash_attn_varlen_func,
    torch_varlen_available,
    varlen_attention,
)
from dit.flops import train_step_flops  # noqa: E402
from dit.sizes import MODEL_SIZES  # noqa: E402

CLIPS = [1023, 4097, 511, 2049, 7]  # odd lengths, one tiny clip
HEADS, HEAD_DIM = 12, 128  # Wan-1.3B attention
WAN_13B = {k: v for k, v in MODEL_SIZES["wan-1.3b"].items() if k != "num_layers"}  # widths; layers set below
# (t, h, w) latent patch grids: 256px x 129 frames (8,448 tokens), 480p x 81 frames (32,760 tokens)
GRIDS = {8448: (33, 16, 16), 32760: (21, 30, 52)}
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0}


def plan(args) -> list[str]:
    return [
        f"attention: backends {available_backends()} in bf16 vs fp32 SDPA per clip on clips {CLIPS}, "
        f"{HEADS} heads x {HEAD_DIM}: forward + backward max error and time; ring LSE kernels per backend",
        f"step: bf16 training step, Wan-1.3B width, {args.layers} layers, at {args.tokens} tokens, eager "
        "and compiled: tokens/s, TFLOP/s, MFU vs device peak, peak memory, recompiles",
        f"calibrate: python -m dynamic_cp.calibrate --quick --out {args.out}/profile.yaml",
    ]


def available_backends() -> list[str]:
    names = ["flash_attn"] if flash_attn_varlen_func is not None else []
    if torch_varlen_available():
        names.append("torch_varlen")
    return [*names, "sdpa"]


def _sync() -> None:
    torch.cuda.synchronize()


def _median_time(fn, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    _sync()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _rel_max(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref|: one figure per tensor, comparable across backends."""
    return float((a.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-12))


# ----------------------------------------------------------------------------- 1. attention


def check_attention(device: torch.device) -> list[dict]:
    from dynamic_cp.attention.kernels import attention_bwd_lse, attention_fwd_lse

    g = torch.Generator(device=device).manual_seed(0)
    n = sum(CLIPS)
    q, k, v, dout = (torch.randn(n, HEADS, HEAD_DIM, device=device, generator=g) for _ in range(4))
    cu = cu_seqlens_from_lengths(CLIPS)
    # reference: fp32 SDPA one clip at a time, with autograd
    qr, kr, vr = (x.clone().requires_grad_(True) for x in (q, k, v))
    out_ref = varlen_attention(qr, kr, vr, cu, cu, backend="sdpa")
    out_ref.backward(dout)
    grads_ref = (qr.grad, kr.grad, vr.grad)
    lse_ref = torch.cat(  # (h, n) fp32 log-sum-exp, clip by clip
        [
            (torch.einsum("qhd,khd->hqk", q[s:e], k[s:e]) / HEAD_DIM**0.5).logsumexp(-1)
            for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())
        ],
        dim=1,
    )
    print(f"dispatch picks {attention_backend(q.bfloat16())!r} for CUDA bf16")
    rows = []
    for name in available_backends():
        row = {"section": "attention", "item": name}
        try:
            qb, kb, vb = (x.bfloat16().requires_grad_(True) for x in (q, k, v))

            def fwd_bwd(name=name, qb=qb, kb=kb, vb=vb):
                for x in (qb, kb, vb):
                    x.grad = None
                out = varlen_attention(qb, kb, vb, cu, cu, backend=name)
                out.backward(dout.bfloat16())
                return out

            out = fwd_bwd()
            row["out_err"] = _rel_max(out, out_ref)
            row["dq_err"], row["dk_err"], row["dv_err"] = (
                _rel_max(x.grad, r) for x, r in zip((qb, kb, vb), grads_ref)
            )
            row["fwd_bwd_ms"] = 1e3 * _median_time(fwd_bwd, repeats=5)
            # ring attention's kernels: output + LSE, then the backward from the given output and LSE
            with torch.no_grad():
                qd, kd, vd = q.bfloat16(), k.bfloat16(), v.bfloat16()
                o_l, lse = attention_fwd_lse(qd, kd, vd, cu, cu, backend=name)
                row["lse_out_err"] = _rel_max(o_l, out_ref)
                row["lse_err"] = float((lse - lse_ref).abs().max())
                dq, dk, dv = attention_bwd_lse(dout.bfloat16(), qd, kd, vd, o_l, lse, cu, cu, backend=name)
                row["lse_dq_err"], row["lse_dk_err"], row["lse_dv_err"] = (
                    _rel_max(x, r) for x, r in zip((dq, dk, dv), grads_ref)
                )
        except Exception:  # noqa: BLE001 - report and go on to the next backend
            row["error"] = traceback.format_exc(limit=3)
            traceback.print_exc()
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- 2. training step


def _peak_tflops(device: torch.device) -> float | None:
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)


def _step_inputs(tokens: int, device: torch.device):
    t, h, w = GRIDS.get(tokens) or (1, 1, tokens)
    n = t * h * w
    grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"), -1)
    patch = WAN_13B["in_channels"] * 4
    return dict(
        tokens=torch.randn(n, patch, device=device),
        positions=grid.reshape(-1, 3).to(device),
        seq_lens=torch.tensor([n], device=device),
        timesteps=torch.rand(1, device=device) * 1000,
        text=torch.randn(512, WAN_13B["text_dim"], device=device),
        text_lens=torch.tensor([512], device=device),
    )


def check_steps(device: torch.device, layers: int, sizes: list[int], repeats: int) -> list[dict]:
    from dit.attention import PackedAttention
    from dit.compile import compile_blocks, recompiles
    from dit.model import VideoDiT

    peak = _peak_tflops(device)
    dim = WAN_13B["num_attention_heads"] * WAN_13B["attention_head_dim"]
    rows = []
    for mode in ("eager", "compiled"):
        try:
            torch.manual_seed(0)
            model = VideoDiT(**WAN_13B, num_layers=layers, adaln_zero_init=False).to(device)
            if mode == "compiled":
                compile_blocks(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            rows.append({"section": "step", "item": mode, "error": traceback.format_exc(limit=3)})
            continue
        for tokens in sizes:
            row = {"section": "step", "item": f"{mode} {tokens}"}
            try:
                inputs = _step_inputs(tokens, device)
                n = inputs["tokens"].shape[0]
                attention = PackedAttention([n])

                def step(model=model, opt=opt, inputs=inputs, attention=attention):
                    opt.zero_grad(set_to_none=True)
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        out = model(**inputs, attention=attention)
                    out.float().square().mean().backward()
                    opt.step()

                started = time.perf_counter()
                step()  # the first call compiles (or warms up the allocator)
                _sync()
                row["first_s"] = time.perf_counter() - started
                torch.cuda.reset_peak_memory_stats(device)
                seconds = _median_time(step, repeats=repeats)
                flops = train_step_flops([n], dim, WAN_13B["ffn_dim"], layers)
                row.update(
                    tokens=n,
                    step_ms=1e3 * seconds,
                    tokens_per_s=n / seconds,
                    tflops=flops / seconds / 1e12,
                    mfu=(flops / seconds / 1e12 / peak) if peak else None,
                    peak_mem_gib=torch.cuda.max_memory_allocated(device) / 2**30,
                )
                if mode == "compiled":
                    row["recompiles"] = recompiles()
            except Exception:  # noqa: BLE001
                row["error"] = traceback.format_exc(limit=3)
                traceback.print_exc()
            rows.append(row)
        del model, opt
        torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------- 3. calibrate


def check_calibrate(out: Path) -> list[dict]:
    profile = out / "profile.yaml"
    cmd = [sys.executable, "-m", "dynamic_cp.calibrate", "--quick", "--out", str(profile)]
    row = {"section": "calibrate", "item": str(profile)}
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        started = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
        row["seconds"] = time.perf_counter() - started
        print(proc.stdout[-2000:], proc.stderr[-2000:])
        row["ok"] = proc.returncode == 0 and profile.is_file()
        if not row["ok"]:
            row["error"] = f"exit {proc.returncode}: {proc.stderr[-500:]}"
    except Exception:  # noqa: BLE001
        row["error"] = traceback.format_exc(limit=3)
    return [row]


# ----------------------------------------------------------------------------- table


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return "" if value is None else str(value)


def print_table(rows: list[dict]) -> None:
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys and k != "error"]
    print("\n| " + " | ".join(keys) + " | error |")
    print("|" + "---|" * (len(keys) + 1))
    for row in rows:
        error = (row.get("error") or "").strip().splitlines()
        cells = [_fmt(row.get(k)) for k in keys] + [error[-1] if error else ""]
        print("| " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "out" / "gpu_check")))
    ap.add_argument("--layers", type=int, default=4, help="transformer blocks of the Wan-1.3B-wide model")
    ap.add_argument("--tokens", type=int, nargs="+", default=[8448, 32760], help="tokens of the step")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per size (median)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["attention", "step", "calibrate"])
    ap.add_argument("--dry-run", action="store_true", help="print what would run, run nothing")
    args = ap.parse_args(argv)
    sections = plan(args)
    if args.dry_run or not torch.cuda.is_available():
        why = "--dry-run" if args.dry_run else "no CUDA device"
        print(f"gpu_check ({why}): would run, on one GPU, in under 8 minutes:")
        for line in sections:
            print(f"  - {line}")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    started = time.perf_counter()
    rows: list[dict] = []
    if "attention" not in args.skip:
        rows += check_attention(device)
    if "step" not in args.skip:
        rows += check_steps(device, args.layers, args.tokens, args.repeats)
    if "calibrate" not in args.skip:
        rows += check_calibrate(out)
    print_table(rows)
    print(f"total {time.perf_counter() - started:.0f} s")
    (out / "gpu_check.json").write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
