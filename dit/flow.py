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
