"""Per-device memory of a mixture of experts' update with each expert dispatch, side by side.

    python -m trace_jax.bench.moe_dispatch [--rows 8] [--seq-len 512] [--remat none] [--out FILE]

Compiles ``RLTrainer.update``'s programs (``plan.compile.update_programs``, one micro-batch of ``--rows``
rows: XLA's ``memory_analysis()`` on fake CPU devices) for a scaled-down Qwen3-MoE (hidden 256, 16 experts,
top-4, expert width 128, 2 sparse layers, vocabulary 1,024; bf16 compute, fp32 weights) on 8 fake devices as
fsdp 2 x expert 4, once with ``expert_dispatch="gather"`` and once with ``"all_to_all"``, and prints the
per-device MiB of each part and the ratio of temporaries. Nothing runs: these are compile-time estimates
(XLA:CPU's schedule).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from trace_jax.bench.report import emit

DEVICES = 8
MIB = 2**20
MESH = {"data": 1, "fsdp": 2, "expert": 4, "tensor": 1}
DISPATCHES = ("gather", "all_to_all")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--remat", default="none")
    parser.add_argument("--out", default="bench_results/moe_dispatch.json")
    args = parser.parse_args(argv)
    if "jax" not in sys.modules:  # the fake device count is read when JAX starts
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={DEVICES}".strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # Imported here: JAX must start after XLA_FLAGS names the fake devices.
    import jax

    from trace_jax.models import ModelConfig
    from trace_jax.parallel.mesh import make_mesh
    from trace_jax.plan.compile import update_programs

    base = ModelConfig.preset(
        "qwen3-moe-tiny",
        hidden_size=256,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=128,
        num_layers=2,
        vocab_size=1024,
        dtype="bfloat16",
        param_dtype="float32",
        remat=args.remat,
    )
    mesh = make_mesh(**MESH, devices=jax.devices()[:DEVICES])
    result: dict = {"config": dataclasses.asdict(base), "mesh": MESH, "rows": args.rows, "seq_len": args.seq_len}
    for dispatch in DISPATCHES:
        config = dataclasses.replace(base, expert_dispatch=dispatch)
        report = update_programs(config, mesh, args.rows, args.seq_len)
        result[dispatch] = {
            "per_device_mib": {k: round(v / MIB, 1) for k, v in {**report.by_kind, "peak": report.peak}.items()},
            "temporaries_mib": round(report.temporaries / MIB, 1),
            "compile_seconds": round(report.compile_seconds, 1),
        }
    temporaries = [result[d]["temporaries_mib"] for d in DISPATCHES]
    result["temporaries_all_to_all_over_gather"] = round(temporaries[1] / temporaries[0], 3)
    return emit(result, args.out)


if __name__ == "__main__":
    main()
