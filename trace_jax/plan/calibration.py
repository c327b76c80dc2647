"""Rooflines calibrated against measured anchors: the fraction of our roofline a published run attains.

A plan's predicted times are rooflines (``trace_jax.plan.timing``): upper bounds. An anchor is a published
measurement of a workload this planner can compile too (the same model shape, chip and work per chip); its
*attained fraction* is the measurement over our roofline for that very work. A plan's calibrated estimate of a
program is its roofline times the attained fraction of the anchor for that program's kind (the update's MFU, or
decode tokens/s at the nearest slots per chip): an estimate, never a measurement.

``python -m trace_jax.plan.remake`` compiles each anchor's own workload (a row of its registry) and writes the
fractions to ``CALIBRATION_FILE``, which every later plan reads.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

CALIBRATION_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration.json")


@dataclasses.dataclass(frozen=True)
class Anchor:
    """A published measurement and the registry row (``remake.ROWS``) that compiles the same work.

    ``program`` is "update" (``measured``: MFU, a fraction) or "decode" (``measured``: tokens/s of the whole
    slice)."""

    name: str
    row: str
    program: str
    measured: float
    source: str


ANCHORS: dict[str, Anchor] = {
    a.name: a
    for a in (
        Anchor(
            "maxtext-llama3.1-8b-v6e",
            "llama3.1-8b-shape_v6e-64_pretrain",
            "update",
            0.455,
            "MaxText's published MFU, Llama 3.1 8B on v6e-256, sequence 8,192, per-device batch 4 "
            "(AI-Hypercomputer/maxtext benchmarks/maxtext_trillium_model_configs.py, llama3_1_8b_8192)",
        ),
        Anchor(
            "sglang-jax-qwen3-8b-v6e-4-c64",
            "qwen3-8b_v6e-4_decode-64",
            "decode",
            5297.0,
            "sglang-jax's measured output throughput, Qwen3-8B on v6e-4, concurrency 64",
        ),
        Anchor(
            "sglang-jax-qwen3-8b-v6e-4-c256",
            "qwen3-8b_v6e-4_decode-256",
            "decode",
            7572.0,
            "sglang-jax's measured output throughput, Qwen3-8B on v6e-4, concurrency 256",
        ),
    )
}


def roofline(plan: dict[str, Any], program: str) -> float | None:
    """The roofline figure an anchor of ``program`` is compared with: the update's MFU or decode tokens/s."""
    timing = plan.get("timing") or {}
    if program == "update":
        return (timing.get("update") or {}).get("mfu")
    return (timing.get("decode") or {}).get("tokens_per_s")


def attained(anchor: Anchor, plan: dict[str, Any]) -> dict[str, Any]:
    """``anchor``'s attained fraction against ``plan`` (the anchor row's plan) and what it was computed from."""
    ours = roofline(plan, anchor.program)
    if not ours:
        raise ValueError(f"plan {anchor.row!r} has no {anchor.program} roofline to calibrate anchor {anchor.name!r}")
    decode = (plan.get("timing") or {}).get("decode") or {}
    return {
        "program": anchor.program,
        "measured": anchor.measured,
        "roofline": ours,
        "attained_fraction": anchor.measured / ours,
        "slots_per_chip": decode.get("slots", 0) / plan["topology"]["chips"] if anchor.program == "decode" else None,
        "chip": (plan.get("timing") or {}).get("chip"),
        "row": anchor.row,
        "source": anchor.source,
    }


def load(path: str = CALIBRATION_FILE) -> dict[str, Any]:
    """The attained fractions written by ``remake`` (anchor name -> ``attained(...)``); {} when none yet."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def calibrated(timing: dict[str, Any], chips: int, fractions: dict[str, Any]) -> dict[str, Any]:
    """For each program of ``timing`` (``predicted_times``) that an anchor calibrates: its roofline (an upper
    bound) and the roofline times the anchor's attained fraction (a calibrated estimate), with the anchor named.
    Decode takes the anchor whose slots per chip are nearest the plan's."""
    out: dict[str, Any] = {}
    figures = {"update": ("mfu", timing.get("update")), "decode": ("tokens_per_s", timing.get("decode"))}
    for program, (field, part) in figures.items():
        candidates = [(name, a) for name, a in fractions.items() if a["program"] == program]
        if not part or not candidates:
            continue
        if program == "decode":
            here = part["slots"] / chips
            name, anchor = min(candidates, key=lambda c: abs(c[1]["slots_per_chip"] - here))
        else:
            name, anchor = candidates[0]
        out[program] = {
            "figure": field,
            "upper_bound": part[field],
            "calibrated_estimate": part[field] * anchor["attained_fraction"],
            "attained_fraction": anchor["attained_fraction"],
            "anchor": name,
        }
    return out


# Model shapes of anchors that are no preset we serve (ModelConfig fields; dtypes and attention come from the
# plan's options). Llama 3.1 8B: a dense decoder without q/k norms or q/k/v biases.
ANCHOR_MODELS: dict[str, dict[str, Any]] = {
    "llama3.1-8b-shape": {
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_layers": 32,
        "num_heads": 32,
        "num_kv_heads": 8,
        "head_dim": 128,
        "rope_theta": 5e5,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "qkv_bias": False,
        "qk_norm": False,
        "max_position_embeddings": 131072,
    },
}
