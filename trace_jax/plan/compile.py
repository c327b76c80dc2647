"""Abstract train / decode state on a mesh, AOT compilation of the job's update and engine, memory by kind.

Nothing here allocates model-sized memory: parameters, optimizer state, batches and caches are
``jax.ShapeDtypeStruct`` with shardings (``nnx.eval_shape`` / ``jax.eval_shape``), and
``jit(...).lower(...).compile()`` runs XLA's SPMD partitioner for the mesh. ``memory_analysis()`` of the
compiled program is per device. The kinds reported:

* weights / optimizer / batch / kv_cache: the per-device bytes of those arguments (from their shard shapes);
  with LoRA adapters (``plan.lora``) weights is the frozen base and adapters the trained factors;
* gradients: the per-device bytes of one gradient accumulator (shaped as the trained part, inside the
  temporaries);
* temporaries: XLA's ``temp_size_in_bytes`` (activations, gradients, workspace);
* peak: arguments + temporaries + outputs that do not alias a donated argument.

The devices decide the compiler: a mesh over ``target_devices(topology)`` (abstract TPU devices from libtpu,
on any host) is compiled by the TPU compiler; a mesh over ``jax.devices()`` by the host's (XLA:CPU on fake
devices, a stand-in). Every report also carries ``hlo.summarize`` of the compiled program: its Mosaic
kernels, collectives, FLOPs and bytes, from which ``timing`` predicts its time.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import importlib.util
import math
import os
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trace_jax.models import ModelConfig, abstract_model, lora
from trace_jax.optim import make_optimizer, optimizer_shardings
from trace_jax.parallel import mesh as mesh_lib
from trace_jax.plan import hlo
from trace_jax.plan import lora as plan_lora
from trace_jax.plan.dcn import dcn_traffic
from trace_jax.plan.topology import Topology
from trace_jax.rl.batch import TrainBatch
from trace_jax.rl.losses import LossConfig
from trace_jax.rl.trainer import RLTrainer, TrainState, UpdateConfig
from trace_jax.rollout.engine import pages
from trace_jax.rollout.engine.engine import Engine, EngineConfig
from trace_jax.rollout.engine.layout import SamplingLayout

GIB = 1 << 30
HLO_DIR: str | None = None  # where set, every compiled program's HLO text is written there (gzip), to re-read


@dataclasses.dataclass
class MemoryReport:
    """Per-device bytes of one compiled program, by kind (see the module docstring)."""

    program: str
    mesh: dict[str, int]
    settings: dict[str, Any]
    by_kind: dict[str, int]
    temporaries: int
    peak: int
    compile_seconds: float
    platform: str = "cpu"  # the compiler's: "tpu" (libtpu) or the host's
    hlo: dict[str, Any] | None = None  # hlo.summarize(...).as_dict() of the compiled program
    programs: dict[str, Any] | None = None  # a report of several programs (update): each one's figures
    error: str | None = None  # the TPU compiler refused the program for the chip's HBM (temporaries: its need)

    def as_dict(self) -> dict[str, Any]:
        gib = lambda n: round(n / GIB, 3)
        out = {
            "program": self.program,
            "mesh": self.mesh,
            "settings": self.settings,
            "per_device_gib": {**{k: gib(v) for k, v in self.by_kind.items()}, "temporaries": gib(self.temporaries)},
            "peak_gib": gib(self.peak),
            "compile_seconds": round(self.compile_seconds, 1),
            "platform": self.platform,
        }
        if self.error is not None:
            out["error"] = self.error
        if self.hlo is not None:
            out["hlo"] = self.hlo
            out["kernels"] = self.hlo["kernels"]
        if self.programs is not None:
            out["programs"] = self.programs
            out["kernels"] = {k: v for p in self.programs.values() if p["hlo"] for k, v in p["hlo"]["kernels"].items()}
        return out


# ------------------------------------------------------------------------------------ target devices
def libtpu_available() -> bool:
    """Whether the TPU compiler (the ``libtpu`` package, ``pip install "jax[tpu]"``) is installed here."""
    return importlib.util.find_spec("libtpu") is not None


def target_devices(topology: Topology, slices: int = 1) -> list[Any]:
    """Abstract devices of a TPU slice, or of ``slices`` such slices joined over DCN (each device's
    ``slice_index`` says which) (``jax.experimental.topologies``, needs libtpu; no TPU needed): a mesh over them
    is compiled by the TPU compiler for that topology, on any host."""
    from jax.experimental import topologies  # answers only where libtpu is installed

    # Compiling only: several processes may load libtpu at once (it otherwise takes a lock for the chips).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    desc = topologies.get_topology_desc(platform="tpu", topology_name=topology.libtpu_name, num_slices=slices)
    return list(desc.devices)


def mesh_sizes(mesh: Mesh) -> dict[str, int]:
    """``mesh``'s axis sizes as ``make_mesh`` takes them back: the axes within a slice, and ``slices`` when more
    than one."""
    slices = mesh.shape.get(mesh_lib.SLICE_AXIS, 1)
    return {**({"slices": slices} if slices > 1 else {}), **{a: mesh.shape[a] for a in mesh_lib.MESH_AXES}}


def _platform(mesh: Mesh) -> str:
    return mesh.devices.flat[0].platform


def shard_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of sharded ``ShapeDtypeStruct`` / arrays (the largest shard shape)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
        total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
    return total


def _with_shardings(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def abstract_params(config: ModelConfig, mesh: Mesh) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's graph and its params as sharded ``ShapeDtypeStruct`` (logical-axis rules on ``mesh``)."""
    graphdef, params = abstract_model(config)
    return graphdef, _with_shardings(params, mesh_lib.state_shardings(params, mesh))


def _exhausted(error: Exception) -> int | None:
    """The bytes the TPU compiler said a program needs when it refused it for the chip's HBM, else None."""
    found = re.search(r"RESOURCE_EXHAUSTED.*?required for [^(]*\(([\d.]+)([KMGT])\)", str(error), re.DOTALL)
    if found is None:
        return None
    return int(float(found.group(1)) * 1024 ** "KMGT".index(found.group(2)) * 1024)


def hlo_name(program: str, settings: dict[str, Any]) -> str:
    """The name a program's HLO text is kept under (``HLO_DIR``): the program's, marked when it was compiled
    without windowed matmuls (``--windowed-einsum auto`` compiles the same program both ways)."""
    return program + ("-unwindowed" if settings.get("windowed_einsum") is False else "")


def _compiled_report(program, lowered, mesh: Mesh, settings: dict, by_kind: dict, start: float) -> MemoryReport:
    try:
        compiled = lowered.compile()
    except Exception as e:  # the TPU compiler refuses a program that cannot fit the chip's HBM
        needed = _exhausted(e)
        if needed is None:
            raise
        args = sum(v for k, v in by_kind.items() if k != "gradients")
        seconds = time.perf_counter() - start
        report = MemoryReport(
            program, mesh_sizes(mesh), settings, by_kind, needed, args + needed, seconds, _platform(mesh)
        )
        report.error = str(e).strip().splitlines()[0][:300]
        return report
    seconds = time.perf_counter() - start
    stats = compiled.memory_analysis()
    peak = (
        stats.argument_size_in_bytes
        + stats.temp_size_in_bytes
        + max(stats.output_size_in_bytes - stats.alias_size_in_bytes, 0)
    )
    text = compiled.as_text()
    if HLO_DIR:
        os.makedirs(HLO_DIR, exist_ok=True)
        digest = hashlib.sha1(text.encode()).hexdigest()[:12]
        with gzip.open(os.path.join(HLO_DIR, f"{hlo_name(program, settings)}_{digest}.hlo.txt.gz"), "wt") as f:
            f.write(text)
    summary = hlo.summarize(text, mesh.devices.size).as_dict()
    slices = mesh.shape.get(mesh_lib.SLICE_AXIS, 1)
    if slices > 1:  # what crosses slices over DCN, apart from the ICI collectives counted above
        summary["dcn"] = dcn_traffic(text, mesh.devices.size, slices).as_dict()
    return MemoryReport(
        program, mesh_sizes(mesh), settings, by_kind, stats.temp_size_in_bytes, peak, seconds, _platform(mesh), summary
    )


# -------------------------------------------------------------------------------------------- update
_FLOAT_FIELDS = ("weights", "advantages", "adv_pos", "adv_neg", "paths")  # and every "*logprob*" field
_ROW_FIELDS = ("lengths", "paths")  # [rows]; every other field is [rows, seq_len]


def abstract_batch(rows: int, seq_len: int, mesh: Mesh, with_ref: bool) -> TrainBatch:
    """A ``TrainBatch`` of ``ShapeDtypeStruct`` split over the batch axes: [rows] for per-row fields, else
    [rows, seq_len]; float32 for weights / advantages / log-probs / paths, int32 for ids and positions."""
    fields = {}
    for name in TrainBatch._fields:
        if (name == "ref_logprobs" and not with_ref) or name == "routing":  # routing: no replay record
            fields[name] = None
            continue
        shape = (rows,) if name in _ROW_FIELDS else (rows, seq_len)
        dtype = jnp.float32 if name in _FLOAT_FIELDS or "logprob" in name else jnp.int32
        fields[name] = jax.ShapeDtypeStruct(shape, dtype, sharding=mesh_lib.batch_sharding(mesh, len(shape)))
    return TrainBatch(**fields)


def abstract_train_state(config: ModelConfig, mesh: Mesh) -> tuple[nnx.GraphDef, TrainState, Any]:
    """``(graphdef, TrainState of sharded ShapeDtypeStruct, optimizer)``: AdamW as the job makes it; with
    adapters (``config.lora_rank``) on the adapters alone, the base frozen (``plan.lora.job_optimizer``)."""
    graphdef, params = abstract_params(config, mesh)
    optimizer = plan_lora.job_optimizer(make_optimizer(weight_decay=0.1), params)
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_state = _with_shardings(
        jax.eval_shape(optimizer.init, params),
        optimizer_shardings(optimizer, params, jax.tree.map(lambda x: x.sharding, params), replicated),
    )
    scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype, sharding=replicated)
    state = TrainState(params, opt_state, scalar(jnp.int32), scalar(jax.random.key(0).dtype), scalar(jnp.int32))
    return graphdef, state, optimizer


def update_programs(
    config: ModelConfig,
    mesh: Mesh,
    micro_rows: int,
    seq_len: int,
    logprob_chunk: int | None = 512,
    loss_config: LossConfig | None = None,
    update: UpdateConfig | None = None,
    rows: int | None = None,
) -> MemoryReport:
    """Compiles ``RLTrainer.update``'s own programs (``RLTrainer.lower_update``: zero, accumulate, apply) for
    micro-batches of ``micro_rows x seq_len`` on ``mesh``; per-device memory of the update as the job runs
    it: the peak of accumulate (the optimizer state stays resident beside its arguments) and of apply, and
    each program's figures and HLO summary under ``programs``. ``rows`` (the step's rows) is reported only."""
    loss_config = loss_config or LossConfig()
    update = dataclasses.replace(update or UpdateConfig(), micro_rows=micro_rows)
    graphdef, state, optimizer = abstract_train_state(config, mesh)
    trainer = RLTrainer(graphdef, optimizer, loss_config, mesh=mesh, update=update, logprob_chunk=logprob_chunk)
    micro = abstract_batch(micro_rows, seq_len, mesh, with_ref=bool(loss_config.kl_coef))
    start = time.perf_counter()
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        lowered = trainer.lower_update(state, micro)
    by_kind = {
        **{kind: shard_bytes(part) for kind, part in plan_lora.param_parts(state.params).items()},
        "optimizer": shard_bytes(state.opt_state),
        "gradients": shard_bytes(lora.trained_part(state.params)),
        "batch": shard_bytes(micro),
    }
    settings = {
        "rows": rows or micro_rows,
        "seq_len": seq_len,
        "micro_rows": micro_rows,
        "micro_batches": max((rows or micro_rows) // micro_rows, 1),
        "ppo_epochs": update.ppo_epochs,
        "mini_batches": update.mini_batches,
        "remat": config.remat,
        "windowed_einsum": update.windowed_einsum,
        "logprob_chunk": logprob_chunk,
        "param_dtype": config.param_dtype,
        "dtype": config.dtype,
        "expert_dispatch": getattr(config, "expert_dispatch", None),  # MoeConfig's; None for a dense model
        **plan_lora.settings(config),
    }
    programs, peaks, temps = {}, [], []
    for name, low in lowered.items():
        report = _compiled_report(name, low, mesh, settings, by_kind, time.perf_counter())
        resident = by_kind["optimizer"] if name == "accumulate" and not report.error else 0  # not an argument
        peaks.append(report.peak + resident)
        temps.append(report.temporaries)
        programs[name] = {
            "temporaries_gib": round(report.temporaries / GIB, 3),
            "peak_gib": round(report.peak / GIB, 3),
            "compile_seconds": round(report.compile_seconds, 1),
            "hlo": report.hlo,
        }
        if report.error:
            programs[name]["error"] = report.error
    seconds = time.perf_counter() - start
    errors = [p["error"] for p in programs.values() if "error" in p]
    report = MemoryReport(
        "update", mesh_sizes(mesh), settings, by_kind, max(temps), max(peaks), seconds, _platform(mesh), None, programs
    )
    report.error = errors[0] if errors else None
    return report


# --------------------------------------------------------------------------------------- engine
def generate_memory(
    config: ModelConfig,
    mesh: Mesh,
    slots: int,
    max_len: int,
    steps_per_call: int = 64,
    cache_dtype: str = "bfloat16",
    expert_dispatch: str = "",
) -> MemoryReport:
    """Compiles ``Engine.generate`` (the jitted decode loop) in the sampling layout for ``slots`` slots of
    ``max_len`` positions, at the widest cache window, and returns its per-device memory. ``expert_dispatch``:
    the engine's own (``EngineConfig.expert_dispatch``; "" the model's)."""
    engine_config = EngineConfig(
        max_slots=slots, max_len=max_len, steps_per_call=steps_per_call, cache_dtype=cache_dtype,
        weight_dtype=config.param_dtype, expert_dispatch=expert_dispatch,
    )  # fmt: skip
    layout = SamplingLayout(mesh)
    engine = Engine.for_model(config, engine_config, layout)
    params = abstract_model(config)[1]
    params = _with_shardings(params, layout.param_shardings(params))
    state = _with_shardings(engine.state_shapes(), layout.state_shardings(engine))
    pool = pages.pool_of(state)  # values and, for an int8 cache, their scales
    by_kind = {"weights": shard_bytes(params), "kv_cache": shard_bytes(pool)}
    by_kind["decode_state"] = shard_bytes(state) - by_kind["kv_cache"]
    settings = {
        "slots": slots,
        "max_len": max_len,
        "steps_per_call": steps_per_call,
        "cache_dtype": cache_dtype,
        "param_dtype": config.param_dtype,
        "page_size": engine_config.page,
        "decode_attention": engine.decode_attention,  # the kernel, or the fallback and why
        "expert_dispatch": getattr(engine.model_config, "expert_dispatch", None),  # None for a dense model
    }
    # The very program the engine runs (traced as the engine traces it), at the widest window (a static
    # argument): the worst case, the loop reads every cache position.
    start = time.perf_counter()
    return _compiled_report("generate", engine.lower_generate(params), mesh, settings, by_kind, start)
