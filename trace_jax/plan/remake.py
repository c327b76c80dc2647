"""``python -m trace_jax.plan.remake``: every committed plan (``docs/plans/<row>.json``) from one registry.

    python -m trace_jax.plan.remake                 # every row (hours of TPU compiles)
    python -m trace_jax.plan.remake --only qwen3-8b_v5p-64,qwen3-8b_v6e-64
    python -m trace_jax.plan.remake --list          # the rows and their commands
    python -m trace_jax.plan.remake --retime        # every row's times from its counts (no compile)

Each row is one ``python -m trace_jax.plan`` command that compiles every program its kind needs in the same
process, so the figures of a plan agree with each other: an ``rl`` row compiles the update and the engine and
splits one RL step into update, prefill and decode; a ``pretrain`` row compiles the update of a plain causal
step (one epoch, one mini-batch); a ``decode`` row compiles the engine. ``check`` refuses a plan its kind's
programs or phases are missing from. After a row that compiles a calibration anchor's workload
(``trace_jax.plan.calibration.ANCHORS``) the attained fractions are rewritten; once every row is made, each
committed plan's calibrated estimates are restamped with the current fractions.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import gzip
import json
import math
import os
import shlex
import time
from typing import Any

from trace_jax.plan import calibration, hlo
from trace_jax.plan.calibration import ANCHORS, CALIBRATION_FILE, attained
from trace_jax.plan.topology import parse_topology

PLAN_DIR = "docs/plans"
# Files in PLAN_DIR that another command writes (not the planner), with that command.
OTHER_FILES = {"host_time.json": "python -m trace_jax.bench.host_time --steps 2"}

_FIT = ("--no-depth-check", "--no-slots-fit")
_RL = ("--rows", "256", "--seq-len", "4096", "--slots", "256", *_FIT)


@dataclasses.dataclass(frozen=True)
class Row:
    """One committed plan: its file name (without ``.json``), kind (a key of ``KIND_CHECKS``) and the
    ``python -m trace_jax.plan`` arguments that make it."""

    name: str
    kind: str
    argv: tuple[str, ...]

    @property
    def command(self) -> str:
        return "python -m trace_jax.plan " + shlex.join(self.argv)


def _rl(model: str, topology: str, mesh: str, micro_rows: int, remat: str, *more: str) -> tuple[str, ...]:
    layout = ("--mesh", mesh, "--micro-rows", str(micro_rows), "--remat", remat)
    return ("--model", model, "--topology", topology, *_RL, *layout, *more)


def _lora_fit(
    model: str, topology: str, quant: str, mesh: str, micro_rows: int, remat: str, *more: str
) -> tuple[str, ...]:
    # An 8-chip slice's LoRA update (rank 64, every projection, a bf16 base): 256 rows x 4,096 tokens, the
    # update alone (the engine decodes base + adapters as a full-weight engine does).
    layout = ("--mesh", mesh, "--micro-rows", str(micro_rows), "--remat", remat, *more)
    adapters = ("--lora-rank", "64", "--lora-alpha", "128", *(("--lora-base-quant", quant) if quant != "none" else ()))
    return ("--model", model, "--topology", topology, "--rows", "256", "--seq-len", "4096", "--slots", "0",
            "--param-dtype", "bfloat16", *adapters, *layout, *_FIT)  # fmt: skip


def _lora_rows(model: str, quant: str, layouts: dict[str, tuple[Any, ...]]) -> tuple[Row, ...]:
    suffix = "lora" if quant == "none" else f"qlora-{quant}"
    return tuple(
        Row(f"{model}_{topology}_{suffix}", "fit", _lora_fit(model, topology, quant, *layout))
        for topology, layout in layouts.items()
    )


def _decode(slots: int) -> tuple[str, ...]:
    # sglang-jax's Qwen3-8B benchmark: one v6e-4 host, tensor parallel over its 4 chips.
    return ("--model", "qwen3-8b", "--topology", "v6e-4", "--rows", "0", "--slots", str(slots),
            "--engine-len", "2048", "--mesh", "data=1,fsdp=1,tensor=4", *_FIT)  # fmt: skip


# The fits table's layouts (mesh, rows a forward/backward call, remat), by slice: the planner's estimate's picks.
# v6e-8's are also compiled without windowed matmuls (HBM-bound windowed; the faster kept).
_BOTH_WAYS = ("--windowed-einsum", "auto")
_LORA_8B = {
    "v5e-8": ("data=1,fsdp=8,tensor=1", 8, "full"),
    "v6e-8": ("data=1,fsdp=8,tensor=1", 16, "full", *_BOTH_WAYS),
    "v5p-8": ("data=1,fsdp=4,tensor=1", 4, "none"),
}
_LORA_32B = {
    "v5e-8": ("data=1,fsdp=4,tensor=2", 4, "full"),  # fsdp 8 (8 rows a call) asks 16.57 GiB with an int8 base
    "v6e-8": ("data=1,fsdp=8,tensor=1", 8, "full", *_BOTH_WAYS),
    "v5p-8": ("data=1,fsdp=4,tensor=1", 8, "full"),
}

ROWS: dict[str, Row] = {
    r.name: r
    for r in (
        # The layouts the README and docs/benchmarks.md quote.
        Row(
            "qwen3-8b_v5p-64",
            "rl",
            _rl("qwen3-8b", "v5p-64", "data=1,fsdp=32,tensor=1", 32, "none", "--windowed-einsum", "auto"),
        ),
        Row("qwen3-8b_v6e-64", "rl", _rl("qwen3-8b", "v6e-64", "data=1,fsdp=64,tensor=1", 64, "full")),
        Row(
            "qwen3-30b-a3b_v5p-64",
            "rl",
            _rl(
                "qwen3-30b-a3b",
                "v5p-64",
                "data=1,fsdp=2,expert=16,tensor=1",
                128,  # 4 rows a chip: the gathered experts' bytes shared by 4x the tokens (compute-bound)
                "full",
                "--expert-dispatch",
                "gather",
                "--engine-expert-dispatch",
                "all_to_all",
            ),
        ),
        # Calibration anchors (calibration.ANCHORS): the published runs' own work per chip. MaxText's Llama 3.1
        # 8B step on v6e-256 (sequence 8,192, 4 rows a chip, fsdp over every chip) is compiled on v6e-64 with
        # the same per-chip work: 256 rows, fsdp 64.
        Row(
            "llama3.1-8b-shape_v6e-64_pretrain",
            "pretrain",
            (
                "--model",
                "llama3.1-8b-shape",
                "--topology",
                "v6e-64",
                "--rows",
                "256",
                "--seq-len",
                "8192",
                "--slots",
                "0",
                "--ppo-epochs",
                "1",
                "--mini-batches",
                "1",
                "--mesh",
                "data=1,fsdp=64,tensor=1",
                "--micro-rows",
                "256",
                "--remat",
                "full",
                *_FIT,
            ),
        ),
        Row("qwen3-8b_v6e-4_decode-64", "decode", _decode(64)),
        Row("qwen3-8b_v6e-4_decode-256", "decode", _decode(256)),
        # The int8 KV cache (EngineConfig.cache_dtype) beside the bf16 row above.
        Row("qwen3-8b_v6e-4_int8_decode-256", "decode", (*_decode(256), "--kv-dtype", "int8")),
        Row(
            "qwen3-32b_v5p-64",
            "rl",
            _rl("qwen3-32b", "v5p-64", "data=1,fsdp=32,tensor=1", 32, "full", "--windowed-einsum", "auto"),
        ),
        Row(
            "qwen3-235b-a22b_v5p-256",
            "rl",
            _rl(
                "qwen3-235b-a22b",
                "v5p-256",
                "data=1,fsdp=8,expert=16,tensor=1",
                128,
                "full",
                "--expert-dispatch",
                "gather",
                "--engine-expert-dispatch",
                "all_to_all",
            ),
        ),
        # The 8-chip LoRA fits table (docs/lora.md): each layout chosen by the planner's estimate.
        *_lora_rows("qwen3-8b", "none", _LORA_8B),
        *_lora_rows("qwen3-8b", "int8", _LORA_8B),
        *_lora_rows("qwen3-32b", "int8", _LORA_32B),
        *_lora_rows("qwen3-32b", "none", _LORA_32B),
    )
}


# ---------------------------------------------------------------------------------------------- checks
def _programs(plan: dict[str, Any], *parts: str) -> list[str]:
    return [f"no {part} program (the row's command must compile it)" for part in parts if not plan[part]["fits"]]


def _check_rl(plan: dict[str, Any]) -> list[str]:
    problems = _programs(plan, "train", "engine")
    phases = ((plan.get("timing") or {}).get("rl_step") or {}).get("phases_s", {})
    for phase in ("update", "prefill", "decode"):
        if not phases.get(phase):
            problems.append(f"the RL step has no {phase} phase (its split needs both programs in one command)")
    return problems


def _check_pretrain(plan: dict[str, Any]) -> list[str]:
    return _programs(plan, "train") + ([] if (plan.get("timing") or {}).get("update") else ["no update timing"])


def _check_decode(plan: dict[str, Any]) -> list[str]:
    return _programs(plan, "engine") + ([] if (plan.get("timing") or {}).get("decode") else ["no decode timing"])


def _check_fit(plan: dict[str, Any]) -> list[str]:
    """A fits-table cell: the update compiled (fitting or refused by the compiler, with its need), and timed
    when it fits."""
    if not plan["train"]["tried"]:
        return ["no update compiled (the row's command must compile it)"]
    return _check_pretrain(plan) if plan["train"]["fits"] else []


KIND_CHECKS = {"rl": _check_rl, "pretrain": _check_pretrain, "decode": _check_decode, "fit": _check_fit}


def check(plan: dict[str, Any], kind: str) -> list[str]:
    """What ``plan`` lacks for a row of ``kind`` (empty: it agrees with itself)."""
    return KIND_CHECKS[kind](plan)


# ------------------------------------------------------------------------------------------------ make
def make(row: Row, plan_dir: str = PLAN_DIR, hlo_dir: str | None = None) -> dict[str, Any]:
    """Runs ``row``'s command in this process, checks it, stamps it with its row and command, writes it; with
    ``hlo_dir``, every compiled program's HLO text also goes to ``hlo_dir/<row>`` (``--hlo-dir``)."""
    from trace_jax.plan.__main__ import main as plan_main  # imports jax once the backend's flags are set

    result = plan_main([*row.argv, *(("--hlo-dir", os.path.join(hlo_dir, row.name)) if hlo_dir else ())])
    problems = check(result, row.kind)
    if problems:
        raise SystemExit(f"row {row.name}: " + "; ".join(problems))
    result = {"row": row.name, "kind": row.kind, "command": row.command, **result}
    os.makedirs(plan_dir, exist_ok=True)
    with open(os.path.join(plan_dir, f"{row.name}.json"), "w") as f:
        json.dump(result, f, indent=2)
    return result


def recount(row: Row, hlo_dir: str, plan_dir: str = PLAN_DIR) -> dict[str, Any]:
    """Re-reads ``row``'s committed plan's programs from the HLO texts a ``--hlo-dir`` run kept
    (``hlo_dir/<row>/<program>_<digest>.hlo.txt.gz``) with the current ``trace_jax.plan.hlo``, and recomputes its
    predicted times: a fix to how a compiled program is counted, applied without compiling again. A program
    without its HLO text is an error naming it."""
    from trace_jax.plan.compile import hlo_name  # imports jax once the flags are set

    plan = _committed(row, plan_dir)
    train = plan["train"]["fits"] or {}
    programs = {hlo_name(name, train["settings"]): p for name, p in train.get("programs", {}).items()}
    if plan["engine"]["fits"] is not None:
        programs[plan["engine"]["fits"]["program"]] = plan["engine"]["fits"]
    for name, program in programs.items():
        found = sorted(glob.glob(os.path.join(hlo_dir, row.name, f"{name}_*.hlo.txt.gz")))
        if len(found) != 1:
            raise SystemExit(f"row {row.name}: {len(found)} HLO texts of program {name} in {hlo_dir}/{row.name}")
        mesh = plan["engine"]["fits"]["mesh"] if name == "generate" else plan["train"]["fits"]["mesh"]
        with gzip.open(found[0], "rt") as f:
            program["hlo"] = hlo.summarize(f.read(), math.prod(mesh.values())).as_dict()
    return retime(row, plan_dir, plan)


def retime(row: Row, plan_dir: str = PLAN_DIR, plan: dict[str, Any] | None = None) -> dict[str, Any]:
    """Recomputes ``row``'s committed plan's predicted times (``timing``) from the program counts it holds: a
    change to the step-time model or the model FLOP count, applied without compiling or reading HLO."""
    from trace_jax.plan.__main__ import Planner, build_parser, predicted_times  # imports jax once the flags are set

    plan = plan or _committed(row, plan_dir)
    args = build_parser().parse_args(list(row.argv))
    topology = parse_topology(args.topology)
    plan["timing"] = predicted_times(plan, Planner(args, topology.chips, topology).config, topology, args)
    with open(os.path.join(plan_dir, f"{row.name}.json"), "w") as f:
        json.dump(plan, f, indent=2)
    return plan


def _committed(row: Row, plan_dir: str) -> dict[str, Any]:
    with open(os.path.join(plan_dir, f"{row.name}.json")) as f:
        return json.load(f)


def write_calibration(plan_dir: str = PLAN_DIR, path: str = CALIBRATION_FILE) -> dict[str, Any]:
    """The attained fraction of every anchor whose row's plan is in ``plan_dir``, written to ``path``."""
    fractions = {}
    for name, anchor in ANCHORS.items():
        file = os.path.join(plan_dir, f"{anchor.row}.json")
        if os.path.exists(file):
            with open(file) as f:
                fractions[name] = attained(anchor, json.load(f))
    with open(path, "w") as f:
        json.dump(fractions, f, indent=2)
    return fractions


def restamp(plan_dir: str = PLAN_DIR) -> list[str]:
    """Re-applies the current attained fractions to every row's plan in ``plan_dir`` (no compile): its
    ``timing.calibrated``. Returns the rows restamped."""
    fractions, done = calibration.load(), []
    for row in ROWS.values():
        file = os.path.join(plan_dir, f"{row.name}.json")
        if not os.path.exists(file):
            continue
        with open(file) as f:
            plan = json.load(f)
        plan["timing"]["calibrated"] = calibration.calibrated(plan["timing"], plan["topology"]["chips"], fractions)
        with open(file, "w") as f:
            json.dump(plan, f, indent=2)
        done.append(row.name)
    return done


def ordered(names: list[str]) -> list[Row]:
    """The rows named, in that order (the calibrated estimates are restamped once all are made); an unknown
    name is an error that lists the rows."""
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        raise SystemExit(f"unknown plan row(s) {unknown}; rows: {', '.join(ROWS)}")
    return [ROWS[n] for n in names]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trace_jax.plan.remake", description=__doc__.split("\n")[0])
    parser.add_argument("--only", help="comma-separated rows (default: every row)")
    parser.add_argument("--out-dir", default=PLAN_DIR, help="where the plans are written")
    parser.add_argument("--hlo-dir", help="also write each row's compiled HLO texts under DIR/<row> (gzip)")
    parser.add_argument(
        "--recount",
        action="store_true",
        help="re-read each row's plan from the HLO texts in --hlo-dir, compile nothing",
    )
    parser.add_argument(
        "--retime",
        action="store_true",
        help="recompute each row's predicted times from the counts its plan holds, compile nothing",
    )
    parser.add_argument("--list", action="store_true", help="print the rows and their commands, compile nothing")
    parser.add_argument(
        "--calibrate-only", action="store_true", help="rewrite the fractions and restamp the plans, compile nothing"
    )
    args = parser.parse_args(argv)
    rows = ordered(args.only.split(",") if args.only else list(ROWS))
    if args.list:
        for row in rows:
            print(f"{row.name} [{row.kind}]: {row.command}")
        return
    if args.recount:
        if not args.hlo_dir:
            raise SystemExit("--recount reads the HLO texts of a --hlo-dir run: give --hlo-dir DIR")
        for row in rows:
            recount(row, args.hlo_dir, args.out_dir)
            print(f"recounted {row.name}", flush=True)
        write_calibration(args.out_dir)
        rows = []
    if args.retime:
        for row in rows:
            retime(row, args.out_dir)
            print(f"retimed {row.name}", flush=True)
        write_calibration(args.out_dir)
        rows = []
    if args.calibrate_only:
        write_calibration(args.out_dir)
        rows = []
    anchor_rows = {a.row for a in ANCHORS.values()}
    for row in rows:
        start = time.perf_counter()
        make(row, args.out_dir, args.hlo_dir)
        print(f"remade {row.name} in {time.perf_counter() - start:.0f}s", flush=True)
        if row.name in anchor_rows:
            write_calibration(args.out_dir)
    print(f"calibrated estimates restamped: {', '.join(restamp(args.out_dir))}")


if __name__ == "__main__":
    main()
