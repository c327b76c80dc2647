"""One of two JAX processes on 127.0.0.1 (2 fake CPU devices each); run by tests/parallel/test_multihost.py.

    python -m tests.parallel.multiprocess_check PORT PROCESS_ID WORKDIR [restore]

With ``restore`` it only reads back the checkpoint an earlier pair of processes wrote (a rerun).

Prints one JSON line with what this process saw; the test compares the two processes' lines.
"""

import hashlib
import json
import os
import sys

import jax
import numpy as np

from trace_jax.allocation.scheduler import SchedulerConfig, TreeScheduler
from trace_jax.allocation.simulate import Simulator, SimulatorConfig
from trace_jax.checkpoint.state import StateCheckpointer
from trace_jax.cluster.sharded_rollouts import ProcessShardedBackend, local_trees
from trace_jax.job.evaluate import evaluate
from trace_jax.parallel import distributed, multihost
from trace_jax.parallel.mesh import batch_sharding, make_mesh
from trace_jax.rollout.backend import RolloutStats


class Spy:
    """The process's own backend, recording which prompts it was asked to sample."""

    def __init__(self, inner):
        self.inner, self.seen = inner, set()

    def continue_anchors(self, requests):
        self.seen |= {r.tree.prompt_index for r in requests}
        return self.inner.continue_anchors(requests)


def digest(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(repr(a).encode() if a is None or np.isscalar(a) else np.ascontiguousarray(np.asarray(a)).tobytes())
    return h.hexdigest()


def tree_digest(trees) -> str:
    fields = ("parent", "token_ids", "logprobs", "entropies", "observation_ids", "reward", "feature")
    return digest([getattr(n, f) for t in trees for n in t.nodes for f in fields])


class Answerer:
    """A deterministic backend: sample j of task i answers "a" when (i + j) % 3 else "b" (gold is "a")."""

    def continue_anchors(self, requests):
        for r in requests:
            for j in range(r.k):
                answer = "a" if (r.tree.prompt_index + j) % 3 else "b"
                r.tree.add_turn(r.node_id, [7], reward=float(answer == "a"), info={"answer": answer})
        return RolloutStats(rollouts=sum(r.k for r in requests), generated_tokens=sum(r.k for r in requests))


class PromptEnv:
    def prompt_ids(self, task):
        return [1, task["hops"]]


class Seeded(Answerer):
    """A runner-like backend with a running seed count: records the seeds each request was given."""

    def __init__(self):
        self.next_seed, self.seeds = 100, {}

    def reserve_seeds(self, n):
        first, self.next_seed = self.next_seed, self.next_seed + n
        return first

    def continue_anchors(self, requests):
        for r in requests:
            first = r.first_seed if r.first_seed is not None else self.reserve_seeds(r.k)
            self.seeds[r.tree.prompt_index] = list(range(first, first + r.k))
        return super().continue_anchors(requests)


def sharded_seeds() -> dict:
    """Continuations are seeded as one process would seed them, whichever process samples them."""
    tasks = [{"hops": 1 + i % 3, "golden_answers": ["a"]} for i in range(5)]
    sharded, alone = Seeded(), Seeded()
    evaluate(ProcessShardedBackend(sharded), PromptEnv(), tasks, samples=2)
    evaluate(alone, PromptEnv(), tasks, samples=2)
    return {"sharded": sharded.seeds, "alone": alone.seeds, "counts": [sharded.next_seed, alone.next_seed]}


def sharded_evaluation() -> dict:
    tasks = [{"hops": 1 + i % 3, "golden_answers": ["a"]} for i in range(10)]
    spy = Spy(Answerer())
    rows = evaluate(ProcessShardedBackend(spy), PromptEnv(), tasks, samples=2).rows
    reference = evaluate(Answerer(), PromptEnv(), tasks, samples=2).rows  # one process does all the work
    return {"rows": rows, "equals_one_process": rows == reference, "answered": sorted(spy.seen)}


def sharded_scheduling(pid: int) -> dict:
    """Two TRACE steps on the simulator, each process sampling its own prompts with its own random stream."""
    config = SimulatorConfig(num_prompts=64)
    pool = Simulator(config, seed=3)  # the same batches on both processes
    sampler = Simulator(config, seed=3)  # the same world ...
    sampler.rng = np.random.default_rng([3, 1, pid])  # ... sampled differently by each process
    spy = Spy(sampler)
    scheduler = TreeScheduler(ProcessShardedBackend(spy), SchedulerConfig(policy="trace", rollouts_per_prompt=4.0))
    out = {"owned": [], "trees": [], "rollouts": []}
    for _ in range(2):
        result = scheduler.run(pool.sample_batch(8))
        out["owned"] += sorted(t.prompt_index for t in local_trees(result.trees))
        out["trees"].append(tree_digest(result.trees))
        out["rollouts"].append(result.stats.rollouts)
        out["leaves"] = sum(len(t.leaves()) for t in result.trees)
    out["owned"] = sorted(set(out["owned"]))
    out["seen"] = sorted(spy.seen)
    out["predictor"] = digest(jax.tree.leaves(scheduler.predictor.state_dict()))
    return out


def restore(workdir: str, mesh) -> dict:
    sharding = batch_sharding(mesh, 2)
    target = {"w": jax.ShapeDtypeStruct((8, 2), np.float32, sharding=sharding)}
    restored = StateCheckpointer(os.path.join(workdir, "checkpoints")).restore_latest(target=target)
    w = restored.state["w"]
    return {
        "step": restored.step,
        "metadata": restored.metadata,
        "local": [np.asarray(s.data).tolist() for s in w.addressable_shards],
        "equal": bool((multihost.to_host(w) == np.arange(16.0).reshape(8, 2)).all()),
        "sharding_ok": w.sharding == sharding,
    }


def main(port: int, pid: int, workdir: str, mode: str = "all") -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    distributed.initialize(
        distributed.DistributedConfig("explicit", f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    )
    assert (jax.process_count(), len(jax.devices()), len(jax.local_devices())) == (2, 4, 2)
    out = {"index": distributed.process_index(), "main": distributed.is_main_process()}
    if mode == "restore":
        print(json.dumps({**out, "restored": restore(workdir, make_mesh(data=1, fsdp=-1, tensor=1))}), flush=True)
        return

    # Prompts: a disjoint block each.
    out["prompts"] = multihost.shard_for_process([f"q{i}" for i in range(11)])

    # Host floats: process p contributes p + 2 rows; everyone gets all rows in process order.
    local = np.asarray([[10.0 * pid + i, pid] for i in range(pid + 2)], np.float32)
    rows, counts = multihost.allgather_rows(local)
    out["gathered"], out["counts"] = rows.tolist(), counts.tolist()

    # Global batch from local rows: p0 has 1 real row, p1 has 2; both pad to a common count.
    n = multihost.common_row_count(pid + 1, multiple=2)
    tokens = np.zeros((n, 3), np.int32)
    tokens[: pid + 1] = np.arange(3) + 100 * (pid + 1)
    mesh = make_mesh(data=1, fsdp=-1, tensor=1)
    batch = multihost.global_batch({"tokens": tokens}, mesh)
    row_sums = jax.jit(lambda b: b["tokens"].sum(axis=1), out_shardings=batch_sharding(mesh, 1))(batch)
    out["global_shape"] = list(batch["tokens"].shape)
    out["row_sums"] = np.asarray(multihost.to_host(row_sums)).tolist()

    # The same from a batch every process holds whole: each feeds only the rows its own devices hold.
    full = np.arange(12, dtype=np.int32).reshape(4, 3) + 10 * np.arange(4, dtype=np.int32)[:, None]
    whole = multihost.rows_to_global({"tokens": full}, mesh)["tokens"]
    out["whole_local_rows"] = sorted(np.asarray(s.data).tolist() for s in whole.addressable_shards)
    out["whole_equal"] = bool((multihost.to_host(whole) == full).all()) and not whole.is_fully_addressable

    # A full copy of a globally sharded array on each process's own devices; then host-local work only.
    weights = jax.make_array_from_callback(
        (8, 2), batch_sharding(mesh, 2), lambda idx: np.arange(16.0).reshape(8, 2)[idx]
    )
    out["weights_span_both"] = not weights.is_fully_addressable and len(weights.sharding.device_set) == 4
    local = multihost.local_mesh(data=1, fsdp=-1, tensor=1)
    copy = multihost.copy_to_each_process({"w": weights}, local, {"w": batch_sharding(local, 2)})["w"]
    out["copy_addressable"] = copy.is_fully_addressable and len(copy.sharding.device_set) == 2
    out["copy_value"] = np.asarray(copy).tolist()
    out["local_result"] = float(jax.jit(lambda w: (w * (pid + 1)).sum())(copy))  # differs per process
    one_device = make_mesh(devices=[jax.local_devices()[1]])  # a subset of the source's devices
    single = multihost.copy_to_each_process({"w": weights}, one_device)["w"]
    out["single_device_copy"] = np.asarray(single).tolist() if single.devices() == {jax.local_devices()[1]} else None

    # Scalar metrics: weighted mean by default, sums where asked; a key mismatch is an error everywhere.
    out["metrics"] = multihost.reduce_metrics(
        {"reward": float(pid), "tokens": 2.0**40 + pid}, how={"tokens": "sum"}, weight=pid + 1
    )
    try:
        multihost.reduce_metrics({f"only_on_{pid}": 1.0})
        out["mismatch"] = None
    except ValueError as e:
        out["mismatch"] = str(e)

    # Only process 0 creates and writes its log.
    log = os.path.join(workdir, f"log_from_{pid}.txt")
    writer = distributed.MainProcessWriter(lambda: open(log, "w"))  # noqa: SIM115 (the writer owns the file)
    writer.write("hello\n")
    writer.close()
    out["writer_active"] = writer.active

    # A checkpoint written by both processes together, restored by both into the same sharding.
    sharding = batch_sharding(mesh, 2)
    value = jax.make_array_from_callback((8, 2), sharding, lambda idx: np.arange(16.0).reshape(8, 2)[idx])
    ckpt = StateCheckpointer(os.path.join(workdir, "checkpoints"))
    ckpt.save(1, {"w": value}, metadata={"note": "both"})
    ckpt.close()
    out["restored"] = restore(workdir, mesh)
    out["scheduling"] = sharded_scheduling(pid)
    out["evaluation"] = sharded_evaluation()
    out["seeds"] = sharded_seeds()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], *sys.argv[4:])
