"""A step-time model from compiled programs: each program's time is the largest of three bounds.

* compute: the program's FLOPs per device (``hlo.summarize``: dots and convolutions, loops counted) over the
  chip's peak bf16 FLOP/s;
* memory: the bytes its kernels read and write in HBM per device over the chip's HBM bandwidth;
* communication: the bytes each device sends in its collectives (ring algorithms: an all-gather or
  reduce-scatter of B bytes over n devices sends B (n - 1) / n, an all-reduce twice that) over the chip's ICI
  bandwidth in one direction (half the bidirectional figure).

``time = max(compute, memory, communication)``: the bounds overlap perfectly (the best case). Left out:
kernel launch and step overheads, imperfect overlap of collectives with compute (XLA overlaps most FSDP
all-gathers with the previous layer, not all), MXU utilisation below peak for small or badly shaped matmuls,
host work between programs, and the ICI topology (a collective over a torus axis uses that axis's links only).
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    bf16_flops: float  # peak dense bf16 FLOP/s per chip
    hbm_bandwidth: float  # bytes/s per chip
    hbm_bytes: float
    ici_bandwidth: float  # bytes/s per chip, bidirectional (all ports, both directions)
    source: str


# Public figures per chip (Google Cloud TPU system-architecture pages, docs.cloud.google.com/tpu/docs/<gen>):
# v4 275 TFLOP/s bf16, HBM2 32 GiB at 1,200 GB/s; its ICI (not on that page) from the TPU v4 paper (Jouppi et
# al., ISCA 2023): 6 links of 50 GB/s each way, 600 GB/s bidirectional. v5e 197 TFLOP/s, 16 GB at 819 GB/s,
# ICI 400 GB/s bidirectional. v5p 459 TFLOP/s, 95 GiB at 2,765 GB/s, ICI 1,200 GB/s bidirectional (4,800 Gbps
# each way). v6e (Trillium) 918 TFLOP/s, 32 GB at 1,638 GB/s, ICI 800 GB/s bidirectional.
CHIPS: dict[str, Chip] = {
    c.name: c
    for c in (
        Chip("v4", 275e12, 1200e9, 32 * 2**30, 600e9, "cloud.google.com/tpu/docs/v4; TPU v4 paper (ICI)"),
        Chip("v5e", 197e12, 819e9, 16e9, 400e9, "cloud.google.com/tpu/docs/v5e"),
        Chip("v5p", 459e12, 2765e9, 95 * 2**30, 1200e9, "cloud.google.com/tpu/docs/v5p"),
        Chip("v6e", 918e12, 1638e9, 32e9, 800e9, "cloud.google.com/tpu/docs/v6e"),
    )
}


def program_time(summary: dict[str, Any], chip: Chip) -> dict[str, Any]:
    """Seconds of one run of a program (``hlo.HloSummary.as_dict()``) on ``chip``: the three bounds, the
    predicted time (their maximum) and which bound sets it."""
    bounds = {
        "compute_s": summary["flops"] / chip.bf16_flops,
        "memory_s": summary["bytes_accessed"] / chip.hbm_bandwidth,
        "communication_s": summary["wire_bytes"] / (chip.ici_bandwidth / 2),
    }
    bound = max(bounds, key=bounds.get)
    return {
        **bounds,
        "seconds": bounds[bound],
        "bound": bound.removesuffix("_s"),
        "unknown_loops": summary.get("unknown_loops", 0),
    }


def matmul_params(config: Any) -> float:
    """Parameters a token multiplies by: the active ones less the input embedding table when it is not tied to
    the LM head (a lookup, no FLOPs; a tied table is the head's weight and counts once). 0 without a count."""
    active = config.active_params() if hasattr(config, "active_params") else 0
    lookup = 0 if getattr(config, "tie_word_embeddings", True) else config.vocab_size * config.hidden_size
    return float(active - lookup)


def model_flops_per_token(config: Any, context: float) -> float:
    """Training FLOPs per token (forward + backward) by the usual count: 6 x the parameters it multiplies by
    (``matmul_params``) plus causal attention, 6 x layers x (query heads x head_dim) x context (2 matmuls x 3
    passes, half the keys)."""
    return 6.0 * matmul_params(config) + 6.0 * config.num_layers * config.num_heads * config.head_dim * context
