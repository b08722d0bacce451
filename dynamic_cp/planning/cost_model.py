"""Analytic time and memory model of one packed micro-batch of a video DiT under context parallelism.

Every plan (ours, static CP, Megatron's) is scored by this one model, so comparisons are like for like.

Time of a packed micro-batch of clips with lengths L_i on a CP group of c ranks, training (fwd+bwd),
per rank, with N = sum L_i, n = N / c tokens per rank, d width, f FFN width, T cross-attention
context tokens (text, plus image tokens for Wan I2V, whose add_k/add_v projections and attention cost
what text k/v and text attention cost per token):

    linear      3 * (layers * (12 d^2 + 4 d f) + 2 d p) * n  / (peak * eff_gemm(n))   p: patch values in + out
    text k/v    3 * layers * 4 T d^2 * b                     / (peak * eff_gemm(T b))  every rank needs it
    attention   3.5 * layers * 4 d (L_i^2 + L_i T) / c       / (peak * eff_attn(L_i / c))   per clip, summed
    comm        Ulysses all-to-alls (8 per layer per step) over u ranks, ring K/V passes over r = c / u
                ranks hidden behind attention where it can; u dividing both c and the head count
                (the cheapest split is taken); bandwidth drops ~10x once a group spans nodes
    overhead    a fixed cost per micro-batch (launches, routing, loss bookkeeping), plus one per clip
                (kernel calls that scale with the clip count: zero with flash-attn varlen on GPU, one
                SDPA call per clip on CPU)

Efficiencies fall for small per-rank work: eff(n) = best * n / (n + half), so packing short clips into
one micro-batch is cheaper than running them one by one. FLOP constants follow DESIGN.md: linear
training = 3x forward, attention backward = 2.5x forward, bidirectional (no causal halving).

Sampling (``forward_only=True``, ``CostModel.forward()``): the same terms for one forward pass: linear
and attention FLOPs at their forward counts (factors 1), 4 Ulysses all-to-alls per layer instead of
8, one ring pass of K/V instead of three, and a third of the fwd+bwd overheads (forward is about a
third of a training step's work).

Memory lives in ``memory.py``; ``token_cap`` and ``activation_bytes_per_token`` ask it. The hardware
profiles are ``hardware.py``, the model shapes ``model_dims.py``.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from dit.flops import attention_flops, linear_flops_per_token, patch_flops_per_token, text_kv_flops
from dynamic_cp.planning import memory
from dynamic_cp.planning.hardware import Hardware
from dynamic_cp.planning.memory import BYTES_BF16
from dynamic_cp.planning.model_dims import MODELS, ModelDims

# Training multipliers (forward + backward over forward), see DESIGN.md "Costs".
LINEAR_TRAIN = 3.0
ATTN_TRAIN = 3.5


class CostModel:
    """Seconds per packed micro-batch and tokens per rank; see the module docstring for the formulas."""

    def __init__(self, dims: ModelDims, hardware: Hardware, comm: str = "auto", forward_only: bool = False):
        if comm not in ("auto", "ulysses", "ring"):
            raise ValueError(f"comm={comm!r}; use 'auto', 'ulysses' or 'ring'")
        self.dims, self.hw, self.comm = dims, hardware, comm
        self.forward_only = forward_only
        lin, attn = (1.0, 1.0) if forward_only else (LINEAR_TRAIN, ATTN_TRAIN)
        # all-to-alls per layer (q, k, v, out; backward as many again), ring K/V passes (backward 2
        # more), and the share of the fwd+bwd overheads a pass pays
        self._ulysses_calls, self._ring_passes = (4, 1) if forward_only else (8, 3)
        self._overhead_share = 1 / LINEAR_TRAIN if forward_only else 1.0
        d, f, T, layers = dims.d, dims.ffn, dims.context_tokens, dims.layers
        patch = patch_flops_per_token(d, dims.patch_values)  # once per token, not per layer
        self._lin_per_token = lin * (layers * linear_flops_per_token(d, f) + patch)
        self._text_per_clip = lin * layers * text_kv_flops(T, d)
        self._attn_coef = attn * layers * attention_flops(1, d)  # times (L^2 + L T)

    def forward(self) -> CostModel:
        """This model priced for forward passes only (sampling): see the module docstring."""
        return CostModel(self.dims, self.hw, self.comm, forward_only=True)

    @classmethod
    def from_dims(
        cls,
        d: int,
        layers: int,
        ffn: int,
        heads: int,
        text_tokens: int = 512,
        hardware: str | Hardware = "h100",
        comm: str = "auto",
    ) -> CostModel:
        hw = hardware if isinstance(hardware, Hardware) else Hardware.load(hardware)
        return cls(ModelDims(d, layers, ffn, heads, text_tokens), hw, comm)

    @classmethod
    def from_name(cls, model: str, hardware: str | Hardware = "h100", comm: str = "auto") -> CostModel:
        if model not in MODELS:
            raise ValueError(f"unknown model {model!r}; use one of {sorted(MODELS)}")
        hw = hardware if isinstance(hardware, Hardware) else Hardware.load(hardware)
        return cls(MODELS[model], hw, comm)

    # ---------------------------------------------------------------- efficiencies
    def _gemm_rate(self, n):
        hw = self.hw
        return hw.peak_flops * hw.gemm_efficiency * n / (n + hw.gemm_half_tokens)

    def _attn_rate(self, q):
        hw = self.hw
        return hw.peak_flops * hw.attention_efficiency * q / (q + hw.attention_half_tokens)

    def _text_time(self, clips):
        """Seconds of the text k/v projections of ``clips`` clips: GEMMs over their T * clips text
        tokens (not the n video tokens); none for a model without text (T = 0, where the rate is 0)."""
        T = self.dims.context_tokens
        return self._text_per_clip * clips / self._gemm_rate(T * clips) if T > 0 else 0.0

    def _attn_time(self, L, cp):
        """Attention seconds per rank of clips of ``L`` tokens split over ``cp`` ranks (broadcasts)."""
        return self._attn_coef * (L * L + L * self.dims.context_tokens) / cp / self._attn_rate(L / cp)

    # ---------------------------------------------------------------- communication
    def cp_layout(self, cp: int) -> list[tuple[int, int]]:
        """(ulysses, ring) degree pairs the comm setting allows for a CP size; ulysses * ring = cp."""
        if cp <= 1:
            return [(1, 1)]
        if self.comm == "ring":
            return [(1, cp)]
        # Ulysses splits heads, so its degree must divide the head count.
        us = [u for u in range(1, cp + 1) if cp % u == 0 and self.dims.heads % u == 0]
        if self.comm == "ulysses":
            if cp not in us:
                raise ValueError(
                    f"Ulysses CP size {cp} does not divide heads={self.dims.heads}; use comm='auto' or 'ring'"
                )
            return [(cp, 1)]
        return [(u, cp // u) for u in us]

    def _layout_times(self, tokens, cp: int, attn_s, cross_node: bool | None, latency_share=1.0):
        """(layouts, times): ``cp_layout(cp)`` and each one's exposed communication seconds per rank,
        shape (len(layouts), *tokens.shape), for micro-batches of ``tokens`` on ``cp`` ranks (cp > 1).

        Array-friendly: ``tokens``, ``attn_s`` (attention seconds the ring can hide behind) and
        ``latency_share`` (fraction of the per-call latency charged) broadcast together.
        """
        tokens = np.asarray(tokens, dtype=np.float64)
        hw, d, layers = self.hw, self.dims.d, self.dims.layers
        per_rank = tokens / cp
        layouts = self.cp_layout(cp)
        times = []
        for u, r in layouts:
            t = np.zeros_like(tokens)
            if u > 1:
                # Ulysses groups are contiguous ranks, so they stay in a node unless u itself spans nodes.
                far = u > hw.gpus_per_node or (cross_node is True and r == 1)
                bw = hw.inter_node_bandwidth if far else hw.intra_node_bandwidth
                lat = hw.inter_node_latency_s if far else hw.intra_node_latency_s
                t = t + self._ulysses_calls * layers * (
                    lat * latency_share + per_rank * d * BYTES_BF16 * (u - 1) / u / bw
                )
            if r > 1:
                far = cp > hw.gpus_per_node if cross_node is None else cross_node
                bw = hw.inter_node_bandwidth if far else hw.intra_node_bandwidth
                lat = hw.inter_node_latency_s if far else hw.intra_node_latency_s
                # Each step passes K and V of this rank's share (after Ulysses): 2 * 2 bytes * n * d/u * u;
                # backward passes K, V and their grads again: 3x the forward volume.
                ring = self._ring_passes * layers * (r - 1) * (lat * latency_share + 4 * per_rank * d / bw)
                t = t + np.maximum(ring - attn_s, 0.0)  # ring overlaps with attention compute
            times.append(t)
        return layouts, np.stack(times)

    def _comm_time(self, tokens, cp: int, attn_s, cross_node: bool | None, latency_share=1.0):
        """Exposed communication seconds per rank: the cheapest layout's (see ``_layout_times``)."""
        if cp <= 1:
            return np.zeros_like(np.asarray(tokens, dtype=np.float64))
        return self._layout_times(tokens, cp, attn_s, cross_node, latency_share)[1].min(axis=0)

    def layout(self, lengths, cp: int, cross_node: bool | None = None) -> tuple[int, int]:
        """(ulysses, ring) split that ``micro_batch_time`` charges for the packed micro-batch
        ``lengths`` on ``cp`` ranks: the cheapest, ties going to the larger Ulysses degree.

        The runtime runs this split, so what the planner prices is what executes.
        """
        if cp <= 1:
            return (1, 1)
        L = np.asarray(lengths, dtype=np.float64)
        layouts, times = self._layout_times(L.sum(), cp, self._attn_time(L, cp).sum(), cross_node)
        # argmin keeps the first of equal minima; cp_layout lists u ascending, so search from the end
        return layouts[len(layouts) - 1 - int(np.argmin(times[::-1]))]

    # ---------------------------------------------------------------- time
    def micro_batch_time(self, lengths, cp: int, cross_node: bool | None = None) -> float:
        """Seconds for one training step (fwd+bwd) of the packed micro-batch ``lengths`` on ``cp`` ranks.

        ``cross_node=None`` infers it: an aligned group spans nodes exactly when cp > gpus_per_node.
        """
        if cp < 1:
            raise ValueError(f"cp={cp} must be at least 1")
        if len(lengths) == 0:
            return 0.0
        return float(self.micro_batch_times([lengths], [cp], [cross_node])[0])

    def micro_batch_times(self, batches, cps, cross_nodes=None) -> np.ndarray:
        """``micro_batch_time`` for many micro-batches at once (vectorized; the simulator's hot path).

        batches: list of length lists; cps: CP size of each; cross_nodes: None or a bool/None each.
        """
        counts = np.fromiter((len(b) for b in batches), dtype=np.int64, count=len(batches))
        flat = np.concatenate([np.asarray(b, dtype=np.float64) for b in batches]) if batches else np.zeros(0)
        return self.flat_micro_batch_times(flat, counts, cps, cross_nodes)

    def flat_micro_batch_times(self, flat_lengths, counts, cps, cross_nodes=None) -> np.ndarray:
        """Same as ``micro_batch_times`` with the batches concatenated: ``counts[i]`` lengths each."""
        counts = np.asarray(counts, dtype=np.int64)
        out = np.zeros(counts.size)
        nonempty = counts > 0
        if not nonempty.any():
            return out
        L = np.asarray(flat_lengths, dtype=np.float64)
        cp = np.asarray(cps, dtype=np.float64)
        sel = np.flatnonzero(nonempty)
        starts = (np.cumsum(counts) - counts)[sel]
        cp_el = np.repeat(cp, counts)
        attn_el = self._attn_time(L, cp_el)
        attn = np.add.reduceat(attn_el, starts)
        tokens = np.add.reduceat(L, starts)
        n = tokens / cp[sel]
        b = counts[sel]
        lin = self._lin_per_token * n / self._gemm_rate(n) + self._text_time(b)
        comm = np.zeros(sel.size)
        cross = [None] * counts.size if cross_nodes is None else list(cross_nodes)
        keys: dict = {}
        for j, i in enumerate(sel.tolist()):
            if cps[i] > 1:
                keys.setdefault((int(cps[i]), cross[i]), []).append(j)
        for (c, x), idx in keys.items():
            idx = np.asarray(idx)
            comm[idx] = self._comm_time(tokens[idx], c, attn[idx], x)
        overhead = (self.hw.micro_batch_overhead_s + self.hw.clip_overhead_s * b) * self._overhead_share
        out[sel] = overhead + lin + attn + comm
        return out

    def sample_times(self, lengths, cp: int, packed_tokens: float) -> np.ndarray:
        """Per-clip share of a micro-batch's time, for clips packed into micro-batches holding about
        ``packed_tokens`` tokens per rank: additive, so a solver can balance sums of them.

        Overhead and collective latencies are charged in proportion to the clip's share of the pack.
        """
        L = np.asarray(lengths, dtype=np.float64)
        n = max(float(packed_tokens), 1.0)
        share = np.minimum((L / cp) / n, 1.0)
        rate = self._gemm_rate(np.maximum(n, L / cp))
        lin = self._lin_per_token * L / cp / rate + self._text_time(1)
        attn = self._attn_time(L, cp)
        comm = self._comm_time(L, cp, attn, None, latency_share=share)
        overhead = (self.hw.micro_batch_overhead_s * share + self.hw.clip_overhead_s) * self._overhead_share
        return overhead + lin + attn + comm

    def ideal_time(self, lengths) -> np.ndarray:
        """Per-clip seconds at best efficiency, no communication, no overhead: the lower bound's unit."""
        L = np.asarray(lengths, dtype=np.float64)
        hw = self.hw
        lin = (self._lin_per_token * L + self._text_per_clip) / (hw.peak_flops * hw.gemm_efficiency)
        attn = (
            self._attn_coef
            * (L * L + L * self.dims.context_tokens)
            / (hw.peak_flops * hw.attention_efficiency)
        )
        return lin + attn

    # ---------------------------------------------------------------- learning
    def fit(self, observations, prior: CostModel | None = None) -> CostModel:
        """A cost model whose hardware terms best explain measured micro-batches
        (``cost_fit.Observation``: lengths, CP size, layout, node span, seconds, comm seconds).

        Robust and bounded (Huber on relative error, non-negative bounded least squares), fitted
        term by term of this model: per-micro-batch and per-clip overheads, GEMM and attention rates
        and their knees, latency and bandwidth inside and across nodes. A term the observations do
        not determine keeps ``prior``'s value (default: this model's). Deterministic. See
        ``dynamic_cp/planning/cost_fit.py``.
        """
        from dynamic_cp.planning.cost_fit import Shape, Terms, fit_terms

        base = prior if prior is not None else self
        hw = base.hw
        shape = Shape(
            self.dims.d,
            self.dims.layers,
            self.dims.context_tokens,
            self._lin_per_token,
            self._text_per_clip,
            self._attn_coef,
            hw.gpus_per_node,
        )
        t = fit_terms(
            list(observations),
            shape,
            Terms(
                overhead=hw.micro_batch_overhead_s,
                clip_overhead=hw.clip_overhead_s,
                inv_gemm=1.0 / (hw.peak_flops * hw.gemm_efficiency),
                inv_attn=1.0 / (hw.peak_flops * hw.attention_efficiency),
                gemm_half=hw.gemm_half_tokens,
                attn_half=hw.attention_half_tokens,
                intra_latency=hw.intra_node_latency_s,
                intra_inv_bw=1.0 / hw.intra_node_bandwidth,
                inter_latency=hw.inter_node_latency_s,
                inter_inv_bw=1.0 / hw.inter_node_bandwidth,
            ),
        )
        gemm, attn = 1.0 / t.inv_gemm, 1.0 / t.inv_attn
        peak = max(hw.peak_flops, gemm, attn)  # efficiencies stay fractions of a peak
        learned = replace(
            hw,
            name=hw.name if hw.name.startswith("learned-") else f"learned-{hw.name}",
            peak_flops=peak,
            gemm_efficiency=gemm / peak,
            gemm_half_tokens=t.gemm_half,
            attention_efficiency=attn / peak,
            attention_half_tokens=t.attn_half,
            intra_node_bandwidth=1.0 / t.intra_inv_bw,
            inter_node_bandwidth=1.0 / t.inter_inv_bw,
            intra_node_latency_s=t.intra_latency,
            inter_node_latency_s=t.inter_latency,
            micro_batch_overhead_s=t.overhead,
            clip_overhead_s=t.clip_overhead,
        )
        return CostModel(self.dims, learned, self.comm, self.forward_only)

    def scaled(self, factor: float) -> CostModel:
        """This cluster running ``factor`` times slower: every time this model gives, times ``factor``
        (the rates divide by it, latencies and overheads multiply), the efficiency curves unchanged."""
        if not factor > 0:
            raise ValueError(f"scale factor {factor!r} must be positive")
        hw = self.hw
        slower = replace(
            hw,
            peak_flops=hw.peak_flops / factor,
            intra_node_bandwidth=hw.intra_node_bandwidth / factor,
            inter_node_bandwidth=hw.inter_node_bandwidth / factor,
            intra_node_latency_s=hw.intra_node_latency_s * factor,
            inter_node_latency_s=hw.inter_node_latency_s * factor,
            micro_batch_overhead_s=hw.micro_batch_overhead_s * factor,
            clip_overhead_s=hw.clip_overhead_s * factor,
            vae_decode_s_per_pixel=hw.vae_decode_s_per_pixel * factor,
        )
        return CostModel(self.dims, slower, self.comm, self.forward_only)

    # ---------------------------------------------------------------- memory
    def activation_bytes_per_token(self, activation_checkpointing: bool = False) -> float:
        """Bytes of saved activations per token for the whole network (``memory.activation_bytes_per_token``)."""
        return memory.activation_bytes_per_token(self.dims, activation_checkpointing)

    def token_cap(
        self,
        shard_world: int = 1,
        activation_checkpointing: bool = False,
        memory_fraction: float = 0.9,
    ) -> int:
        """Most tokens one rank can hold in a micro-batch on this hardware (``memory.planning_token_cap``)."""
        return memory.planning_token_cap(
            self.dims, self.hw.memory_bytes, shard_world, activation_checkpointing, memory_fraction
        )
