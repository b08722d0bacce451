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
3. calibrate: ``python -m dynamic_cp.calibrate --quick`` writes a hardware profile into --out;
4. fp8: a LoRA step (r32) on an fp8_scaled base against a bf16 base (``model.base_dtype``): step time,
   ratio, peak memory, the output's error; and ``train.fp8`` (torchao Float8Linear, tensorwise and
   rowwise) against a bf16 full-training step, when torchao is installed and the GPU has fp8
   (capability 8.9+; otherwise the rows say why they were skipped);
5. offload: a checkpointed LoRA step with every block offloaded (``model.offload=blocks``) against no
   offload: step-time ratio, peak device memory, offloaded blocks resident at most, adapter gradients
   bitwise equal.

Without CUDA (or with --dry-run) it prints what it would run and exits 0. Budget: under 9 minutes
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
        f"fp8: LoRA r32 step on an fp8_scaled base vs a bf16 base, {args.layers} layers at {args.tokens[0]} "
        "tokens: step time, ratio, peak memory, output error; train.fp8 tensorwise and rowwise vs bf16 "
        "full training (needs torchao, .[fp8], and compute capability 8.9+; else skipped with why)",
        f"offload: checkpointed LoRA step, every one of {args.layers} blocks offloaded (model.offload=blocks) "
        "vs none: step-time ratio, peak device memory, resident blocks at most, gradients bitwise equal",
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


# ----------------------------------------------------------------------------- 4-5. fp8 and offload


def needs_cuda(section: str, device: torch.device) -> list[dict] | None:
    """The row that skips ``section`` off a CUDA device (None on one): these cases time a GPU."""
    if device.type == "cuda":
        return None
    return [{"section": section, "item": "all", "skipped": f"needs a CUDA device, not {device.type}"}]


def fp8_training_skip(device: torch.device) -> str | None:
    """Why ``train.fp8`` cannot run on ``device`` (the trainer's own refusal), or None."""
    from dit.fp8_train import check_fp8_runs

    try:
        check_fp8_runs(True, False, device)
    except ValueError as e:
        return str(e)
    return None


def _lowmem_model(layers: int, base: str | None):
    """Wan-1.3B width on the CPU: a LoRA r32 model on a frozen bf16 or fp8_scaled base, or with
    ``base`` None a full-training model (fp32 weights)."""
    from dit.fp8_base import store_base_in_fp8
    from dit.lora import setup_lora
    from dit.model import VideoDiT
    from dit.model_config import LoraSettings

    torch.manual_seed(0)
    model = VideoDiT(**WAN_13B, num_layers=layers, adaln_zero_init=False)
    if base is not None:
        setup_lora(model, LoraSettings(rank=32), None, torch.bfloat16)
        if base == "fp8_scaled":
            store_base_in_fp8(model, per_row=True, compute_dtype=torch.bfloat16)
    return model


def _timed_lowmem(model, device: torch.device, tokens: int, repeats: int, item: str, section: str):
    """Steps of ``model`` (on ``device``): forward in bf16 autocast, backward, AdamW on what trains.
    -> a row with step_ms, tokens_per_s, peak_mem_gib, and its first step's output and gradients."""
    from dit.attention import PackedAttention

    inputs = _step_inputs(tokens, device)
    n = inputs["tokens"].shape[0]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    first = {}

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = model(**inputs, attention=PackedAttention([n]))
        loss = out.float().square().mean()
        loss.backward()
        if not first:
            first.update(out=out.detach().float(), loss=float(loss), grads=[p.grad.clone() for p in params])
        opt.step()

    step()
    _sync()
    torch.cuda.reset_peak_memory_stats(device)
    seconds = _median_time(step, repeats=repeats, warmup=0)
    row = {
        "section": section,
        "item": item,
        "tokens": n,
        "step_ms": 1e3 * seconds,
        "tokens_per_s": n / seconds,
    }
    row["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return row, first


def _vs(rows: list[dict], firsts: list[dict]) -> None:
    """Ratios and output errors of each row against the first (the baseline)."""
    for row, first in zip(rows[1:], firsts[1:]):
        row["ratio"] = row["step_ms"] / rows[0]["step_ms"]
        row["out_err"] = _rel_max(first["out"], firsts[0]["out"])
        row["loss_rel"] = abs(first["loss"] - firsts[0]["loss"]) / abs(firsts[0]["loss"])


def check_fp8(device: torch.device, layers: int, tokens: int, repeats: int) -> list[dict]:
    skipped = needs_cuda("fp8", device)
    if skipped:
        return skipped
    rows: list[dict] = []
    groups = [("lora base", [("bf16", "bf16"), ("fp8_scaled", "fp8_scaled")])]
    why = fp8_training_skip(device)
    if why is None:
        groups.append(("train.fp8", [("bf16", None), ("tensorwise", "tensorwise"), ("rowwise", "rowwise")]))
    else:
        rows.append({"section": "fp8", "item": "train.fp8", "skipped": why})
    for group, variants in groups:
        done, firsts = [], []
        for name, what in variants:
            row = {"section": "fp8", "item": f"{group} {name}"}
            try:
                if group == "lora base":
                    model = _lowmem_model(layers, what)
                else:
                    from dit.fp8_train import convert_to_fp8

                    model = _lowmem_model(layers, None)
                    if what is not None:
                        row["converted"] = len(convert_to_fp8(model, what))
                model.to(device)
                timed, first = _timed_lowmem(model, device, tokens, repeats, row["item"], "fp8")
                done.append({**timed, **row})
                firsts.append(first)
            except Exception:  # noqa: BLE001
                row["error"] = traceback.format_exc(limit=3)
                traceback.print_exc()
                rows.append(row)
            model = None
            torch.cuda.empty_cache()
        if firsts and len(firsts) == len(done):
            _vs(done, firsts)
        rows += done
    return rows


def check_offload(device: torch.device, layers: int, tokens: int, repeats: int) -> list[dict]:
    from dit.block_offload import BlockOffloader

    skipped = needs_cuda("offload", device)
    if skipped:
        return skipped
    rows, firsts = [], []
    for count in (0, layers):
        row = {"section": "offload", "item": f"blocks {count} of {layers}"}
        try:
            model = _lowmem_model(layers, "bf16")
            model.gradient_checkpointing = True
            offloader = BlockOffloader(model.blocks, device, count, lambda: True) if count else None
            model.to(device)
            timed, first = _timed_lowmem(model, device, tokens, repeats, row["item"], "offload")
            row.update(timed)
            if offloader is not None:
                row["resident_blocks_max"] = offloader.peak_blocks
                row["host_gib"] = offloader.host_bytes() / 2**30
            firsts.append(first)
        except Exception:  # noqa: BLE001
            row["error"] = traceback.format_exc(limit=3)
            traceback.print_exc()
        rows.append(row)
        model = offloader = None
        torch.cuda.empty_cache()
    if len(firsts) == 2:
        _vs(rows, firsts)
        rows[1]["grads_equal"] = all(
            torch.equal(a, b) for a, b in zip(firsts[0]["grads"], firsts[1]["grads"])
        )
    return rows


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
    ap.add_argument(
        "--skip", nargs="*", default=[], choices=["attention", "step", "calibrate", "fp8", "offload"]
    )
    ap.add_argument("--dry-run", action="store_true", help="print what would run, run nothing")
    args = ap.parse_args(argv)
    sections = plan(args)
    if args.dry_run or not torch.cuda.is_available():
        why = "--dry-run" if args.dry_run else "no CUDA device"
        print(f"gpu_check ({why}): would run, on one GPU, in under 9 minutes:")
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
    if "fp8" not in args.skip:
        rows += check_fp8(device, args.layers, args.tokens[0], args.repeats)
    if "offload" not in args.skip:
        rows += check_offload(device, args.layers, args.tokens[0], args.repeats)
    print_table(rows)
    print(f"total {time.perf_counter() - started:.0f} s")
    (out / "gpu_check.json").write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
