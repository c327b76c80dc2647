"""``python -m trace_jax.plan``: pick a mesh, micro-batching and remat policy that fit, from XLA's memory analysis.

    python -m trace_jax.plan --model qwen3-8b --topology v5p-64 --rows 256 --seq-len 4096 [--json out.json]

Which compiler: with libtpu installed (``pip install "jax[tpu]"`` at the installed jax version, or the
``tpu`` extra) a TPU slice is compiled by the TPU compiler for that slice's abstract devices, on any host, and
the figures are the TPU compiler's; without it (or with ``--backend cpu``) XLA:CPU compiles the same programs
on fake CPU devices and the figures are stand-ins (XLA:CPU keeps float32 copies the TPU compiler does not).
Beside the memory the plan prints the Mosaic kernels each program calls and its predicted time
(``trace_jax.plan.timing``: the largest of the compute, HBM and interconnect bounds from the compiled HLO),
hence decode tokens/s, the update's time and MFU, and the RL step split by phase.

For the train step the candidates are (fsdp x tensor meshes over all chips) x micro-batches x remat policies,
tried in order of expected speed (no remat before matmul-saving before full remat; fewer micro-batches and
less tensor parallelism first). A rough analytic estimate skips candidates that cannot fit; each remaining one
is compiled (the programs ``RLTrainer.update`` runs: zero, accumulate over a micro-batch of rows / micro-batches
rows, apply) until the update's per-device peak fits the chip's memory less the margin.
The engine (``Engine.generate``, slots x max_len) tries data x tensor meshes the same way; on the mesh chosen
it is compiled once more at twice the slots, and the line through the two peaks (per chip: fixed bytes +
bytes per slot) gives the slots per chip that fit the budget at that length (``slots_per_chip``). A 4-layer copy of
the chosen train step is compiled too, to show that compile time does not grow with depth (scanned layers).

"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import sys
import time
from typing import Any

from trace_jax.plan import calibration
from trace_jax.plan.calibration import ANCHOR_MODELS
from trace_jax.plan.multislice import dcn_plan
from trace_jax.plan.topology import GIB, Topology, parse_topology

REMATS = ("none", "save_dots", "full")


def _backend(requested: str, topology: Topology | None) -> str:
    """ "tpu" or "cpu" (see ``Planner``); an explicit "tpu" without libtpu is an error that says how to install it."""
    have_libtpu = importlib.util.find_spec("libtpu") is not None
    tpu_slice = topology is None or (topology.is_tpu and topology.grid is not None)
    if requested == "tpu":
        if not have_libtpu:
            raise SystemExit('--backend tpu needs libtpu: pip install "jax[tpu]==<the installed jax version>"')
        return "tpu"
    if requested == "cpu":
        return "cpu"
    return "tpu" if have_libtpu and tpu_slice else "cpu"


def _set_fake_devices(count: int) -> None:
    if "jax" in sys.modules:
        import jax  # already imported: only look at its devices

        if len(jax.devices()) < count:
            raise RuntimeError(f"jax was imported with {len(jax.devices())} devices; the plan needs {count}")
        return
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


# ------------------------------------------------------------------------------------------ estimates
def _activation_estimate(
    config: Any, tokens: int, tensor: int, remat: str, rows: int, chunk: int, expert: int = 1, copies: float = 2.5
) -> float:
    """Rough per-device activation bytes of one micro-batch (orders and prunes candidates; XLA decides)."""
    act = 2 if config.dtype == "bfloat16" else 4
    d, f, e = config.hidden_size, config.active_mlp_width / tensor, config.head_dim
    heads = (config.num_heads + 2 * config.num_kv_heads) * e / tensor
    dispatch, experts = _moe_terms(config, tensor, act, expert)
    per_layer = tokens * act * (6 * d + 4 * f + 3 * heads + 2 * dispatch)  # what one layer keeps without remat
    saved = {
        "none": per_layer,
        "save_dots": tokens * act * (2 * d + 2 * f + heads + dispatch),
        "full": tokens * act * d,
    }
    # Without full remat the backward pass reads each sparse layer's experts as the dispatch holds them.
    kept_experts = 0 if remat == "full" else experts * len(getattr(config, "sparse_layers", ()))
    seq = tokens / max(rows, 1)
    attention = rows * config.num_heads / tensor * min(512, seq) * seq * 4 * 4
    logits = rows * chunk * config.vocab_size / tensor * 4 * 4
    # copies: XLA:CPU keeps float32 copies around bf16 dots (measured on qwen3-8b: ~2.6x the bf16 count); 1 on TPU.
    return copies * (config.num_layers * saved[remat] + 2 * per_layer + kept_experts + 2 * experts) + attention + logits


def _gather_terms(config: Any, tensor: int, act: int, expert: int) -> tuple[float, float]:
    """``gather``: each token's row copied top-k times into and out of the experts; one sparse layer's whole
    expert set gathered over ``expert`` and ``embed``."""
    share = len(config.sparse_layers) / config.num_layers
    dispatch = config.num_experts_per_tok * config.hidden_size * share
    return dispatch, 3 * config.num_experts * config.hidden_size * config.moe_intermediate_size * act / tensor


def _all_to_all_terms(config: Any, tensor: int, act: int, expert: int) -> tuple[float, float]:
    """``all_to_all``: besides the top-k copies, a send and a receive buffer of ``expert`` blocks each holding
    all of the device's top-k rows (dropless worst case, S x C x d each); the experts gathered over ``embed``
    only, E / S of them. Runs as ``gather`` where the expert axis cannot split the experts."""
    dispatch, experts = _gather_terms(config, tensor, act, expert)
    if expert == 1 or config.num_experts % expert:
        return dispatch, experts
    return dispatch * (1 + 2 * expert), experts / expert


_DISPATCH_TERMS = {"gather": _gather_terms, "all_to_all": _all_to_all_terms}


def _moe_terms(config: Any, tensor: int, act: int, expert: int = 1) -> tuple[float, float]:
    """A mixture of experts' extra activation width per token and layer (averaged over the layers) and the
    bytes of one sparse layer's experts as its dispatch (``MoeConfig.expert_dispatch``,
    ``models.expert_dispatch``) holds them on a device; (0, 0) for a dense model."""
    if not hasattr(config, "num_experts"):
        return 0.0, 0.0
    return _DISPATCH_TERMS[config.expert_dispatch](config, tensor, act, expert)


def _expert_sizes(config: Any, chips: int) -> tuple[int, ...]:
    """Expert-axis sizes to try, largest first (each device group then holds fewer whole experts, and fsdp
    gathers less of them); (1,) for a dense model. A size must divide the experts and the chips."""
    experts = getattr(config, "num_experts", 1)
    return tuple(e for e in (16, 8, 4, 2, 1) if experts % e == 0 and chips % e == 0)


def _mesh(config: Any, **sizes: int) -> dict[str, int]:
    """A candidate's mesh; the ``expert`` axis is named only for a mixture of experts (dense plans unchanged)."""
    if not hasattr(config, "num_experts"):
        sizes.pop("expert")
    return sizes


def _train_candidates(config, topology: Topology, rows: int, seq_len: int, chunk: int, copies: float = 2.5):
    chips = topology.chips
    for remat in REMATS:
        for micro in (1, 2, 4, 8, 16, 32):
            for tensor in (1, 2, 4, 8):
                for expert in _expert_sizes(config, chips // tensor if chips % tensor == 0 else 1):
                    fsdp = chips // tensor // expert
                    shards = fsdp * expert  # the batch splits over (data, fsdp, expert)
                    if chips % tensor or rows % (shards * micro):
                        continue
                    rows_dev = rows // shards // micro
                    estimate = _activation_estimate(
                        config, rows_dev * seq_len, tensor, remat, rows_dev, chunk, expert, copies
                    )
                    mesh = _mesh(config, data=1, fsdp=fsdp, expert=expert, tensor=tensor)
                    yield {"remat": remat, "micro_batches": micro, "mesh": mesh}, estimate


def parse_mesh(text: str, chips: int) -> dict[str, int]:
    """``data=1,fsdp=-1,tensor=4`` -> every axis's size over ``chips`` (one axis may be -1: the rest)."""
    sizes = {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1}
    for part in text.split(","):
        name, _, value = part.partition("=")
        if name.strip() not in sizes or not value.strip().lstrip("-").isdigit():
            raise SystemExit(f"--mesh {text!r}: expected axis=size pairs over {tuple(sizes)}, e.g. fsdp=-1,tensor=4")
        sizes[name.strip()] = int(value)
    known = 1
    for v in sizes.values():
        known *= v if v != -1 else 1
    for k, v in sizes.items():
        if v == -1:
            sizes[k] = chips // known
    product = sizes["data"] * sizes["fsdp"] * sizes["expert"] * sizes["tensor"]
    if product != chips:
        raise SystemExit(f"--mesh {text!r} covers {product} chips; the slice has {chips}")
    return sizes


def _fixed_candidates(config, topology: Topology, args: argparse.Namespace, copies: float):
    """The job's own layout (``--mesh``, ``--micro-rows``): one train candidate, the model's remat policy."""
    mesh = parse_mesh(args.mesh, topology.chips)
    shards = mesh["data"] * mesh["fsdp"] * mesh["expert"]
    micro_rows = args.micro_rows or shards
    if micro_rows % shards or args.rows % micro_rows:
        raise SystemExit(f"--micro-rows {micro_rows} must divide --rows {args.rows} and be a multiple of {shards}")
    rows_dev = micro_rows // shards
    remat = getattr(args, "remat", None) or config.remat
    estimate = _activation_estimate(
        config, rows_dev * args.seq_len, mesh["tensor"], remat, rows_dev, args.logprob_chunk, mesh["expert"],
        copies,
    )  # fmt: skip
    yield {"remat": remat, "micro_batches": args.rows // micro_rows, "mesh": _mesh(config, **mesh)}, estimate


def _engine_candidates(topology: Topology, slots: int, config: Any = None):
    for tensor in (1, 2, 4, 8):
        for expert in _expert_sizes(config, topology.chips // tensor if topology.chips % tensor == 0 else 1):
            data = topology.chips // tensor // expert
            if topology.chips % tensor == 0 and slots % (data * expert) == 0:
                yield {"mesh": _mesh(config, data=data, fsdp=1, expert=expert, tensor=tensor)}


# ---------------------------------------------------------------------------------------------- search
class Planner:
    """Compiles candidates for one model; compiled reports are memoised by (program, mesh, settings), so
    topologies with the same chip count, devices and a different memory share compiles. ``backend``: "tpu"
    compiles for each slice's abstract TPU devices (libtpu), "cpu" on fake CPU devices (``chips`` of them),
    "auto" the first where libtpu is installed and the slice is a TPU."""

    def __init__(self, args: argparse.Namespace, chips: int, topology: Topology | None = None):
        self.backend = _backend(getattr(args, "backend", "auto"), topology)
        if self.backend == "cpu":
            _set_fake_devices(chips)
        import jax  # JAX only after _set_fake_devices: the fake device count is read when JAX starts

        from trace_jax.models import ModelConfig
        from trace_jax.plan import lora as plan_lora  # imports jax: only after _set_fake_devices

        self.args = args
        self.devices = jax.devices() if self.backend == "cpu" else []
        self._tpu_devices: dict[str, list[Any]] = {}
        settings = {
            "dtype": args.dtype,
            "param_dtype": args.param_dtype,
            "attention": getattr(args, "attention", "auto"),
        }
        if args.model in ANCHOR_MODELS:  # an anchor's published model shape (calibration), not a preset we serve
            self.config = ModelConfig(**ANCHOR_MODELS[args.model], **settings)
        else:
            self.config = ModelConfig.preset(args.model, **settings)
        if getattr(args, "expert_dispatch", None):  # MoeConfig.expert_dispatch; dense presets have no such field
            if not hasattr(self.config, "expert_dispatch"):
                raise SystemExit(f"--expert-dispatch needs a mixture-of-experts preset; {args.model} is dense")
            self.config = dataclasses.replace(self.config, expert_dispatch=args.expert_dispatch)
        # --lora-*: the job's adapters on the policy (the update trains them alone; the engine decodes with them).
        if hasattr(args, "lora_rank"):
            self.config = plan_lora.adapted(
                self.config, args.lora_rank, args.lora_alpha, args.lora_targets, args.lora_base_quant
            )
        self.engine_dispatch = getattr(args, "engine_expert_dispatch", None)
        if self.engine_dispatch and not hasattr(self.config, "expert_dispatch"):
            raise SystemExit(f"--engine-expert-dispatch needs a mixture-of-experts preset; {args.model} is dense")
        self.memo: dict[str, Any] = {}
        self.compiles = 0

    def devices_for(self, topology: Topology) -> list[Any]:
        """The devices a candidate's mesh is built over: the slice's abstract TPU devices, or fake CPU ones."""
        if self.backend == "cpu":
            return self.devices[: topology.chips]
        if not topology.is_tpu or topology.grid is None:
            raise SystemExit(f"--backend tpu needs a TPU slice with a known grid; {topology.name} is not one")
        if topology.libtpu_name not in self._tpu_devices:
            # imports jax: only once the backend's device flags are set
            from trace_jax.plan.compile import target_devices

            self._tpu_devices[topology.libtpu_name] = target_devices(topology)
        return self._tpu_devices[topology.libtpu_name]

    def _key(self, topology: Topology, *parts: Any) -> str:
        where = "cpu" if self.backend == "cpu" else topology.libtpu_name
        return json.dumps([where, *parts])

    def _report(self, key: str, build) -> dict[str, Any]:
        if key not in self.memo:
            self.memo[key] = build().as_dict()
            self.compiles += 1
        return self.memo[key]

    def train(self, topology: Topology, budget: int, depth_check: bool = False) -> dict[str, Any]:
        # These import JAX: only after _set_fake_devices (the fake device count is read when JAX starts).
        from trace_jax.parallel.mesh import make_mesh
        from trace_jax.plan import compile as plan_compile  # imports jax: only once the backend's device flags are set
        from trace_jax.plan import lora as plan_lora

        args, config = self.args, self.config
        devices = self.devices_for(topology)
        state_bytes = plan_lora.train_state_bytes(config, 4 if args.param_dtype == "float32" else 2) / topology.chips
        out: dict[str, Any] = {"fits": None, "tried": []}
        fresh = self.compiles + args.max_compiles  # candidates compiled before (memoised) cost nothing
        copies = 2.5 if self.backend == "cpu" else 1.0
        refused: dict[str, tuple[int, float]] = {}
        candidates = _train_candidates(config, topology, args.rows, args.seq_len, args.logprob_chunk, copies)
        if getattr(args, "mesh", None):
            candidates = _fixed_candidates(config, topology, args, copies)
        windowed = self.args.windowed_einsum != "off"
        for candidate, estimate in candidates:
            key = self._key(topology, "train", candidate, windowed)
            pruned = state_bytes + estimate > budget * args.prune and not getattr(args, "mesh", None)
            # A compiled sibling (same remat and mesh, fewer micro-batches) whose temporaries were too big:
            # activations shrink about as the rows a call does, so skip this one while the scaled need is too big.
            sibling = refused.get(json.dumps([candidate["remat"], candidate["mesh"]]))
            if sibling and sibling[1] * sibling[0] / candidate["micro_batches"] + state_bytes > budget:
                pruned = True
            if pruned or (key not in self.memo and self.compiles >= fresh):
                continue
            report = self._update_report(topology, candidate, windowed)
            entry = {**report, "fits": report["peak_gib"] * GIB <= budget}
            if not entry["fits"]:
                need = report["per_device_gib"]["temporaries"] * GIB
                refused[json.dumps([candidate["remat"], candidate["mesh"]])] = (candidate["micro_batches"], need)
            out["tried"].append(entry)
            print(_row(entry), flush=True)
            if entry["fits"]:
                out["fits"] = entry
                break
        if out["fits"] and args.windowed_einsum == "auto" and self.backend == "tpu":
            out["fits"] = self._faster_unwindowed(topology, budget, candidate, out)
        if out["fits"] and depth_check:
            chosen = out["fits"]
            shallow = dataclasses.replace(config, remat=chosen["settings"]["remat"], num_layers=4)
            report = plan_compile.update_programs(
                shallow,
                make_mesh(**chosen["mesh"], devices=devices),
                chosen["settings"]["micro_rows"],
                args.seq_len,
                args.logprob_chunk,
                update=self.update_config(chosen["settings"]["windowed_einsum"]),
                rows=args.rows,
            )
            out["depth_check"] = {
                "layers": config.num_layers,
                "compile_seconds": chosen["compile_seconds"],
                "layers_4_compile_seconds": round(report.compile_seconds, 1),
                "ratio": round(chosen["compile_seconds"] / max(report.compile_seconds, 1e-9), 2),
            }
        return out

    def _faster_unwindowed(
        self, topology: Topology, budget: int, candidate: dict[str, Any], out: dict[str, Any]
    ) -> dict[str, Any]:
        """``--windowed-einsum auto``: the chosen layout compiled again without the TPU compiler's windowed
        matmuls (``UpdateConfig.windowed_einsum``); the faster of the two by the step-time model's accumulate
        call, the unwindowed one only when it also fits. Both stay under ``tried``."""
        from trace_jax.plan.timing import CHIPS, program_time  # imports jax: only once the backend's flags are set

        chosen = out["fits"]
        report = self._update_report(topology, candidate, False)
        other = {**report, "fits": report["peak_gib"] * GIB <= budget}
        out["tried"].append(other)
        print(_row(other), flush=True)
        chip = CHIPS.get(topology.family.name)
        seconds = lambda entry: program_time(entry["programs"]["accumulate"]["hlo"], chip)["seconds"]
        return other if other["fits"] and chip and seconds(other) < seconds(chosen) else chosen

    def _update_report(self, topology: Topology, candidate: dict[str, Any], windowed: bool) -> dict[str, Any]:
        """The update's programs compiled (memoised) for a train ``candidate`` (mesh, micro-batches, remat) of
        ``--rows`` rows, with or without windowed matmuls."""
        # These import JAX: only after _set_fake_devices (the fake device count is read when JAX starts).
        from trace_jax.parallel.mesh import make_mesh
        from trace_jax.plan import compile as plan_compile

        args = self.args
        build = functools.partial(
            plan_compile.update_programs,
            dataclasses.replace(self.config, remat=candidate["remat"]),
            make_mesh(**candidate["mesh"], devices=self.devices_for(topology)),
            args.rows // candidate["micro_batches"],
            args.seq_len,
            args.logprob_chunk,
            update=self.update_config(windowed),
            rows=args.rows,
        )
        return self._report(self._key(topology, "train", candidate, windowed), build)

    def update_config(self, windowed_einsum: bool = True) -> Any:
        from trace_jax.rl.trainer import UpdateConfig  # imports jax: only once the backend's device flags are set

        return UpdateConfig(
            ppo_epochs=self.args.ppo_epochs, mini_batches=self.args.mini_batches, windowed_einsum=windowed_einsum
        )

    def engine(self, topology: Topology, budget: int) -> dict[str, Any]:
        # These import JAX: only after _set_fake_devices (the fake device count is read when JAX starts).
        from trace_jax.parallel.mesh import make_mesh
        from trace_jax.plan import compile as plan_compile  # imports jax: only once the backend's device flags are set

        args = self.args
        devices = self.devices_for(topology)
        config = dataclasses.replace(self.config, param_dtype=args.engine_dtype, dtype=args.engine_dtype)
        # The engine's own dispatch (EngineConfig.expert_dispatch, as the job sets it); the update keeps the model's.
        dispatch = self.engine_dispatch or getattr(config, "expert_dispatch", None)
        max_len = args.engine_len or args.seq_len
        out: dict[str, Any] = {"fits": None, "tried": []}
        fresh = self.compiles + args.max_compiles
        candidates = list(_engine_candidates(topology, args.slots, self.config))
        if getattr(args, "mesh", None):  # the job decodes with the same tensor and expert split
            fixed = parse_mesh(args.mesh, topology.chips)
            candidates = [c for c in candidates if (c["mesh"]["tensor"], c["mesh"].get("expert", 1)) == (
                fixed["tensor"], fixed["expert"])]  # fmt: skip
        for candidate in candidates:
            mesh = make_mesh(**candidate["mesh"], devices=devices)
            weights = plan_compile.shard_bytes(plan_compile.abstract_params(config, mesh)[1])
            key = self._key(topology, "engine", candidate, dispatch)
            if weights > budget or (key not in self.memo and self.compiles >= fresh):
                continue
            report = self._report(
                key,
                lambda mesh=mesh: plan_compile.generate_memory(
                    config,
                    mesh,
                    args.slots,
                    max_len,
                    args.steps_per_call,
                    args.kv_dtype or args.engine_dtype,
                    self.engine_dispatch or "",
                ),
            )
            entry = {**report, "fits": report["peak_gib"] * GIB <= budget}
            out["tried"].append(entry)
            print(_row(entry), flush=True)
            if entry["fits"]:
                out["fits"] = entry
                break
        chosen = out["fits"]
        if chosen is not None and getattr(args, "slots_fit", True):
            mesh = make_mesh(**chosen["mesh"], devices=devices)
            twice = self._report(
                self._key(topology, "engine", {"mesh": chosen["mesh"], "slots": 2 * args.slots}),
                lambda: plan_compile.generate_memory(
                    config,
                    mesh,
                    2 * args.slots,
                    max_len,
                    args.steps_per_call,
                    args.kv_dtype or args.engine_dtype,
                    self.engine_dispatch or "",
                ),
            )
            chosen["slots_per_chip"] = slots_per_chip(chosen, twice, budget)
        return out


def slots_per_chip(one: dict[str, Any], twice: dict[str, Any], budget: int) -> dict[str, Any]:
    """Slots per chip that fit ``budget`` at the engine's length, from two compiles of the same mesh at
    ``n`` and ``2n`` slots: per-chip peak = fixed + per_slot x slots, solved for the budget."""
    shards = one["mesh"]["data"] * one["mesh"]["fsdp"]
    n, m = one["settings"]["slots"] // shards, twice["settings"]["slots"] // shards
    per_slot = (twice["peak_gib"] - one["peak_gib"]) / (m - n)
    fixed = one["peak_gib"] - per_slot * n
    fit = int((budget / GIB - fixed) // per_slot) if per_slot > 0 else None
    return {
        "max_len": one["settings"]["max_len"],
        "fit": fit,
        "per_slot_gib": round(per_slot, 4),
        "fixed_gib": round(fixed, 3),
        "temporaries_at_2x_gib": twice["per_device_gib"]["temporaries"],
    }


NOTES = {
    "tpu": "TPU compiler (libtpu) for the slice's abstract devices: per-chip memory, kernels and HLO of the "
    "programs the slice would run.",
    "cpu": "XLA:CPU stand-ins on fake CPU devices (libtpu not installed, or --backend cpu): an estimate of TPU "
    "memory (XLA:CPU keeps float32 copies and schedules differently); the kernels are the CPU's.",
}


def plan_one(planner: Planner, topology: Topology, depth_check: bool) -> dict[str, Any]:
    """The train step and engine plans of ``planner``'s model on ``topology``, and their predicted times."""
    from trace_jax.models import num_params  # JAX: only after _set_fake_devices (see Planner)

    args = planner.args
    memory = int(args.memory_gib * GIB) if args.memory_gib else topology.memory_bytes
    budget = int(memory * (1 - args.margin))
    result = {
        "model": args.model,
        "params": num_params(planner.config),
        "active_params": planner.config.active_params(),
        "topology": {"name": topology.name, "chips": topology.chips, "memory_gib": round(memory / GIB, 1)},
        "budget_gib": round(budget / GIB, 2),
        "margin": args.margin,
        "compiler": planner.backend,
        "note": NOTES[planner.backend],
        "train": planner.train(topology, budget, depth_check) if args.rows else {"fits": None, "tried": []},
        "engine": planner.engine(topology, budget) if args.slots else {"fits": None, "tried": []},
    }
    if topology.is_tpu and topology.grid is not None:
        result["topology"]["libtpu"] = topology.libtpu_name
    result["timing"] = predicted_times(result, planner.config, topology, args)
    return result


def predicted_times(result: dict[str, Any], config: Any, topology: Topology, args: argparse.Namespace) -> Any:
    """The step-time model (``trace_jax.plan.timing``) applied to the chosen programs: each program's bounds,
    the update's time and MFU, decode tokens/s, and one RL step split by phase. None for a slice without a
    chip in the table (GPUs)."""
    from trace_jax.plan.lora import train_flops_per_token  # imports jax: only once the backend's flags are set
    from trace_jax.plan.timing import CHIPS, program_time

    chip = CHIPS.get(topology.family.name)
    if chip is None:
        return None
    out: dict[str, Any] = {"chip": chip.name, "source": chip.source, "programs": {}}
    train, engine = result["train"]["fits"], result["engine"]["fits"]
    phases: dict[str, float] = {}
    prompt_len = min(args.prompt_len, args.seq_len // 2)  # a row samples at least half its tokens
    if train is not None:
        s = train["settings"]
        times = {name: program_time(p["hlo"], chip) for name, p in train["programs"].items()}
        out["programs"].update({f"update.{k}": v for k, v in times.items()})
        calls = max(s["micro_batches"], s["mini_batches"])
        step = calls * times["accumulate"]["seconds"] + s["mini_batches"] * (
            times["apply"]["seconds"] + times["zero"]["seconds"]
        )
        tokens = s["rows"] * s["seq_len"]
        flops = train_flops_per_token(config, s["seq_len"] / 2) * tokens  # a frozen base: no weight gradient
        out["update"] = {
            "optimizer_step_s": step,
            "update_s": s["ppo_epochs"] * step,
            "tokens_per_s_per_chip": tokens / step / topology.chips,
            "mfu": flops / (step * topology.chips * chip.bf16_flops),
            "model_flops_per_step": flops,
            "hlo_flops_per_step": calls * train["programs"]["accumulate"]["hlo"]["flops"] * topology.chips,
        }
        phases["update"] = s["ppo_epochs"] * step
        # Prefill ~ a forward pass over the prompts: a third of the accumulate step's forward + backward per
        # token (no remat; full remat makes it a quarter, so this errs long).
        per_token = times["accumulate"]["seconds"] / (s["micro_rows"] * s["seq_len"])
        phases["prefill"] = per_token / 3 * s["rows"] * prompt_len
    if engine is not None:
        s = engine["settings"]
        t = program_time(engine["hlo"], chip)
        out["programs"]["generate"] = t
        rate = s["slots"] * s["steps_per_call"] / t["seconds"]
        out["decode"] = {
            "call_s": t["seconds"],
            "step_ms": 1e3 * t["seconds"] / s["steps_per_call"],
            "tokens_per_s": rate,
            "tokens_per_s_per_chip": rate / topology.chips,
            "slots": s["slots"],
            "steps_per_call": s["steps_per_call"],
            "window": s["max_len"],
        }
        if args.rows:
            phases["decode"] = args.rows * (args.seq_len - prompt_len) / rate
    if phases and sum(phases.values()) > 0:
        total = sum(phases.values())
        out["rl_step"] = {
            "seconds": total,
            "phases_s": phases,
            "share": {k: v / total for k, v in phases.items()},
            "assumes": f"{args.rows} rows of {prompt_len} prompt + {args.seq_len - prompt_len} sampled "
            "tokens; decode at full slots and the widest window; the update on the train mesh; no host time",
        }
    out["calibrated"] = calibration.calibrated(out, topology.chips, calibration.load())
    return out


def plan(args: argparse.Namespace) -> dict[str, Any]:
    topology = parse_topology(args.topology)
    if getattr(args, "mesh", None) and args.rows < 0:  # the job's rows: one micro-batch call per mini-batch
        mesh = parse_mesh(args.mesh, topology.chips)
        args.micro_rows = args.micro_rows or mesh["data"] * mesh["fsdp"] * mesh["expert"]
        args.rows = args.micro_rows * args.mini_batches
    slices = getattr(args, "slices", 1)
    if slices > 1:  # each slice plans its share of the rows; the update is then compiled over all slices
        if args.rows % slices:
            raise SystemExit(f"--rows {args.rows} must divide over --slices {slices}")
        args.rows //= slices
    planner = Planner(args, topology.chips, topology)
    result = plan_one(planner, topology, args.depth_check)
    if slices > 1:
        args.rows *= slices
        result["dcn"] = dcn_plan(planner, topology, slices, result)
    return result


# ------------------------------------------------------------------------------------------------ output
def _row(entry: dict[str, Any]) -> str:
    mesh = "x".join(f"{k}{v}" for k, v in entry["mesh"].items() if v > 1) or "1"
    s = entry["settings"]
    what = (
        f"micro={s['micro_batches']} remat={s['remat']}" + ("" if s.get("windowed_einsum", True) else " unwindowed")
        if entry["program"] == "update"
        else f"slots={s['slots']} len={s['max_len']}"
    )
    kinds = " ".join(f"{k}={v:.2f}" for k, v in entry["per_device_gib"].items())
    verdict = "fits" if entry["fits"] else "too big"
    kernels = ",".join(f"{k}x{v}" for k, v in sorted(entry.get("kernels", {}).items())) or "none"
    return (
        f"{entry['program']:<10} {mesh:<18} {what:<26} {kinds}  peak={entry['peak_gib']:.2f} GiB  "
        f"kernels={kernels}  [{verdict}; {entry.get('platform', 'cpu')}; compiled in {entry['compile_seconds']:.0f}s]"
    )


def summary(result: dict[str, Any]) -> str:
    lines = [
        f"{result['model']} ({result['params'] / 1e9:.2f}B params) on {result['topology']['name']}: "
        f"{result['topology']['chips']} chips x {result['topology']['memory_gib']} GiB, budget "
        f"{result['budget_gib']} GiB per chip (margin {result['margin']:.0%})",
        f"note: {result['note']}",
    ]
    for part in ("train", "engine"):
        chosen = result[part]["fits"]
        if chosen is not None:
            lines.append(f"{part}: FITS  {_row(chosen)}")
            if "slots_per_chip" in chosen:
                fit = chosen["slots_per_chip"]
                lines.append(
                    f"engine slots per chip that fit at {fit['max_len']}: {fit['fit']} "
                    f"(peak = {fit['fixed_gib']} GiB + {fit['per_slot_gib']} GiB a slot)"
                )
        elif not result[part]["tried"]:
            lines.append(f"{part}: not asked for (--rows 0 / --slots 0)")
        else:
            lines.append(f"{part}: nothing fits among the {len(result[part]['tried'])} compiled candidates")
    timing = result.get("timing")
    if timing:
        lines.append(f"predicted times on {timing['chip']} (max of compute, HBM and ICI bounds; {timing['source']}):")
        for name, t in timing["programs"].items():
            lines.append(
                f"  {name:<18} {t['seconds'] * 1e3:10.2f} ms  ({t['bound']}-bound; compute {t['compute_s'] * 1e3:.2f}"
                f" / memory {t['memory_s'] * 1e3:.2f} / ICI {t['communication_s'] * 1e3:.2f} ms)"
                + (f"  [{t['unknown_loops']} loop(s) counted once: trip unread]" if t.get("unknown_loops") else "")
            )
        if "update" in timing:
            u = timing["update"]
            lines.append(
                f"  update: {u['optimizer_step_s']:.2f} s an optimizer step, {u['update_s']:.2f} s the update; "
                f"{u['tokens_per_s_per_chip']:.0f} tokens/s/chip, MFU {u['mfu']:.1%}"
            )
        if "decode" in timing:
            d = timing["decode"]
            lines.append(
                f"  decode: {d['tokens_per_s']:.0f} tokens/s ({d['tokens_per_s_per_chip']:.0f}/chip) at "
                f"{d['slots']} slots, {d['step_ms']:.2f} ms a step"
            )
        for program, c in (timing.get("calibrated") or {}).items():
            fmt = (lambda v: f"MFU {v:.1%}") if c["figure"] == "mfu" else (lambda v: f"{v:,.0f} tokens/s")
            lines.append(
                f"  {program}: roofline {fmt(c['upper_bound'])} (upper bound); calibrated estimate "
                f"{fmt(c['calibrated_estimate'])} (x {c['attained_fraction']:.2f} attained by {c['anchor']})"
            )
        if "rl_step" in timing:
            r = timing["rl_step"]
            split = ", ".join(f"{k} {v:.1f} s ({r['share'][k]:.0%})" for k, v in r["phases_s"].items())
            lines.append(f"  RL step: {r['seconds']:.1f} s = {split}  [{r['assumes']}]")
    if "depth_check" in result["train"]:
        d = result["train"]["depth_check"]
        lines.append(
            f"compile time: {d['layers']} layers {d['compile_seconds']}s vs 4 layers {d['layers_4_compile_seconds']}s "
            f"(x{d['ratio']})"
        )
    update = (result.get("dcn") or {}).get("update")
    if update:
        step = update["dcn_per_optimizer_step"]
        ratio = update["dcn_over_compute"]
        lines.append(
            f"{result['dcn']['slices']} slices over DCN: {step['bytes'] / 1e6:.1f} MB a chip each optimizer step in "
            f"{step['count']:.0f} transfers, {update['predicted_dcn_s']:.4f} s at {result['dcn']['dcn_gbps_per_chip']} "
            f"Gbps a chip" + (f" ({ratio:.2f}x the step's compute)" if ratio is not None else "") + f"; per-chip peak "
            f"{update['peak_gib']} GiB; the engine samples within its slice: 0 bytes"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The sizing options shared by ``python -m trace_jax.plan`` and ``trace_jax.plan.table``."""
    parser.add_argument(
        "--rows",
        type=int,
        default=256,
        help="train rows a step (0: skip it; -1 with --mesh: micro-rows x mini-batches)",
    )
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens of a train row (prompt + sampled)")
    parser.add_argument("--slots", type=int, default=256, help="engine decode slots (0: skip the engine)")
    parser.add_argument("--engine-len", type=int, default=0, help="cache positions per slot (default: --seq-len)")
    parser.add_argument(
        "--steps-per-call", type=int, default=64, help="engine decode steps one compiled call runs (EngineConfig)"
    )
    parser.add_argument(
        "--logprob-chunk",
        type=int,
        default=512,
        help="positions per LM-head chunk of the train log-probs (peak logits [rows, chunk, vocab])",
    )
    parser.add_argument("--dtype", default="bfloat16", help="train compute dtype")
    parser.add_argument("--param-dtype", default="float32", help="train weights (and optimizer state) dtype")
    parser.add_argument("--engine-dtype", default="bfloat16", help="engine weights, compute and KV cache dtype")
    parser.add_argument(
        "--kv-dtype", help="the engine's KV cache dtype (EngineConfig.cache_dtype; default --engine-dtype)"
    )
    parser.add_argument(
        "--attention",
        default="auto",
        help="ModelConfig.attention of both programs: auto (the target's kernels) or reference (plain XLA)",
    )
    parser.add_argument(
        "--expert-dispatch", default=None, help="a mixture of experts' dispatch: gather (the preset's) or all_to_all"
    )
    parser.add_argument(
        "--engine-expert-dispatch",
        default=None,
        help="the engine's own dispatch (default: --expert-dispatch's); the update keeps --expert-dispatch",
    )
    parser.add_argument("--memory-gib", type=float, default=0, help="override the chip's memory (GiB)")
    parser.add_argument("--margin", type=float, default=0.1, help="fraction of chip memory kept free")
    parser.add_argument("--prune", type=float, default=1.5, help="skip candidates estimated above prune x budget")
    parser.add_argument("--max-compiles", type=int, default=4, help="train-step compiles at most")
    parser.add_argument(
        "--no-depth-check",
        dest="depth_check",
        action="store_false",
        help="skip the second compile of the chosen layout at 4 layers (compile time against depth)",
    )
    parser.add_argument(
        "--no-slots-fit", dest="slots_fit", action="store_false", help="skip the engine's second compile (2x slots)"
    )
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument(
        "--slices",
        type=int,
        default=1,
        help="slices of --topology joined over DCN (mesh.slices): each plans its share of --rows, and the chosen "
        "update is compiled for all of them with its DCN bytes per optimizer step",
    )
    parser.add_argument(
        "--backend", default="auto", choices=("auto", "tpu", "cpu"), help="compiler (auto: TPU where libtpu is)"
    )
    parser.add_argument("--ppo-epochs", type=int, default=2, help="the update's epochs (UpdateConfig)")
    parser.add_argument("--mini-batches", type=int, default=2, help="optimizer steps an epoch (UpdateConfig)")
    parser.add_argument(
        "--prompt-len",
        type=int,
        default=512,
        help="prompt tokens of a row (the RL step's phases; at most half of --seq-len)",
    )
    parser.add_argument("--mesh", help="compile only this layout, e.g. data=1,fsdp=-1,tensor=4 (the job's mesh)")
    parser.add_argument("--micro-rows", type=int, default=0, help="with --mesh: rows per forward/backward call")
    parser.add_argument("--remat", choices=REMATS, help="with --mesh: the remat policy (default: the preset's)")
    parser.add_argument(
        "--windowed-einsum",
        default="on",
        choices=("on", "off", "auto"),
        help="the update's windowed matmuls on TPU (ppo.windowed_einsum): on (the compiler's default), off, or "
        "auto (the chosen layout compiled both ways, the faster kept)",
    )
    parser.add_argument(
        "--lora-rank", type=int, default=0, help="LoRA adapters of this rank on the policy, the base frozen (0: none)"
    )
    parser.add_argument("--lora-alpha", type=float, default=16.0, help="the adapters' scale numerator (lora.alpha)")
    parser.add_argument(
        "--lora-targets", default="q,k,v,o,gate,up,down", help="projections that take adapters (lora.targets)"
    )
    parser.add_argument(
        "--lora-base-quant",
        default="none",
        help="the frozen base's storage under the adapters (lora.base_quant): none or int8 (QLoRA)",
    )
    parser.add_argument("--hlo-dir", help="also write every compiled program's HLO text here (gzip)")
    parser.add_argument(
        "--require-fit", action="store_true", help="exit 3 (after printing the figures) when a part does not fit"
    )


def build_parser() -> argparse.ArgumentParser:
    """The command's parser: every option has its ``--help`` line."""
    parser = argparse.ArgumentParser(prog="python -m trace_jax.plan", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a ModelConfig preset, e.g. qwen3-8b")
    parser.add_argument(
        "--topology", required=True, help="e.g. v5p-64, v5e-64, v6e-64, v4-32, h100-8, or libtpu's v5p:2x4x4"
    )
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    if args.hlo_dir:
        from trace_jax.plan import compile as plan_compile  # imports jax: only once the backend's device flags are set

        plan_compile.HLO_DIR = args.hlo_dir
    result = plan(args)
    result["seconds"] = round(time.perf_counter() - start, 1)
    print(summary(result))
    print(f"planned in {result['seconds']}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result))
    asked = {"train": args.rows, "engine": args.slots}
    missing = [part for part, n in asked.items() if n and result[part]["fits"] is None]
    if args.require_fit and missing:
        print(f"plan: {' and '.join(missing)} do(es) not fit {args.topology}; see the figures above", file=sys.stderr)
        sys.exit(3)
    return result


if __name__ == "__main__":
    main()
