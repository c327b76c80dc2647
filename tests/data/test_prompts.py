"""The prompt stream: seeded epochs, no straddling, and an exact resume from its state."""

import pytest

from trace_jax.data.prompts import PromptStream


def test_each_epoch_is_a_permutation_and_resume_replays_exactly():
    stream = PromptStream(list(range(10)), batch_size=3, seed=7)
    first_epoch = [x for _ in range(3) for x in stream.next_batch()]
    assert sorted(first_epoch) == sorted(set(first_epoch)) and len(first_epoch) == 9
    saved = stream.state_dict()
    expected = [stream.next_batch() for _ in range(4)]
    resumed = PromptStream(list(range(10)), batch_size=3, seed=7)
    resumed.load_state_dict(saved)
    assert [resumed.next_batch() for _ in range(4)] == expected
    assert stream.epoch == 2  # 3 batches per epoch of 10 rows: batches 4-6 are epoch 1, batch 7 epoch 2


def test_seeds_give_different_orders_and_bad_batch_sizes_fail():
    a = PromptStream(list(range(50)), 10, seed=0).next_batch()
    b = PromptStream(list(range(50)), 10, seed=1).next_batch()
    assert a != b
    with pytest.raises(ValueError, match="batch_size"):
        PromptStream([1, 2], batch_size=3)
