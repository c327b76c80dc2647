"""Process-aware building blocks, run for real as 2 JAX processes x 2 fake CPU devices on 127.0.0.1."""

import json
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from tests.helpers import fake_cpu_devices
from trace_jax.parallel import distributed, multihost

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_pair(workdir, *mode):
    """Two processes of multiprocess_check on a free port; their JSON outputs in process order."""
    env = dict(
        os.environ,
        XLA_FLAGS=fake_cpu_devices(2),
        JAX_PLATFORMS="cpu",
        JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
    )
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.parallel.multiprocess_check", str(port), str(pid), str(workdir), *mode],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in (0, 1)
    ]
    outputs = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=240)
            assert proc.returncode == 0, stderr[-3000:]
            outputs.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outputs


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("two_processes")
    return _run_pair(workdir), workdir


def test_each_process_takes_a_disjoint_block_of_the_prompts(two_processes):
    (p0, p1), _ = two_processes
    assert (p0["index"], p1["index"]) == (0, 1) and (p0["main"], p1["main"]) == (True, False)
    assert p0["prompts"] and p1["prompts"] and not set(p0["prompts"]) & set(p1["prompts"])
    assert p0["prompts"] + p1["prompts"] == [f"q{i}" for i in range(11)]


def test_gathered_host_rows_are_the_same_on_both_processes_in_process_order(two_processes):
    (p0, p1), _ = two_processes
    expected = [[0.0, 0.0], [1.0, 0.0], [10.0, 1.0], [11.0, 1.0], [12.0, 1.0]]
    assert p0["gathered"] == p1["gathered"] == expected
    assert p0["counts"] == p1["counts"] == [2, 3]


def test_global_batch_is_assembled_from_process_local_rows(two_processes):
    (p0, p1), _ = two_processes
    assert p0["global_shape"] == p1["global_shape"] == [4, 3]  # both padded to 2 local rows
    # Process 0's real row (100+101+102), its padding row, then process 1's two rows (200+201+202).
    assert p0["row_sums"] == p1["row_sums"] == [303, 0, 603, 603]


def test_a_batch_every_process_holds_whole_becomes_a_global_array_fed_by_each_process_s_own_rows(two_processes):
    (p0, p1), _ = two_processes
    assert p0["whole_equal"] and p1["whole_equal"]
    full = (np.arange(12).reshape(4, 3) + 10 * np.arange(4)[:, None]).tolist()
    assert p0["whole_local_rows"] == [full[0:1], full[1:2]] and p1["whole_local_rows"] == [full[2:3], full[3:4]]


def test_continuations_get_the_one_process_seeds_whichever_process_samples_them(two_processes):
    (p0, p1), _ = two_processes
    s0, s1 = p0["seeds"], p1["seeds"]
    assert s0["sharded"] and s1["sharded"] and not set(s0["sharded"]) & set(s1["sharded"])
    assert {**s0["sharded"], **s1["sharded"]} == s0["alone"] == s1["alone"]
    assert s0["counts"] == s1["counts"] and s0["counts"][0] == s0["counts"][1]  # the running counts agree


def test_each_process_gets_a_full_copy_on_its_own_devices_and_computes_alone(two_processes):
    (p0, p1), _ = two_processes
    assert p0["weights_span_both"] and p1["weights_span_both"]  # premise: the source is split across hosts
    assert p0["copy_addressable"] and p1["copy_addressable"]
    assert p0["copy_value"] == p1["copy_value"] == np.arange(16.0).reshape(8, 2).tolist()
    assert (p0["local_result"], p1["local_result"]) == (120.0, 240.0)  # no collective couples them
    assert p0["single_device_copy"] == p1["single_device_copy"] == p0["copy_value"]  # onto one local device


def test_sharded_rollouts_keep_every_tree_and_the_predictor_identical_across_processes(two_processes):
    (p0, p1), _ = two_processes
    s0, s1 = p0["scheduling"], p1["scheduling"]
    # Each process's own backend sampled exactly the prompts it owns, and the owners are disjoint.
    assert s0["seen"] == s0["owned"] and s1["seen"] == s1["owned"] and s0["owned"] and s1["owned"]
    assert not set(s0["owned"]) & set(s1["owned"])
    # Yet both hold the same trees (turns from both processes), the same spent budget and the same predictor.
    assert s0["trees"] == s1["trees"] and s0["predictor"] == s1["predictor"]
    assert s0["rollouts"] == s1["rollouts"] == [32, 32] and s0["leaves"] == 32


def test_evaluation_splits_its_questions_and_every_process_gets_the_one_process_scores(two_processes):
    (p0, p1), _ = two_processes
    e0, e1 = p0["evaluation"], p1["evaluation"]
    assert e0["answered"] and e1["answered"] and not set(e0["answered"]) & set(e1["answered"])
    assert sorted(e0["answered"] + e1["answered"]) == list(range(10))
    assert e0["rows"] == e1["rows"] and e0["equals_one_process"] and e1["equals_one_process"]


def test_scalar_metrics_reduce_to_the_same_exact_values_everywhere(two_processes):
    (p0, p1), _ = two_processes
    assert p0["metrics"] == p1["metrics"]
    assert p0["metrics"]["reward"] == pytest.approx((0 * 1 + 1 * 2) / 3)  # weighted by each process's weight
    assert p0["metrics"]["tokens"] == 2.0**41 + 1  # a sum, exact beyond float32
    assert "different metric keys" in p0["mismatch"] and "different metric keys" in p1["mismatch"]


def test_only_the_main_process_writes(two_processes):
    (p0, p1), workdir = two_processes
    assert (p0["writer_active"], p1["writer_active"]) == (True, False)
    assert (workdir / "log_from_0.txt").read_text() == "hello\n"
    assert not (workdir / "log_from_1.txt").exists()


def _assert_restored(r0, r1):
    assert r0["step"] == r1["step"] == 1 and r0["metadata"] == r1["metadata"] == {"note": "both"}
    assert r0["equal"] and r1["equal"] and r0["sharding_ok"] and r1["sharding_ok"]
    assert r0["local"] != r1["local"]  # each process holds its own rows
    rows = np.concatenate([np.asarray(r0["local"]), np.asarray(r1["local"])]).reshape(8, 2)
    np.testing.assert_array_equal(rows, np.arange(16.0).reshape(8, 2))


def test_a_checkpoint_written_by_both_processes_restores_into_the_same_sharding(two_processes):
    (p0, p1), workdir = two_processes
    assert (workdir / "checkpoints" / "1").is_dir()
    _assert_restored(p0["restored"], p1["restored"])


def test_a_rerun_with_the_same_number_of_processes_resumes_from_that_checkpoint(two_processes):
    _, workdir = two_processes
    r0, r1 = _run_pair(workdir, "restore")
    _assert_restored(r0["restored"], r1["restored"])


# ------------------------------------------------------------------------------ one process (this one)
@pytest.mark.parametrize("n,count", [(0, 3), (5, 1), (10, 4), (11, 2), (3, 8)])
def test_process_slices_are_disjoint_and_cover_in_order(n, count):
    sizes = []
    covered = []
    for index in range(count):
        block = range(n)[multihost.process_slice(n, index, count)]
        covered += list(block)
        sizes.append(len(block))
    assert covered == list(range(n))
    assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="not in"):
        multihost.process_slice(n, count, count)


def test_one_process_is_the_whole_world():
    assert multihost.shard_for_process(["a", "b"]) == ["a", "b"]
    rows, counts = multihost.allgather_rows(np.arange(6.0).reshape(3, 2))
    np.testing.assert_array_equal(rows, np.arange(6.0).reshape(3, 2))
    assert counts.tolist() == [3] and multihost.common_row_count(5, multiple=4) == 8
    assert multihost.reduce_metrics({"a": 2.0, "b": 3.0}, how={"b": "max"}) == {"a": 2.0, "b": 3.0}
    with pytest.raises(ValueError, match="choose one of"):
        multihost.reduce_metrics({"a": 1.0}, how={"a": "median"})
    writer = distributed.MainProcessWriter(lambda: [])
    assert writer.active
    writer.append(1)  # forwarded to the real object on the main process
    assert writer._writer == [1]
    assert distributed.run_on_main(lambda: 7) == 7
    mesh = multihost.local_mesh()
    copy = multihost.copy_to_each_process({"w": jnp.arange(4.0)}, mesh)["w"]
    np.testing.assert_array_equal(np.asarray(copy), np.arange(4.0))
    with pytest.raises(ValueError, match="this process's devices"):
        multihost.copy_to_each_process(
            {"w": jnp.arange(4.0)}, Mesh(np.asarray(jax.devices()).reshape(1, -1), ("a", "b"))
        )


def test_with_one_process_the_main_job_s_process_view_passes_everything_through():
    from trace_jax.cluster.processes import Processes
    from trace_jax.parallel.mesh import make_mesh
    from trace_jax.rollout.tree import RolloutTree

    processes = Processes()
    assert not processes.multi and processes.is_main and processes.count == 1
    mesh = make_mesh()
    params, runner = {"w": jnp.ones(2)}, object()
    assert processes.sampling_mesh(mesh) is mesh and processes.engine_weights(params, None) is params
    assert processes.backend(runner) is runner and processes.from_main({"a": 1}) == {"a": 1}
    assert processes.reduce({"time/step_s": 2.0, "reward": 0.5}) == {"time/step_s": 2.0, "reward": 0.5}
    trees = [RolloutTree([1, 2], {"id": "train-3"}, 0), RolloutTree([1], {"id": "train-9"}, 1)]
    assert processes.sampled_questions(runner, trees) == [["train-3", "train-9"]]
    processes.barrier("nothing to wait for")
