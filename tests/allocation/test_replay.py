"""The predictor's replay buffer: bounded, column-aligned, reproducible sampling, checkpointable."""

import numpy as np
import pytest

from trace_jax.allocation.replay import ReplayBuffer


def test_keeps_the_most_recent_rows_column_aligned():
    buf = ReplayBuffer(capacity=5)
    buf.add({"x": np.arange(3), "y": np.arange(3) * 10})
    buf.add({"x": np.arange(3, 7), "y": np.arange(3, 7) * 10})
    assert len(buf) == 5
    assert buf.columns["x"].tolist() == [2, 3, 4, 5, 6]
    batch = buf.sample(np.random.default_rng(0), 64)
    np.testing.assert_array_equal(batch["y"], batch["x"] * 10)
    assert set(batch["x"].tolist()) <= {2, 3, 4, 5, 6}


def test_same_generator_seed_draws_the_same_rows_after_a_restore():
    buf = ReplayBuffer(capacity=100)
    buf.add({"x": np.arange(50.0)})
    restored = ReplayBuffer(capacity=100)
    restored.load_state_dict(buf.state_dict())
    first = buf.sample(np.random.default_rng([3, 1]), 16)["x"]
    assert len(set(first.tolist())) > 1
    np.testing.assert_array_equal(first, restored.sample(np.random.default_rng([3, 1]), 16)["x"])


def test_user_mistakes_raise():
    with pytest.raises(ValueError, match="at least 1"):
        ReplayBuffer(0)
    buf = ReplayBuffer(4)
    with pytest.raises(ValueError, match="empty"):
        buf.sample(np.random.default_rng(0), 1)
    with pytest.raises(ValueError, match="row counts"):
        buf.add({"x": np.zeros(2), "y": np.zeros(3)})
    buf.add({"x": np.zeros(2)})
    with pytest.raises(ValueError, match="differ"):
        buf.add({"z": np.zeros(2)})
