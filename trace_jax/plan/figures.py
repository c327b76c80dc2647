"""The plan figures the docs quote, each computed from one committed plan: one figure per layout, one place.

    python -m trace_jax.plan.figures        # the rows of docs/benchmarks.md's plan table, from docs/plans/

Every figure is a row of ``FIGURES``: its anchor in docs/benchmarks.md (``fig-...``, which the README links
to), the registry row (``remake.ROWS``) whose plan it is read from, what it claims, and how it is read.
``tests/plan/test_remake.py`` fails when the page's figure differs from the committed plan's; a re-made plan
is followed by pasting this command's rows into the page.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

from trace_jax.plan.calibration import ANCHORS
from trace_jax.plan.remake import PLAN_DIR


@dataclasses.dataclass(frozen=True)
class Figure:
    anchor: str
    row: str
    claim: str
    read: Callable[[dict[str, Any]], str | None]  # None: not in this plan yet (its anchor not compiled)


def _pct(x: float) -> str:
    return f"{x:.1%}"


def _rate(x: float) -> str:
    return f"{x:,.0f} tokens/s"


def _update(plan: dict[str, Any]) -> dict[str, Any]:
    return plan["timing"]["update"]


def _bound(plan: dict[str, Any]) -> str:
    t = plan["timing"]["programs"]["update.accumulate"]
    return f"{t['bound']} ({t['compute_s']:.3f} / {t['memory_s']:.3f} / {t['communication_s']:.3f} s)"


def _layout(row: str, model: str, where: str) -> list[Figure]:
    """The figures of one RL layout: the update's bound, peak, roofline and calibrated MFU, decode's roofline and
    calibrated tokens/s, and the decode phase's share of the RL step."""
    key = f"fig-{model}-{where}"

    def calibrated(plan: dict[str, Any], part: str, text: Callable[[float], str]) -> str | None:
        found = plan["timing"]["calibrated"].get(part)  # absent until the part's anchor is compiled
        return None if found is None else text(found["calibrated_estimate"])

    return [
        Figure(f"{key}-update-bound", row, f"{model} update on {where}: bound of a micro-batch (compute / HBM / ICI)",
               _bound),
        Figure(f"{key}-update-peak", row, f"{model} update on {where}: peak a chip",
               lambda p: f"{p['train']['fits']['peak_gib']:.2f} GiB"),
        Figure(f"{key}-update-mfu", row, "that update's roofline MFU (upper bound)", lambda p: _pct(_update(p)["mfu"])),
        Figure(f"{key}-update-mfu-calibrated", row, "that update's calibrated MFU (roofline x MaxText's attained "
               "fraction; an estimate)", lambda p: calibrated(p, "update", _pct)),
        Figure(f"{key}-decode", row, f"{model} decode on {where}, 256 slots x 4,096: roofline (upper bound)",
               lambda p: _rate(p["timing"]["decode"]["tokens_per_s"])),
        Figure(f"{key}-decode-calibrated", row, "that decode, calibrated (roofline x sglang-jax's attained "
               "fraction; an estimate)", lambda p: calibrated(p, "decode", _rate)),
        Figure(f"{key}-rl-decode-share", row, "decode's share of the RL step (rooflines)",
               lambda p: _pct(p["timing"]["rl_step"]["share"]["decode"])),
    ]  # fmt: skip


def _anchor(name: str, label: str, anchor: str) -> list[Figure]:
    """An anchor's figures: our roofline for its work and the fraction of it the published run attained."""
    a = ANCHORS[name]
    text = _pct if a.program == "update" else _rate
    return [
        Figure(f"fig-{anchor}-roofline", a.row, f"our roofline for {label}", lambda p: text(_roofline(p, a.program))),
        Figure(f"fig-{anchor}-attained", a.row, "attained fraction: the published measurement ÷ that roofline",
               lambda p: f"{a.measured / _roofline(p, a.program):.3f}"),
    ]  # fmt: skip


def _roofline(plan: dict[str, Any], program: str) -> float:
    return plan["timing"]["update"]["mfu"] if program == "update" else plan["timing"]["decode"]["tokens_per_s"]


FIGURES: dict[str, Figure] = {
    f.anchor: f
    for f in (
        *_anchor("maxtext-llama3.1-8b-v6e", "MaxText's Llama 3.1 8B step (45.5% MFU measured)", "maxtext-llama3-8b"),
        *_anchor(
            "sglang-jax-qwen3-8b-v6e-4-c64",
            "sglang-jax's Qwen3-8B decode on v6e-4 at 64 (5,297 tokens/s)",
            "sglang-qwen3-8b-v6e-4-c64",
        ),
        *_anchor(
            "sglang-jax-qwen3-8b-v6e-4-c256",
            "sglang-jax's Qwen3-8B decode on v6e-4 at 256 (7,572 tokens/s)",
            "sglang-qwen3-8b-v6e-4-c256",
        ),
        *_layout("qwen3-8b_v5p-64", "qwen3-8b", "v5p-64"),
        *_layout("qwen3-8b_v6e-64", "qwen3-8b", "v6e-64"),
        *_layout("qwen3-30b-a3b_v5p-64", "qwen3-30b-a3b", "v5p-64"),
        *_layout("qwen3-32b_v5p-64", "qwen3-32b", "v5p-64"),
        *_layout("qwen3-235b-a22b_v5p-256", "qwen3-235b-a22b", "v5p-256"),
    )
}


def committed(plan_dir: str = PLAN_DIR) -> dict[str, dict[str, Any]]:
    """The committed plans of the rows ``FIGURES`` reads, by row (a row not yet made is absent)."""
    plans = {}
    for row in {f.row for f in FIGURES.values()}:
        path = os.path.join(plan_dir, f"{row}.json")
        if os.path.exists(path):
            with open(path) as f:
                plans[row] = json.load(f)
    return plans


def values(plan_dir: str = PLAN_DIR) -> dict[str, str]:
    """Each figure's value (anchor -> text) from the committed plans; figures of rows not made, and calibrated
    figures without their anchor, are left out."""
    plans = committed(plan_dir)
    found = {a: f.read(plans[f.row]) for a, f in FIGURES.items() if f.row in plans}
    return {a: v for a, v in found.items() if v is not None}


def main() -> None:
    found = values()
    for anchor, figure in FIGURES.items():
        if anchor in found:
            print(f'| <a id="{anchor}"></a>{figure.claim} (`{figure.row}`) | {found[anchor]} |')


if __name__ == "__main__":
    main()
