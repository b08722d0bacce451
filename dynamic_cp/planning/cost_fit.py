"""Fit the cost model's terms to measured micro-batch times: the maths behind ``CostModel.fit``.

The cost model (``cost_model.py``) is linear in its coefficients once the two efficiency knees
(``gemm_half_tokens``, ``attention_half_tokens``) are fixed:

    compute = overhead + clip_overhead * b + inv_gemm * G(h_g) + inv_attn * A(h_a)
    comm    = sum over links (intra, inter) of latency * calls + inv_bandwidth * bytes
              (Ulysses all-to-alls, exposed; ring passes minus the attention they hide behind)

with G and A the FLOPs weighted by the knee (n + h) / n. So the fit is
- per knee pair on a small grid around the prior, a robust bounded linear fit: Huber loss on the
  *relative* residual (a 2 ms micro-batch counts like a 2 s one), by iteratively reweighted
  non-negative least squares (``scipy.optimize.nnls``); coefficients are bounded
  (non-negative, inverse rates within 1e-6..1e6 of the prior);
- plus one weak row per coefficient pulling it to its prior, so a term the data do not determine
  (inter-node links on one node, a CP size never run) keeps its prior, while a determined one moves
  freely (the prior rows weigh 1e-3 of the data rows);
- compute terms are fitted to compute seconds, link terms to the measured collective seconds, so a
  communication term cannot soak up a compute error.

Deterministic: fixed grid, fixed iteration count, no randomness, inputs in observation order; the
same observations give bitwise the same terms on every rank (numpy/scipy on the same machine).
Pure numpy + scipy, no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np
from scipy.optimize import nnls

HUBER_DELTA = 0.05  # relative residual beyond which an observation counts linearly (stragglers, noise)
PRIOR_WEIGHT = 1e-6  # weight of each pull-to-prior row against one data row (only pins what data leave free)
IRLS_ITERATIONS = 6
KNEE_GRID = tuple(2.0 ** (k / 2) for k in range(-6, 7))  # multiples of the prior's knee (1/8 .. 8)
KNEE_IMPROVEMENT = 0.01
KNEE_REFINE = (2.0**0.25, 2.0**0.125)  # then finer steps around the best grid point
COMM_ROUNDS = 4  # alternations between the ring's hidden/shown rows and the link fit
RING_EXCESS = 0.1  # comm beyond the Ulysses part by this share of it: the ring showed  # a knee moves off the prior only if the loss drops by more than 1%


@dataclass(frozen=True)
class Observation:
    """One executed micro-batch: clip lengths, CP size, (ulysses, ring) layout, whether its ranks span
    nodes, and measured seconds per rank (fwd+bwd, from the group's start to its last member's end)
    of which ``comm_seconds`` were spent in the CP collectives."""

    lengths: tuple[int, ...]
    cp: int
    layout: tuple[int, int]
    cross_node: bool
    seconds: float
    comm_seconds: float = 0.0

    def __post_init__(self):
        if not self.lengths or self.cp < 1 or self.layout[0] * self.layout[1] != self.cp:
            raise ValueError(f"observation {self}: needs clips, cp >= 1 and ulysses * ring == cp")

    def to_dict(self) -> dict:
        return {**asdict(self), "lengths": list(self.lengths), "layout": list(self.layout)}

    @classmethod
    def from_dict(cls, d: dict) -> Observation:
        return cls(
            tuple(int(x) for x in d["lengths"]),
            int(d["cp"]),
            tuple(int(x) for x in d["layout"]),
            bool(d["cross_node"]),
            float(d["seconds"]),
            float(d.get("comm_seconds", 0.0)),
        )


@dataclass(frozen=True)
class Shape:
    """What the features need of the model: FLOP constants from ``CostModel`` and the node size."""

    d: int
    layers: int
    text_tokens: int
    lin_per_token: float  # training FLOPs per token of the linear layers
    text_per_clip: float  # training FLOPs of one clip's text k/v projections
    attn_coef: float  # training attention FLOPs per (L^2 + L T)
    gpus_per_node: int


@dataclass(frozen=True)
class Terms:
    """The cost model's coefficients, in the linear form the fit solves for."""

    overhead: float  # s per micro-batch
    clip_overhead: float  # s per clip
    inv_gemm: float  # s per GEMM FLOP at the best efficiency
    inv_attn: float  # s per attention FLOP at the best efficiency
    gemm_half: float  # tokens per rank at half GEMM efficiency
    attn_half: float  # query tokens per rank at half attention efficiency
    intra_latency: float  # s per collective call inside a node
    intra_inv_bw: float  # s per byte inside a node
    inter_latency: float
    inter_inv_bw: float


COMPUTE = ("overhead", "clip_overhead", "inv_gemm", "inv_attn")
COMM = ("intra_latency", "intra_inv_bw", "inter_latency", "inter_inv_bw")
POSITIVE = ("inv_gemm", "inv_attn", "intra_inv_bw", "inter_inv_bw")  # rates never reach 0 or infinity


# ------------------------------------------------------------------------------------ features


def compute_features(obs: list[Observation], shape: Shape, gemm_half: float, attn_half: float) -> np.ndarray:
    """(len(obs), 4) coefficients of COMPUTE terms, the cost model's formulas with the knees fixed."""
    T = float(shape.text_tokens)
    counts = np.array([len(o.lengths) for o in obs], dtype=np.int64)
    L = np.array([x for o in obs for x in o.lengths], dtype=np.float64)
    c = np.array([o.cp for o in obs], dtype=np.float64)
    starts = np.cumsum(counts) - counts
    b = counts.astype(np.float64)
    n = np.add.reduceat(L, starts) / c
    text = shape.text_per_clip * b * (T * b + gemm_half) / (T * b) if T > 0 else np.zeros_like(b)
    q = L / np.repeat(c, counts)
    per_clip = shape.attn_coef * (L * L + L * T) / np.repeat(c, counts) * (q + attn_half) / q
    attn = np.add.reduceat(per_clip, starts)
    return np.stack([np.ones_like(b), b, shape.lin_per_token * (n + gemm_half) + text, attn], axis=1)


def comm_features(obs: list[Observation], shape: Shape) -> tuple[np.ndarray, np.ndarray]:
    """(ulysses, ring): two (len(obs), 4) arrays of COMM-term coefficients. The ring part is exposed
    only beyond the attention it overlaps (``CostModel._layout_times``), handled by the caller."""
    uly, ring = np.zeros((len(obs), 4)), np.zeros((len(obs), 4))
    d, layers, gpn = shape.d, shape.layers, shape.gpus_per_node
    for i, o in enumerate(obs):
        u, r = o.layout
        per_rank = sum(o.lengths) / o.cp
        if u > 1:
            far = u > gpn or (o.cross_node and r == 1)
            j = 2 if far else 0
            uly[i, j] += 8 * layers
            uly[i, j + 1] += 8 * layers * per_rank * d * 2 * (u - 1) / u
        if r > 1:
            j = 2 if o.cross_node else 0
            ring[i, j] += 3 * layers * (r - 1)
            ring[i, j + 1] += 3 * layers * (r - 1) * 4 * per_rank * d
    return uly, ring


# ------------------------------------------------------------------------------------ the solver


def _robust_fit(A, y, prior, scale, lower, upper, denom=None) -> tuple[np.ndarray, float]:
    """Huber-IRLS bounded least squares on relative residuals with pull-to-prior rows.

    A: (m, k) features, y: (m,) seconds, prior/scale/lower/upper: (k,); residuals are relative to
    ``denom`` (default y). Returns (x, loss).
    """
    k = A.shape[1]
    rel = 1.0 / np.maximum(y if denom is None else denom, 1e-9)
    As = A * scale  # unknowns z = x / scale are O(1)
    z_prior = prior / scale
    lo, hi = lower / scale, upper / scale
    w = np.ones_like(y)
    reg = np.sqrt(PRIOR_WEIGHT * max(len(y), 1))
    # The pull is on the relative change, (z - z_prior) / max(z, 1): a term 1e4x off its prior (a
    # GPU profile on a CPU) must not pay 1e8x the penalty of a 2x one. z comes from the previous
    # pass; the first pass barely pulls at all (it only pins what the data leave free).
    pull = np.full(k, 1e-6)
    for _ in range(IRLS_ITERATIONS):
        sw = np.sqrt(w) * rel
        M = np.vstack([As * sw[:, None], np.diag(reg * pull)])
        b = np.concatenate([y * sw, reg * pull * z_prior])
        # z = lo + v with v >= 0: non-negative least squares; the (far) upper bound by clipping
        v, _ = nnls(M, b - M @ lo)
        z = np.minimum(lo + v, hi)
        pull = 1.0 / np.maximum(np.abs(z), 1.0)
        r = np.abs(As @ z - y) * rel
        w = np.where(r <= HUBER_DELTA, 1.0, HUBER_DELTA / np.maximum(r, 1e-30))
    r = np.abs(As @ z - y) * rel
    loss = float(np.where(r <= HUBER_DELTA, 0.5 * r * r, HUBER_DELTA * (r - 0.5 * HUBER_DELTA)).sum())
    return z * scale, loss


def _bounds(names, prior: Terms):
    p = np.array([getattr(prior, n) for n in names], dtype=np.float64)
    scale = np.where(p > 0, p, 1.0)
    lower = np.array([p[i] * 1e-6 if n in POSITIVE else 0.0 for i, n in enumerate(names)])
    upper = np.where(p > 0, p * 1e6, 1e6)
    return p, scale, lower, upper


def _data_scale(y: np.ndarray, feature: np.ndarray) -> float:
    """The scale of a term whose prior is 0: the median of seconds per unit of its feature over the
    rows that have some of it and measured some seconds (a row without the feature says nothing of
    its size: y / 0 would make the scale ~1e26 and the pull to the prior nothing); 1 without one."""
    rows = (feature > 0) & (y > 0)
    return float(np.median(y[rows] / feature[rows])) if rows.any() else 1.0


def _fit_compute(obs, shape: Shape, prior: Terms, gemm_half: float, attn_half: float):
    y = np.array([max(o.seconds - o.comm_seconds, 1e-9) for o in obs])
    p, scale, lower, upper = _bounds(COMPUTE, prior)
    # a zero prior (no per-clip cost on GPU profiles) gets the scale the data give it
    A = compute_features(obs, shape, gemm_half, attn_half)
    for j in range(4):
        if p[j] == 0 and A[:, j].any():
            scale[j] = _data_scale(y, A[:, j])
    return _robust_fit(A, y, p, scale, lower, upper)


def fit_terms(observations: list[Observation], shape: Shape, prior: Terms) -> Terms:
    """Terms that best explain ``observations`` (see the module docstring); ``prior`` where the data
    say nothing. Empty input returns the prior."""
    obs = [o for o in observations if o.seconds > 0]
    if not obs:
        return prior

    # Knees: coordinate search on a grid of multiples of the prior (0 included), GEMM then attention.
    def knees(base: float) -> list[float]:
        return [base] + ([0.0] if base > 0 else []) + [base * g for g in KNEE_GRID if g != 1.0 and base > 0]

    best = (prior.gemm_half, prior.attn_half)
    best_x, best_loss = _fit_compute(obs, shape, prior, *best)
    for axis in (0, 1):
        for h in knees((prior.gemm_half, prior.attn_half)[axis])[1:]:
            cand = (h, best[1]) if axis == 0 else (best[0], h)
            x, loss = _fit_compute(obs, shape, prior, *cand)
            if loss < best_loss * (1 - KNEE_IMPROVEMENT):
                best, best_x, best_loss = cand, x, loss
        for step in KNEE_REFINE if best[axis] > 0 else ():
            for f in (step, 1 / step):
                h = best[axis] * f
                cand = (h, best[1]) if axis == 0 else (best[0], h)
                x, loss = _fit_compute(obs, shape, prior, *cand)
                if loss < best_loss * (1 - KNEE_IMPROVEMENT / 10):
                    best, best_x, best_loss = cand, x, loss
    compute = dict(zip(COMPUTE, best_x.tolist()))
    out = replace(prior, gemm_half=best[0], attn_half=best[1], **compute)

    # Links: fitted to the measured collective seconds of CP > 1 micro-batches.
    multi = [o for o in obs if o.cp > 1]
    if not multi:
        return out
    uly, ring = comm_features(multi, shape)
    # attention each rank computes while the ring passes run (what the model lets the ring hide behind)
    attn = compute_features(multi, shape, out.gemm_half, out.attn_half)[:, 3] * out.inv_attn
    y = np.array([o.comm_seconds for o in multi])
    total = np.array([o.seconds for o in multi])
    has_ring = ring.any(axis=1)
    p, scale, lower, upper = _bounds(COMM, prior)
    for j in range(4):
        if p[j] == 0:
            scale[j] = _data_scale(y, (uly + ring)[:, j])
    x = p
    # The ring's exposed time max(ring - attention, 0) is linear where the ring shows, so alternate:
    # decide which rows show their ring under the current terms (or measure more than their
    # Ulysses part explains), fit those as ring + Ulysses = comm + attention and the rest as
    # Ulysses = comm. A ring fully hidden (no excess) bounds its cost but does not give it.
    for _ in range(COMM_ROUNDS):
        shows = has_ring & (y - uly @ x > RING_EXCESS * y)
        A = uly + np.where(shows[:, None], ring, 0.0)
        target = y + np.where(shows, attn, 0.0)
        keep = A.any(axis=1) & (target > 0)
        if not keep.any():
            return out
        # relative to the micro-batch's whole time: a comm error matters as much as it moves that
        x, _ = _robust_fit(A[keep], target[keep], p, scale, lower, upper, total[keep])
    return replace(out, **dict(zip(COMM, x.tolist())))
