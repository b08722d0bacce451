"""A GPU type and its interconnect, as the cost model prices it: the built-in profiles and YAML files."""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields
from importlib import resources
from pathlib import Path

import yaml


@dataclass(frozen=True)
class Hardware:
    """One GPU type and its interconnect; loaded from dynamic_cp/planning/profiles/<name>.yaml or any path."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s
    gemm_efficiency: float  # best fraction of peak for large GEMMs
    gemm_half_tokens: float  # per-rank tokens where GEMM efficiency is half its best
    attention_efficiency: float  # best fraction of peak for long-sequence attention
    attention_half_tokens: float  # per-rank query tokens where attention efficiency is half its best
    intra_node_bandwidth: float  # all-to-all bytes/s per rank inside a node
    inter_node_bandwidth: float  # all-to-all bytes/s per rank when a group spans nodes
    intra_node_latency_s: float  # per collective call
    inter_node_latency_s: float
    gpus_per_node: int
    micro_batch_overhead_s: float  # fixed cost per micro-batch, fwd+bwd
    memory_bytes: float  # HBM per GPU
    # per clip in a micro-batch, fwd+bwd: calls that scale with the clip count (flash-attn varlen runs
    # all clips in one kernel, so 0 on GPU; CPU SDPA runs one call per clip). Optional in profiles.
    clip_overhead_s: float = 0.0
    # sampling only: seconds the rank that writes a clip spends in the VAE decode, per output pixel of
    # each frame (the decoder's convolutions run over the output volume). It runs on that one rank
    # while the rest of its group moves on (runtime/sampling.py), so a large group waits for it when
    # the next request needs all of it. Optional in profiles (0: decode not priced).
    vae_decode_s_per_pixel: float = 0.0

    def __post_init__(self):
        for f in fields(self):
            if f.name == "name":
                continue
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"hardware profile field {f.name}={v!r} must be a non-negative number")
        if not 0 < self.gemm_efficiency <= 1 or not 0 < self.attention_efficiency <= 1:
            raise ValueError("gemm_efficiency and attention_efficiency must be in (0, 1]")
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node={self.gpus_per_node} must be at least 1")

    @classmethod
    def load(cls, name_or_path: str) -> Hardware:
        """A built-in profile name (h100, h200, a100) or a path to a YAML file with the same keys."""
        path = Path(name_or_path)
        if path.suffix in (".yaml", ".yml") or path.exists():
            text = path.read_text()
        else:
            res = resources.files("dynamic_cp.planning") / "profiles" / f"{name_or_path}.yaml"
            if not res.is_file():
                raise ValueError(
                    f"unknown hardware profile {name_or_path!r}; use one of {builtin_profiles()} "
                    "or a path to a .yaml profile (see `python -m dynamic_cp.calibrate`)"
                )
            text = res.read_text()
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            at = f" at line {mark.line + 1}" if mark else ""
            raise ValueError(f"hardware profile {name_or_path!r} is not valid YAML{at}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"hardware profile {name_or_path!r} must be a mapping of Hardware fields")
        names = {f.name for f in fields(cls)}
        optional = {f.name for f in fields(cls) if f.default is not MISSING}
        missing = names - set(raw) - optional
        if missing:
            raise ValueError(f"hardware profile {name_or_path!r} lacks keys {sorted(missing)}")
        # PyYAML reads 989.0e12 (no exponent sign) as a string, hence the float().
        kw = {k: (raw[k] if k == "name" else float(raw[k])) for k in names if k in raw}
        kw["gpus_per_node"] = int(kw["gpus_per_node"])
        return cls(**kw)

    def to_yaml(self) -> str:
        plain = {
            k: v if isinstance(v, str) else (int(v) if k == "gpus_per_node" else float(v))
            for k, v in asdict(self).items()
        }
        return yaml.safe_dump(plain, sort_keys=False)


def builtin_profiles() -> list[str]:
    folder = resources.files("dynamic_cp.planning") / "profiles"
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))
