"""The planner's view of several slices (``--slices N``): the chosen one-slice update layout compiled for N slices
joined over DCN, the bytes each optimizer step puts on DCN and their predicted time against the step's compute.
Each slice runs the same micro-batches as the one-slice plan (the job's ``micro_rows`` is that times N).

Each slice plans its share of the rows (the batch splits over the ``slice`` axis, parameters do not); the engine
samples on one slice's devices (each process's engine decodes its own trees), so it puts nothing on DCN.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trace_jax.plan.topology import Topology


def dcn_against_compute(
    wire_bytes: float, gbps: float, timing: dict[str, Any] | None, settings: dict[str, Any]
) -> dict[str, Any]:
    """An optimizer step's DCN bytes a chip (``wire_bytes``) at ``gbps`` a chip, against that step's predicted
    compute: the timing's ``optimizer_step_s`` covers one epoch (every mini-batch's micro-batches and apply), so an
    optimizer step is that over ``settings["mini_batches"]``."""
    dcn_s = wire_bytes * 8 / (gbps * 1e9) if gbps else None
    epoch = ((timing or {}).get("update") or {}).get("optimizer_step_s")
    step = epoch / settings["mini_batches"] if epoch else None
    return {
        "predicted_dcn_s": dcn_s,
        "optimizer_step_compute_s": step,
        "dcn_over_compute": dcn_s / step if dcn_s and step else None,
    }


def dcn_plan(planner: Any, topology: Topology, slices: int, result: dict[str, Any]) -> dict[str, Any]:
    """``result["dcn"]``: the update of ``result``'s chosen train layout compiled on ``slices`` x ``topology``
    (its per-chip peak and DCN traffic per optimizer step, predicted at the family's stated DCN bandwidth)."""
    from trace_jax.parallel.mesh import make_mesh  # imports jax: only once the backend's device flags are set
    from trace_jax.plan import compile as plan_compile

    gbps = topology.family.dcn_gbps_per_chip
    out: dict[str, Any] = {"slices": slices, "dcn_gbps_per_chip": gbps, "engine": {"dcn_bytes": 0}}
    chosen = result["train"]["fits"]
    if chosen is None or planner.backend != "tpu":
        out["update"] = None  # needs a fitting layout and the TPU compiler (the cross-slice lowering is its own)
        return out
    args = planner.args
    devices = plan_compile.target_devices(topology, slices=slices)
    mesh = make_mesh(**{**chosen["mesh"], "slices": slices}, devices=devices)
    config = planner.config
    if chosen["settings"].get("remat"):
        config = dataclasses.replace(config, remat=chosen["settings"]["remat"])
    report = plan_compile.update_programs(
        config,
        mesh,
        chosen["settings"]["micro_rows"] * slices,  # UpdateConfig.micro_rows counts every slice's rows
        args.seq_len,
        args.logprob_chunk,
        update=planner.update_config(chosen["settings"].get("windowed_einsum", True)),
        rows=args.rows * slices,
    ).as_dict()
    programs = report["programs"]
    settings = chosen["settings"]
    calls = max(settings["micro_batches"], settings["mini_batches"]) / settings["mini_batches"]  # per step
    dcn = lambda name: (programs[name]["hlo"] or {}).get("dcn", {"bytes": 0.0, "wire_bytes": 0.0, "count": 0.0})
    per_step = {
        key: calls * dcn("accumulate")[key] + dcn("apply")[key] + dcn("zero")[key]
        for key in ("count", "bytes", "wire_bytes")
    }
    out["update"] = {
        "mesh": report["mesh"],
        "peak_gib": report["peak_gib"],
        "error": report.get("error"),
        "dcn_per_optimizer_step": per_step,
        "dcn_in_accumulate": dcn("accumulate"),
        **dcn_against_compute(per_step["wire_bytes"], gbps, result.get("timing"), settings),
    }
    return out
