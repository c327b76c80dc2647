"""SFT warm start: data rendered through the env, loss on turn tokens only, training and checkpoint reuse."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from trace_jax.data.synthetic import SyntheticWorld, WorldConfig
from trace_jax.data.tokenizer import train_world_tokenizer
from trace_jax.job import sft


@pytest.fixture(scope="module")
def world():
    return SyntheticWorld(WorldConfig(scale=1, questions_per_hop=24, ood_questions=4, max_hops=2, ood_hops=3))


@pytest.fixture(scope="module")
def tokenizer(world, tmp_path_factory):
    return train_world_tokenizer(world, tmp_path_factory.mktemp("tok"), vocab_size=400)


def test_sft_data_trains_on_turn_tokens_only(world, tokenizer):
    env = sft.make_env(world, tokenizer)
    tasks = world.questions("train")
    data = sft.build_sft_data(env, tasks, tokenizer.pad_token_id, multiple=32)
    assert data.ids.shape == data.loss_mask.shape and data.ids.shape[1] % 32 == 0
    for row, task in enumerate(tasks[:10]):
        n = data.lengths[row]
        assert tokenizer.decode(data.ids[row, data.loss_mask[row] == 1].tolist()) == "".join(task["gold_turns"])
        assert np.all(data.ids[row, n:] == tokenizer.pad_token_id) and not data.loss_mask[row, n:].any()
        prompt = env.prompt_ids(task)
        np.testing.assert_array_equal(data.ids[row, : len(prompt)], prompt)
        assert not data.loss_mask[row, : len(prompt)].any()
    buckets = data.buckets(64)
    assert sorted(np.concatenate(list(buckets.values())).tolist()) == list(range(len(tasks)))
    assert all(data.lengths[rows].max() <= width for width, rows in buckets.items())


def test_token_loss_is_cross_entropy_on_masked_targets_only():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(2, 5, 7)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 7, (2, 5)), jnp.int32)
    mask = jnp.asarray([[0, 1, 1, 0, 0], [0, 0, 0, 1, 0]], jnp.float32)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:])
    expected = (nll[0, 0] + nll[0, 1] + nll[1, 2]) / 3
    assert sft.token_loss(logits, ids, mask) == pytest.approx(float(expected), rel=1e-6)
    # Logits predicting unmasked targets do not matter.
    scrambled = logits.at[:, 3].set(100.0).at[0, 4].set(-5.0)
    assert sft.token_loss(scrambled, ids, mask) == pytest.approx(float(expected), rel=1e-6)


def test_run_sft_lowers_the_loss_and_reuses_its_checkpoint(world, tokenizer, tmp_path):
    config = sft.SFTConfig(
        batch_size=4,
        max_steps=16,
        warmup_steps=4,
        log_every=5,
        bucket_multiple=512,
        practice_worlds=1,
    )
    assert config.time_budget_s is None  # the default: a fixed number of steps, whatever the machine's load
    first = sft.run_sft(config, world, tokenizer, tmp_path)
    assert not first.restored and first.steps == 16 and first.reproducible and first.stopped_by == "steps"
    assert first.losses[-1][1] < 0.8 * first.losses[0][1]
    assert first.model_config.vocab_size == len(tokenizer)

    again = sft.run_sft(config, world, tokenizer, tmp_path)
    assert again.restored and again.steps == 16
    for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(again.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    changed = sft.run_sft(dataclasses.replace(config, max_steps=1), world, tokenizer, tmp_path)
    assert not changed.restored and changed.steps == 1


def test_a_time_budget_is_an_opt_in_flagged_as_not_reproducible(world, tokenizer, tmp_path):
    config = sft.SFTConfig(batch_size=4, max_steps=10_000, time_budget_s=1e-3, practice_worlds=0)
    result = sft.run_sft(config, world, tokenizer, tmp_path)
    assert result.steps < 10_000 and not result.reproducible and result.stopped_by == "time_budget_s"
    again = sft.run_sft(config, world, tokenizer, tmp_path)  # reused, and still flagged
    assert again.restored and not again.reproducible


def test_a_gold_trace_that_fails_in_the_env_is_refused(world, tokenizer):
    env = sft.make_env(world, tokenizer)
    task = dict(world.questions("train")[0], golden_answers=["somewhere else"])
    with pytest.raises(ValueError, match="do not earn reward 1"):
        sft.build_sft_data(env, [task], tokenizer.pad_token_id)
