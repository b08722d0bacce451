"""Rectified-flow objective: noising path, timestep sampling, resolution shift and the per-clip loss.

Convention (as Wan, SD3 and diffusers' FlowMatchEulerDiscreteScheduler): sigma in [0, 1],
    x_sigma = (1 - sigma) * x0 + sigma * noise,    target velocity v = noise - x0,
and the network sees timestep = 1000 * sigma.

Loss weighting. A packed micro-batch mixes clips of 256 and 30,000 tokens. Averaging the squared error
over *tokens* would give the long clip 100x the say of the short one, so training would quietly favour
long, high-resolution clips. We average over each clip's own tokens first and then over the clips of
the global batch: every clip counts once, whatever its length. Expressed per token, the weight is
1 / (clip_tokens * clips_in_global_batch); summing weighted token errors over micro-batches and CP
shards therefore gives exactly the global mean, which is what makes gradient accumulation and
context parallelism equal single-process training.
"""

from __future__ import annotations

import torch


def add_noise(x0: torch.Tensor, noise: torch.Tensor, sigma_per_token: torch.Tensor) -> torch.Tensor:
    """x0, noise: (n, p); sigma_per_token: (n,) -> x_sigma (n, p)."""
    s = sigma_per_token[:, None].to(x0.dtype)
    return (1 - s) * x0 + s * noise


def sample_sigmas(
    num: int, generator: torch.Generator, mode: str = "logit_normal", mean: float = 0.0, std: float = 1.0
) -> torch.Tensor:
    """Draw (num,) sigmas in (0, 1). Logit-normal (SD3) puts more samples mid-path, where the task is hardest."""
    if mode == "logit_normal":
        return torch.sigmoid(mean + std * torch.randn(num, generator=generator))
    if mode == "uniform":
        return torch.rand(num, generator=generator).clamp(1e-5, 1 - 1e-5)
    raise ValueError(f"flow.timestep_sampling={mode!r} is not supported; use 'logit_normal' or 'uniform'")


def shift_sigmas(sigmas: torch.Tensor, shift: torch.Tensor | float) -> torch.Tensor:
    """Move sigmas towards 1 (more noise) by ``shift`` > 1, as diffusers' flow schedulers do."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def shift_for_tokens(
    num_tokens: torch.Tensor | int,
    base_tokens: int = 256,
    max_tokens: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> torch.Tensor:
    """Resolution/duration-dependent shift exp(mu), mu linear in the token count (SD3/Flux rule).

    Bigger clips carry more redundant signal, so the same sigma destroys less of them; a bigger
    shift puts their training (and sampling) at higher noise to compensate.
    """
    n = torch.as_tensor(num_tokens, dtype=torch.float64)
    slope = (max_shift - base_shift) / (max_tokens - base_tokens)
    mu = base_shift + slope * (n - base_tokens)
    return torch.exp(mu).float()


def clip_token_weights(
    local_seq_lens: torch.Tensor, full_seq_lens: torch.Tensor, num_clips: int
) -> torch.Tensor:
    """(n,) weight of each local token: 1 / (tokens of its whole clip * clips in the global batch).

    local_seq_lens: tokens of each clip held by this process (a CP shard may hold part of a clip);
    full_seq_lens: the clips' whole token counts.
    """
    per_clip = 1.0 / (full_seq_lens.double() * num_clips)
    return per_clip.repeat_interleave(local_seq_lens).float()


def flow_loss(pred: torch.Tensor, target: torch.Tensor, token_weights: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of weight * mean squared error over patch values. pred, target: (n, p)."""
    per_token = (pred.float() - target.float()).pow(2).mean(dim=1)
    return (per_token * token_weights).sum()


# ----------------------------------------------------------------------------- Wan2.2 A14B experts
# WanPipeline / WanImageToVideoPipeline (diffusers) run `transformer` (the high-noise expert) while the
# scheduler's timestep t >= boundary_ratio * num_train_timesteps (1000) and `transformer_2` (low) below.
# The scheduler's t is 1000 x the *shifted* sigma, so an expert's training range is a range of shifted
# sigmas: [b, 1) for high, (0, b) for low. Splitting the unshifted draw at b instead moves the switch
# to shift(b), e.g. 0.988 at shift 12 and b = 0.875 (maxdiffusion #470).

EXPERTS = ("high", "low")
NUM_TRAIN_TIMESTEPS = 1000


def model_timesteps(sigmas) -> torch.Tensor:
    """(b,) float32 timesteps the model sees for ``sigmas``: 1000 * sigma in float32, as
    ``dit.clips.micro_batch_loss`` feeds them (and the pipeline's scheduler holds them)."""
    return torch.as_tensor(sigmas, dtype=torch.float32) * NUM_TRAIN_TIMESTEPS


def on_expert_side(timesteps: torch.Tensor, expert: str, boundary_ratio: float) -> torch.Tensor:
    """(b,) bool: the pipeline would run ``expert`` at these timesteps (its own test, t >= b * 1000)."""
    above = timesteps >= boundary_ratio * NUM_TRAIN_TIMESTEPS
    return above if expert == "high" else ~above


def unshift_sigma(sigma: float, shift: float) -> float:
    """The inverse of ``shift_sigmas``: the unshifted u with shift * u / (1 + (shift - 1) u) = sigma."""
    return sigma / (shift - (shift - 1) * sigma)


def sample_sigmas_between(
    num: int, generator: torch.Generator, mode: str, mean: float, std: float, lo: float, hi: float
) -> torch.Tensor:
    """(num,) sigmas of ``sample_sigmas``' distribution restricted to [lo, hi], by its inverse CDF: one
    uniform draw per sigma wherever the range lies (no rejection loop, however thin the range)."""
    r = torch.rand(num, generator=generator, dtype=torch.float64)
    if mode == "uniform":
        lo, hi = max(lo, 1e-5), min(hi, 1 - 1e-5)
        return (lo + (hi - lo) * r).float()
    if mode != "logit_normal":
        raise ValueError(f"flow.timestep_sampling={mode!r} is not supported; use 'logit_normal' or 'uniform'")
    z = torch.tensor([lo, hi], dtype=torch.float64).logit()  # +-inf at 0 and 1: ndtr gives 0 and 1
    p_lo, p_hi = torch.special.ndtr((z - mean) / std)
    return torch.sigmoid(mean + std * torch.special.ndtri(p_lo + (p_hi - p_lo) * r)).float()


def sample_expert_sigma(
    generator: torch.Generator, mode: str, mean: float, std: float, shift: float, expert: str, boundary: float
) -> float:
    """One *shifted* sigma on ``expert``'s side of the pipeline's switch at ``boundary`` (its
    boundary_ratio): the flow distribution cut at the unshifted point that the shift carries onto b."""
    u_b = unshift_sigma(boundary, shift)
    lo, hi = (u_b, 1.0) if expert == "high" else (0.0, u_b)
    u = sample_sigmas_between(1, generator, mode, mean, std, lo, hi)
    sigma = shift_sigmas(u.double(), shift).float()  # (1,) float32, as the clip's timestep will be
    # the cut is exact in real numbers; a float32 rounding can still put 1000 * sigma a hair across b
    toward = torch.tensor(1.0 if expert == "high" else 0.0)
    for _ in range(64):
        if bool(on_expert_side(model_timesteps(sigma), expert, boundary).all()):
            return float(sigma)
        sigma = torch.nextafter(sigma, toward)
    raise AssertionError(f"no float32 sigma on the {expert} side of {boundary}")  # b in (0, 1) has one


# model.expert=both trains the two experts in one run. Each clip's expert is drawn first, with the
# probability that the flow distribution (shifted) puts on that expert's side, then its sigma on that
# side (sample_expert_sigma): the two steps compose to the unsplit distribution, so each expert sees
# exactly the sigmas a run of that expert alone draws. The draw is per clip, from (seed, step, dataset
# index) on a stream of its own, not per micro-batch: micro-batches are formed by the planner (or the
# one-process token packing) from the lengths, so a per-micro-batch draw would differ between one
# process and W ranks; a per-clip draw is the same everywhere, and the planner then packs each
# expert's clips apart, so every micro-batch still runs one expert.


def expert_share(mode: str, mean: float, std: float, shift: float, boundary: float) -> float:
    """P(the shifted sigma of one draw lies on the high expert's side of ``boundary``)."""
    u_b = unshift_sigma(boundary, shift)
    if mode == "uniform":
        lo, hi = 1e-5, 1 - 1e-5  # sample_sigmas' clamp
        return min(max((hi - u_b) / (hi - lo), 0.0), 1.0)
    if mode != "logit_normal":
        raise ValueError(f"flow.timestep_sampling={mode!r} is not supported; use 'logit_normal' or 'uniform'")
    z = torch.tensor(u_b, dtype=torch.float64).logit()
    return float(1.0 - torch.special.ndtr((z - mean) / std))


def expert_generator(seed: int, step: int, index: int) -> torch.Generator:
    """The expert draw's own stream (index -1 - i never names a clip, so it shares no clip's stream)."""
    return torch.Generator().manual_seed(((seed * 1_000_003 + step) * 1_000_033 - 1 - index) % (2**63 - 1))


def draw_expert(
    seed: int, step: int, index: int, mode: str, mean: float, std: float, shift: float, boundary: float
) -> str:
    """'high' or 'low' for clip ``index`` at ``step``: a pure function, the same on every rank."""
    r = float(torch.rand((), generator=expert_generator(seed, step, index), dtype=torch.float64))
    return "high" if r < expert_share(mode, mean, std, shift, boundary) else "low"
