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


def test_a_pool_is_visited_once_per_epoch_in_a_seeded_order_and_resumes_exactly():
    # Catches: a pool that is not a fixed subset (drawn per seed or per epoch), an epoch that repeats or misses a
    # prompt, the same order every epoch, and a resume that restarts the epoch.
    rows = list(range(100))
    stream = PromptStream(rows, batch_size=4, seed=3, pool_size=12)
    pool = set(stream.rows)
    assert len(pool) == 12 and pool == set(PromptStream(rows, 4, seed=9, pool_size=12).rows)  # same pool, any seed
    assert min(pool) == 0 and max(pool) == 99  # evenly spaced over the split, not its first rows
    epochs = [[x for _ in range(stream.batches_per_epoch) for x in stream.next_batch()] for _ in range(2)]
    assert all(sorted(epoch) == sorted(pool) for epoch in epochs)
    assert epochs[0] != epochs[1]  # a fresh order each epoch
    saved = stream.state_dict()
    stream.next_batch()
    expected = [stream.next_batch() for _ in range(5)]
    resumed = PromptStream(rows, batch_size=4, seed=3, pool_size=12)
    resumed.load_state_dict(saved)
    resumed.next_batch()
    assert [resumed.next_batch() for _ in range(5)] == expected
    other_seed = PromptStream(rows, batch_size=4, seed=4, pool_size=12)
    assert [x for _ in range(3) for x in other_seed.next_batch()] != epochs[0]
    with pytest.raises(ValueError, match="pool_size"):
        PromptStream(rows, batch_size=4, pool_size=101)


def test_an_rl_split_with_kinds_feeds_only_those_kinds_and_validates():
    """``rl.split = "train:chain"`` on the realistic world (chain, buried and trivial questions): every prompt drawn
    is a chain question. Catches the synthetic source reading the whole train split whatever ``rl.split`` says,
    and a validator that refuses the kinds it documents (``eval.split = "test:chain"`` too)."""
    import pathlib
    import types

    from trace_jax.configs import load_config_file, validate
    from trace_jax.data.synthetic import KINDS, SyntheticWorld
    from trace_jax.job import recipes

    root = pathlib.Path(__file__).resolve().parents[2]
    config = load_config_file(f"{root / 'configs' / 'realistic.py'}:uniform")
    config.rl.split, config.eval.split = "train:chain", "test:chain"
    config = validate.validate(config)
    world = SyntheticWorld(config.world)
    assert {row["kind"] for row in world.questions("train")} == set(KINDS)  # premise: every kind is there
    stream = recipes.source_of(config).prompt_stream(config, types.SimpleNamespace(world=world))
    drawn = [row for _ in range(12) for row in stream.next_batch()]
    assert len(drawn) >= 100 and {row["kind"] for row in drawn} == {"chain"}
