"""Sample clips from a checkpoint or a diffusers Wan folder and write them as .mp4 files.

    python sample.py --checkpoint runs/tiny --prompt "a red circle moving right on a black background"
    python sample.py --pretrained Wan2.1-T2V-1.3B-Diffusers --prompts-file queue.jsonl --out clips
    torchrun --nproc_per_node 8 sample.py --pretrained Wan2.1-T2V-14B-Diffusers --prompts-file queue.jsonl

Loads a run's EMA weights by default, or its trained weights while the EMA is mostly the starting
weights (``--weights``, said in one line). ``--prompts-file`` takes plain text (one prompt a line) or
a ``.jsonl`` / ``.csv`` queue whose lines may set prompt, frames, height, width, steps, guidance,
guidance_2 (a Wan2.2 A14B folder's low-noise expert: ``--guidance-2``), seed
and negative_prompt, and image / last_image for image-to-video models (the flags give the rest;
``--image`` and ``--last-image`` give a first and last frame to every request). Request i uses its line's seed, else --seed + i: the
same request gives the same clip in any queue, on one process or many. Under torchrun a planner
gives each request its context-parallel group and CFG split (docs/sampling.md); ``--fsdp`` shards the
DiT over all ranks with training's FSDP2 (per_layer; auto: when replicated weights do not fit). Clips already in
--out are skipped, so a killed job reruns with the same command. ``--lora FILE_OR_DIR`` adds a
diffusers-format Wan LoRA (ours, diffusers', finetrainers', DiffSynth-Studio's), scaled by
``--lora-scale``; a LoRA run's own checkpoint loads its base and adapters by itself. On one process
``--base-dtype fp8_scaled`` stores the blocks' weights in fp8 and ``--offload blocks`` keeps them in host
memory, as a run with ``model.base_dtype`` and ``model.offload`` trained (and samples, by default);
``--idle-expert cpu`` keeps a Wan2.2 A14B model's expert not running there too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from data.cli import add_debug_flag, run_cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="run directory (its latest checkpoint) or a step_* dir")
    source.add_argument(
        "--pretrained", help="a diffusers Wan folder: transformer/, vae/, text_encoder/, tokenizer/"
    )
    parser.add_argument("--prompt", action="append", help="a prompt; repeat for several")
    parser.add_argument(
        "--prompts-file", help="one prompt a line (.txt), or a .jsonl / .csv queue with per-line settings"
    )
    parser.add_argument(
        "--weights",
        choices=("auto", "ema", "model"),
        default="auto",
        help="a run's EMA (ema), its trained weights (model), or auto (default): the EMA once the "
        "starting weights are under 10%% of it (step 230 at train.ema_decay 0.99), else model, said in one line",
    )
    parser.add_argument("--frames", type=int, default=9, help="frames per clip (default 9)")
    parser.add_argument("--height", type=int, default=16, help="clip height in pixels (default 16)")
    parser.add_argument("--width", type=int, default=16, help="clip width in pixels (default 16)")
    parser.add_argument("--steps", type=int, default=30, help="Euler steps")
    parser.add_argument(
        "--guidance", type=float, default=4.0, help="classifier-free guidance scale; 1 disables"
    )
    parser.add_argument(
        "--guidance-2",
        type=float,
        default=None,
        help="guidance of a two-expert (Wan2.2 A14B) folder's low-noise expert; default: --guidance",
    )
    parser.add_argument(
        "--shift",
        type=float,
        default=None,
        help="sigma shift; default: the run's flow.shift, else by token count",
    )
    parser.add_argument("--negative-prompt", default="")
    parser.add_argument(
        "--image",
        default=None,
        help="first frame for an image-to-video model, or for Wan2.2 TI2V's image-to-video mode (PNG/JPEG); "
        "a queue line may set its own",
    )
    parser.add_argument("--last-image", default=None, help="last frame for a first-last-frame (FLF2V) model")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of request 0; request i takes seed + i (default 0)"
    )
    parser.add_argument("--fps", type=int, default=8, help="frame rate written into the mp4s (default 8)")
    parser.add_argument(
        "--upscale",
        type=int,
        default=1,
        help="nearest-neighbour enlargement of the written files (default 1: the size asked for)",
    )
    parser.add_argument("--grid", action="store_true", help="also write a PNG grid of all frames")
    parser.add_argument("--lora", default=None, help="a Wan LoRA .safetensors file (or its folder) to add")
    parser.add_argument("--lora-scale", type=float, default=1.0, help="strength of --lora (0 = the base)")
    parser.add_argument(
        "--out", default=None, help="output directory (default: <run>/samples, or ./samples for --pretrained)"
    )
    parser.add_argument(
        "--cfg-parallel",
        choices=("auto", "off"),
        default="auto",
        help="under torchrun: let the planner run a request's two CFG branches on two groups (auto)",
    )
    parser.add_argument(
        "--memory-gb",
        type=float,
        default=None,
        help="memory per rank requests must fit (default: the GPU's; no check on CPU)",
    )
    parser.add_argument(
        "--fsdp",
        choices=("auto", "none", "per_layer"),
        default="auto",
        help="under torchrun: shard the DiT over all ranks with FSDP2 (per_layer), keep it replicated "
        "(none), or shard only when replicated weights leave a request no room in --memory-gb (auto)",
    )
    parser.add_argument(
        "--precision",
        choices=("auto", "bf16", "no"),
        default="auto",
        help="DiT and text encoder weights in bf16 with bf16 autocast (bf16), or fp32 (no); auto: bf16 on "
        "GPUs, fp32 on CPUs (as train.mixed_precision). The VAE and image encoder stay fp32",
    )
    parser.add_argument(
        "--base-dtype",
        choices=("auto", "fp8_e4m3", "fp8_scaled", "precision"),
        default="auto",
        help="the transformer blocks' linear weights stored in fp8 (one scale per matrix, or per row: "
        "fp8_scaled) and dequantised per layer, or in --precision's dtype (precision); auto: the run's "
        "model.base_dtype when fp8, else precision (docs/lowmem.md)",
    )
    parser.add_argument(
        "--offload",
        choices=("auto", "none", "blocks"),
        default="auto",
        help="keep --offload-blocks transformer blocks in host memory, each copied in for its forward "
        "(blocks), or none; auto: blocks when the run trained with model.offload, else none",
    )
    parser.add_argument(
        "--offload-blocks",
        type=int,
        default=None,
        help="how many blocks --offload keeps on the host (default: all)",
    )
    parser.add_argument(
        "--idle-expert",
        choices=("auto", "cpu", "device"),
        default="auto",
        help="of a two-expert (Wan2.2 A14B) model: keep the expert not running in host memory (cpu) or "
        "on the device (device); auto: cpu when the run trained with model.idle_expert=cpu, else device",
    )
    parser.add_argument(
        "--hardware",
        default=None,
        help="cost-model profile for the planner (default: h100 on GPU, cpu-like on CPU)",
    )
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    return run_cli(lambda: run(args), args.debug)


def request_defaults(args) -> dict:
    """The settings of a request that its queue line does not set, from the flags (checked here, before
    anything loads)."""
    if args.upscale < 1:
        raise ValueError(f"--upscale {args.upscale}: use 1 (the size asked for) or a larger whole factor")
    return dict(
        frames=args.frames, height=args.height, width=args.width, steps=args.steps, guidance=args.guidance,
        guidance_2=args.guidance_2, seed=args.seed, negative_prompt=args.negative_prompt, image=args.image or "",
        last_image=args.last_image or "",
    )  # fmt: skip


def run(args) -> int:
    import contextlib
    import os

    import torch

    from dit.sample_output import check_writable, output_path, remove_partials
    from dit.sample_requests import build_queue
    from dit.sampler_setup import LOWMEM_DEFAULTS, load_checkpoint_sampler, load_pretrained_sampler
    from dit.sampling import check_requests, sample_queue
    from dit.trainer import autocast_dtype

    requests = build_queue(args.prompt, args.prompts_file, request_defaults(args))
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    lowmem = (args.base_dtype, args.offload, args.offload_blocks, args.idle_expert)
    if distributed and lowmem != LOWMEM_DEFAULTS:
        raise ValueError(
            "--base-dtype/--offload/--offload-blocks/--idle-expert sample on one process; under torchrun "
            "drop them (and shard the weights with --fsdp per_layer)"
        )
    if distributed:  # a run trained with fp8 or offload samples with its DiT's dtype here
        lowmem = ("precision", "none", None, "device")
        from dynamic_cp.runtime.sampling import sampling_world

        world = sampling_world()  # joins torchrun's process group; left on exit
    else:
        from data.cpu_threads import set_cpu_threads

        if note := set_cpu_threads():  # on a loaded CPU: fewer threads than cores (data/cpu_threads.py)
            print(note, flush=True)
        world = contextlib.nullcontext(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    with world as device:
        # under torchrun the DiT waits on the CPU until the plan says replicated or sharded
        model_device = torch.device("cpu") if distributed else device
        dtype = autocast_dtype(args.precision, device) or torch.float32
        if args.pretrained:
            sampler = load_pretrained_sampler(
                args.pretrained, args.lora, args.lora_scale, device, model_device=model_device, dtype=dtype,
                lowmem=lowmem,
            )  # fmt: skip
        else:
            sampler = load_checkpoint_sampler(
                args.checkpoint, args.weights, args.lora, args.lora_scale, device, model_device, dtype, lowmem
            )
        shift = args.shift if args.shift is not None else sampler.shift
        check_requests(sampler.model, sampler.vae, requests)  # every request, before the first is sampled
        check_writable(requests, args.upscale)  # H.264 needs even sizes (after the patch's own check)
        out = Path(args.out) if args.out else sampler.out_dir
        settings = f"{sampler.source}|shift={shift}|fps={args.fps}|upscale={args.upscale}|lora={args.lora}@{args.lora_scale}"
        if dtype != torch.float32:  # fp32 keeps the keys clips written before --precision existed have
            settings += f"|precision={dtype}"
        if sampler.base_dtype != "precision":  # fp8 changes the clip; offload does not (bitwise)
            settings += f"|base={sampler.base_dtype}"
        paths = {r.index: output_path(out, r, settings) for r in requests}
        if os.environ.get("RANK", "0") == "0":  # before any rank writes: others wait for its plan
            print(describe_queue(sampler.source, requests, shift))
            remove_partials(out)  # what a killed job was writing when it died
        if distributed:
            from dynamic_cp.runtime.sampling import sample_queue_distributed

            sample_queue_distributed(
                sampler,
                requests,
                paths,
                shift,
                args.fps,
                args.upscale,
                args.cfg_parallel != "off",
                args.hardware,
                args.memory_gb,
                args.fsdp,
                device,
            )
        else:
            from dynamic_cp.runtime.sampling_plan import check_memory, device_memory, resident_bytes

            memory = device_memory(device, args.memory_gb)
            if memory is not None:  # a request that cannot fit fails now, not after the others
                check_memory(sampler.model, sampler.vae, requests, memory, resident_bytes(sampler), sampler)
            sample_queue(
                sampler.model,
                sampler.text_encoder,
                sampler.vae,
                requests,
                paths,
                shift,
                args.fps,
                args.upscale,
                sampler.image_encoder,
            )
    if args.grid and os.environ.get("RANK", "0") == "0":  # one rank draws the grid, from the mp4s
        write_grid(out, requests, paths, args.seed)
    return 0


def describe_queue(source: str, requests, shift: float | None) -> str:
    """One line: which weights sample what (shapes, steps, guidance, shift, seeds), before the wait."""

    def each(values) -> str:  # every distinct value, or the range of many
        got = sorted(set(values))
        return "/".join(map(str, got)) if len(got) <= 3 else f"{got[0]}..{got[-1]} ({len(got)} values)"

    shapes = each(f"{r.frames}x{r.height}x{r.width}" for r in requests)
    seeds = each(r.seed for r in requests)
    return (
        f"sampling {len(requests)} clip(s) with {source}: {shapes} (frames x height x width), "
        f"{each(r.steps for r in requests)} steps, guidance {each(r.guidance for r in requests)}, "
        f"shift {'by token count' if shift is None else shift}, seed {seeds}"
    )


def write_grid(out: Path, requests, paths: dict, seed: int) -> None:
    """The PNG of every clip's frames (rows = requests), read back from the mp4s; skipped, with a
    note, when the clips differ in shape."""
    import hashlib

    import imageio.v3 as iio
    import torch

    from dit.sample_output import frame_grid, write_grid_png

    shapes = {(r.frames, r.height, r.width) for r in requests}
    if len(shapes) > 1:
        print(f"--grid skipped: the queue mixes {len(shapes)} clip shapes, a grid needs one")
        return
    # frames back in [-1, 1], (3, f, h, w), as frame_grid takes them
    videos = [
        torch.from_numpy(iio.imread(paths[r.index])).permute(3, 0, 1, 2).float() / 127.5 - 1 for r in requests
    ]
    # named after the clips it shows (their names key every setting), so another queue or setting
    # into the same --out gets its own grid instead of overwriting the last one
    key = hashlib.sha1("|".join(Path(paths[r.index]).name for r in requests).encode()).hexdigest()[:6]
    print(write_grid_png(frame_grid(videos), out / f"grid_seed{seed}_{key}.png"))


if __name__ == "__main__":
    sys.exit(main())
