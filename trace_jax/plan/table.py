"""The "will it fit" table: the planner over several models and topologies in one process.

    python -m trace_jax.plan.table --models qwen3-0.6b,qwen3-8b --topologies v5e-64,v5p-64,v6e-64 \\
        --rows 256 --seq-len 4096 --out bench_results/will_it_fit.json

Topologies with the same chip count (v5e-64 and v6e-64: 64 chips) share compiled candidates, which differ
only in the memory they are checked against. Prints a markdown table; writes every plan as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from trace_jax.plan.__main__ import Planner, add_arguments, plan_one
from trace_jax.plan.topology import parse_topology


def _cell(part: dict[str, Any]) -> str:
    chosen = part["fits"]
    if chosen is None:
        return f"no ({len(part['tried'])} compiled)"
    mesh = "x".join(f"{k}{v}" for k, v in chosen["mesh"].items() if v > 1)
    s = chosen["settings"]
    what = f", micro {s['micro_batches']}, remat {s['remat']}" if chosen["program"] == "update" else ""
    fit = chosen.get("slots_per_chip")
    more = f"; {fit['fit']} slots a chip fit" if fit else ""
    return f"yes: {mesh}{what}, {chosen['peak_gib']:.1f} GiB{more}"


def settle(plans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Where a plan found nothing within its compile limit, takes the first candidate compiled for the same
    model and chip count (in any topology's search; search order = preference) whose peak fits this budget."""
    for part in ("train", "engine"):
        for p in plans:
            if p[part]["fits"] is not None:
                continue
            pool = [
                e
                for q in plans
                if q["model"] == p["model"] and q["topology"]["chips"] == p["topology"]["chips"]
                for e in q[part]["tried"]
            ]
            fitting = [e for e in pool if e["peak_gib"] <= p["budget_gib"]]
            if fitting:
                p[part]["fits"] = {**fitting[0], "fits": True, "from_other_topology": True}
    return plans


def markdown(plans: list[dict[str, Any]]) -> str:
    lines = [
        "| model | topology | chips x GiB | train step (256 x 4,096) | engine (256 slots x 4,096) |",
        "|---|---|---|---|---|",
    ]
    for p in plans:
        topo = p["topology"]
        lines.append(
            f"| {p['model']} | {topo['name']} | {topo['chips']} x {topo['memory_gib']:g} | {_cell(p['train'])} "
            f"| {_cell(p['engine'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="python -m trace_jax.plan.table", description=__doc__.split("\n")[0])
    parser.add_argument("--models", required=True, help="comma-separated presets")
    parser.add_argument("--topologies", required=True, help="comma-separated, e.g. v5e-64,v5p-64,v6e-64")
    parser.add_argument("--out", default="bench_results/will_it_fit.json")
    add_arguments(parser)
    args = parser.parse_args(argv)
    topologies = [parse_topology(t) for t in args.topologies.split(",")]
    chips = max(t.chips for t in topologies)
    plans = []
    for model in args.models.split(","):
        start = time.perf_counter()
        planner = Planner(argparse.Namespace(**{**vars(args), "model": model}), chips)
        for topology in topologies:
            plans.append({**plan_one(planner, topology, depth_check=False)})
        print(f"{model}: {planner.compiles} compiles in {time.perf_counter() - start:.0f}s", flush=True)
        if args.out:
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(plans, f, indent=2)
    print(markdown(settle(plans)))
    return plans


if __name__ == "__main__":
    main()
