import jax
import numpy as np

from tests.helpers import abstract_like
from tests.rl.test_trainer import _batch, _step, fresh_state, shared_setup
from trace_jax.checkpoint.state import StateCheckpointer
from trace_jax.rl.trainer import TrainState


def test_resume_from_checkpoint_reproduces_the_uninterrupted_run_exactly(tmp_path):
    _, _, trainer = shared_setup()  # one trainer: the compiled programs are reused by both runs
    batches = [_batch(seed=s) for s in range(4)]  # what step s trains on depends on s only

    def train(state, first, last, ckpt=None):
        for step in range(first, last):
            state, _ = _step(trainer, state, batches[step])
            if ckpt is not None:
                ckpt.save(step + 1, state._asdict(), metadata={"data_position": step + 1})
        return state

    fresh = lambda: fresh_state(seed=7)
    uninterrupted = jax.device_get(train(fresh(), 0, 4))

    ckpt = StateCheckpointer(tmp_path, save_every=2, keep=2)
    train(fresh(), 0, 3, ckpt)  # "killed" after step 3: the last checkpoint is step 2
    target = abstract_like(fresh()._asdict())
    restored = StateCheckpointer(tmp_path).restore_latest(target=target)
    assert restored.step == 2 and restored.metadata == {"data_position": 2}
    state = TrainState(**restored.state)
    resumed = jax.device_get(train(state, restored.metadata["data_position"], 4))

    assert int(resumed.step) == 4
    for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(uninterrupted.params), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(resumed.opt_state), jax.tree.leaves(uninterrupted.opt_state), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(jax.random.key_data(resumed.rng), jax.random.key_data(uninterrupted.rng))
