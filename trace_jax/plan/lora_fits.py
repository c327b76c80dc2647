"""``python -m trace_jax.plan.lora_fits``: the LoRA fits table of docs/lora.md, one line per committed plan.

    python -m trace_jax.plan.lora_fits        # the table's rows, from docs/plans/ (rows of kind "fit")

Each line reads one plan that ``python -m trace_jax.plan.remake`` made from a registry row of kind ``fit``
(``remake.ROWS``): whether the update fits the slice, its layout, the per-chip peak by kind and the roofline
MFU (an upper bound: the largest of the compute, HBM and interconnect bounds of the compiled programs). A
cell the TPU compiler refused reports the peak it asked for. ``tests/plan/test_lora_plan.py`` fails when the
page's line differs from the committed plan's.
"""

from __future__ import annotations

import json
import os
from typing import Any

from trace_jax.plan.remake import PLAN_DIR, ROWS

HEADER = (
    "| model | slice | frozen base | fits | mesh | rows a call × calls an epoch | remat | per-chip peak / budget (GiB) "
    "| base / adapters + moments / temporaries (GiB) | roofline MFU | compiled in |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|"
)


def line(plan: dict[str, Any]) -> str:
    """The table's line for one ``fit`` plan."""
    entry = plan["train"]["fits"] or plan["train"]["tried"][-1]
    s, kinds = entry["settings"], entry["per_device_gib"]
    mesh = "×".join(f"{k} {v}" for k, v in entry["mesh"].items() if v > 1) or "1"
    base = f"{s['param_dtype']}" if s.get("lora_base_quant", "none") == "none" else s["lora_base_quant"]
    topology = plan["topology"]
    fits = "yes" if plan["train"]["fits"] else "no (compiler: out of HBM)" if entry.get("error") else "no"
    mfu = f"{plan['timing']['update']['mfu']:.1%}" if plan["train"]["fits"] else "–"
    trained = kinds.get("adapters", 0) + kinds["optimizer"]
    return (
        f"| {plan['model']} | {topology['name']} ({topology['chips']} × {topology['memory_gib']:g} GiB) "
        f"| {base} | {fits} | {mesh} | {s['micro_rows']} × {s['micro_batches']} | {s['remat']} "
        f"| {entry['peak_gib']:.2f} / {plan['budget_gib']:.2f} "
        f"| {kinds['weights']:.2f} / {trained:.2f} / {kinds['temporaries']:.2f} | {mfu} "
        f"| {entry['compile_seconds']:.0f} s |"
    )


def lines(plan_dir: str = PLAN_DIR) -> dict[str, str]:
    """Each committed ``fit`` plan's line, by row name, in the registry's order."""
    out = {}
    for row in ROWS.values():
        file = os.path.join(plan_dir, f"{row.name}.json")
        if row.kind == "fit" and os.path.exists(file):
            with open(file) as f:
                out[row.name] = line(json.load(f))
    return out


if __name__ == "__main__":
    print(HEADER)
    print("\n".join(lines().values()))
