import json

import numpy as np
import pytest

from trace_jax.job.metrics import (
    MetricWriter,
    PhaseTimer,
    format_mean_std,
    format_table,
    mean_std_curve,
    plot_mean_std,
    plot_metrics,
    read_jsonl,
)


def test_writer_logs_jsonl_and_tensorboard(tmp_path):
    with MetricWriter(tmp_path) as writer:
        logged = writer.write(1, {"reward": np.float32(0.5), "n": 3, "hist": np.ones(3), "tag": "x"}, prefix="rl/")
        writer.write(2, {"reward": float("nan")}, prefix="rl/")
    assert logged == {"rl/reward": 0.5, "rl/n": 3.0}  # arrays and strings are not scalars
    assert read_jsonl(tmp_path / "metrics.jsonl") == [
        {"step": 1, "rl/reward": 0.5, "rl/n": 3.0},
        {"step": 2, "rl/reward": None},  # non-finite stays valid JSON
    ]
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def tensorboard_scalars(logdir):
    """{tag: [(step, value), ...]} as TensorBoard's own reader shows the run (purge markers applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: [(event.step, pytest.approx(event.value)) for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def test_tensorboard_after_a_resume_reads_like_an_uninterrupted_run(tmp_path):
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    with MetricWriter(clean) as writer:
        for step in range(6):
            writer.write(step, {"loss": float(step)})
    first = MetricWriter(killed)
    for step in range(5):  # the killed run got to step 4; its last checkpoint is step 3
        first.write(step, {"loss": float(step) if step <= 3 else -1.0})
    assert tensorboard_scalars(killed / "tensorboard")["loss"][-1][0] == 4  # flushed by write, before any close
    del first  # never closed: a SIGKILL closes nothing
    with MetricWriter(killed, resume_step=3) as writer:
        for step in (4, 5):
            writer.write(step, {"loss": float(step)})
    assert len(list((killed / "tensorboard").glob("events.out.tfevents.*"))) == 2
    expected = [(step, float(step)) for step in range(6)]
    assert tensorboard_scalars(killed / "tensorboard") == {"loss": expected}  # step 3 kept, the stale 4 purged
    assert tensorboard_scalars(clean / "tensorboard") == {"loss": expected}
    assert read_jsonl(killed / "metrics.jsonl") == read_jsonl(clean / "metrics.jsonl")
    with MetricWriter(killed) as writer:  # a fresh start forgets the old events too
        writer.write(0, {"loss": 7.0})
    assert tensorboard_scalars(killed / "tensorboard") == {"loss": [(0, 7.0)]}


def test_phase_timer_adds_a_resumed_run_to_the_saved_one():
    timer = PhaseTimer()
    with timer.phase("rl"):
        pass
    timer.load_state_dict({"rl": 10.0, "evaluation": 2.0, "total": 20.0})
    times = timer.state_dict()
    assert 10.0 <= times["rl"] < 11.0 and times["evaluation"] == 2.0 and times["total"] >= 20.0


def test_resume_drops_records_after_the_checkpoint_and_fresh_run_starts_over(tmp_path):
    with MetricWriter(tmp_path, tensorboard=False) as writer:
        for step in range(1, 6):
            writer.write(step, {"loss": float(step)})
    (tmp_path / "metrics.jsonl").open("a").write('{"step": 6, "lo')  # torn line of a killed run
    with MetricWriter(tmp_path, resume_step=3, tensorboard=False) as writer:
        writer.write(4, {"loss": 40.0})
    assert [(r["step"], r["loss"]) for r in read_jsonl(tmp_path / "metrics.jsonl")] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 40.0),
    ]
    MetricWriter(tmp_path, tensorboard=False).close()
    assert read_jsonl(tmp_path / "metrics.jsonl") == []


def test_plots_are_png_files(tmp_path):
    records = [{"step": i, "reward": i / 10, "em": None if i % 2 else i / 20} for i in range(10)]
    path = plot_metrics(records, ["reward", "em", "missing"], tmp_path / "plots" / "curves.png", title="run")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = [(np.arange(5), np.arange(5) * s) for s in (1.0, 2.0)]
    path = plot_mean_std({"trace": runs, "uniform": runs[:1]}, tmp_path / "ms.png", ylabel="EM")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mean_std_curve_uses_common_steps():
    x, mean, std = mean_std_curve(
        [(np.array([0, 1, 2]), np.array([1.0, 2.0, 3.0])), (np.array([1, 2]), np.array([4.0, 5.0]))]
    )
    np.testing.assert_array_equal(x, [1, 2])
    np.testing.assert_allclose(mean, [3.0, 4.0])
    np.testing.assert_allclose(std, [1.0, 1.0])


def test_table_and_mean_std_formatting():
    table = format_table([{"policy": "trace", "EM": 0.41234, "n": 3}, {"policy": "uniform", "EM": None}])
    lines = table.splitlines()
    assert lines[0].split("|")[1:-1] == [" policy  ", " EM    ", " n "]
    assert set(lines[1]) <= {"|", "-"}
    assert "0.412" in lines[2] and "-" in lines[3].split("|")[3]
    assert len({len(line) for line in lines}) == 1  # aligned columns
    assert format_mean_std([0.5, 0.7]) == "0.600 ± 0.100"
    assert format_mean_std([]) == "n/a"
    assert format_table([]) == ""
    json.dumps(table)  # plain text, safe to put in a JSON report


@pytest.mark.parametrize("value", [1, 2.5, np.float64(3.0), np.array(4.0), True])
def test_scalars_of_many_types_are_logged(tmp_path, value):
    with MetricWriter(tmp_path, tensorboard=False) as writer:
        assert writer.write(0, {"v": value}) == {"v": float(value)}
