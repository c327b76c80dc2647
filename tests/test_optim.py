import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from trace_jax.optim import OptimizerConfig, all_finite, guarded_update, make_optimizer, make_schedule


def _params():
    return {"w": jnp.ones((3, 2)), "b": jnp.ones((2,))}


def test_schedule_warms_up_then_decays():
    schedule = make_schedule(learning_rate=1.0, warmup_steps=4, total_steps=20, schedule="cosine")
    lrs = np.array([float(schedule(i)) for i in range(21)])
    assert lrs[0] == 0.0
    assert np.all(np.diff(lrs[:5]) > 0) and lrs[4] == pytest.approx(1.0)
    assert np.all(np.diff(lrs[4:]) <= 1e-7) and lrs[20] == pytest.approx(0.1)
    constant = make_schedule(learning_rate=0.5, warmup_steps=2, total_steps=10, schedule="constant")
    assert [float(constant(i)) for i in (0, 1, 2, 9)] == pytest.approx([0.0, 0.25, 0.5, 0.5])
    # The constant schedule does not depend on the run's length.
    longer = make_schedule(learning_rate=0.5, warmup_steps=2, total_steps=1000, schedule="constant")
    assert [float(longer(i)) for i in range(20)] == [float(constant(i)) for i in range(20)]


def test_config_and_kwargs_agree_and_kwargs_override():
    config = OptimizerConfig(learning_rate=0.1, warmup_steps=0, total_steps=10)
    grads = {"w": jnp.full((3, 2), 0.5), "b": jnp.full((2,), 0.5)}
    out = []
    for tx in (make_optimizer(config), make_optimizer(learning_rate=0.1, warmup_steps=0, total_steps=10)):
        updates, _ = tx.update(grads, tx.init(_params()), _params())
        out.append(updates["w"])
    np.testing.assert_allclose(out[0], out[1])
    tx = make_optimizer(config, learning_rate=0.0)
    updates, _ = tx.update(grads, tx.init(_params()), _params())
    assert float(jnp.abs(updates["w"]).max()) == 0.0


def test_unknown_field_or_schedule_is_a_clear_error():
    with pytest.raises(ValueError, match="learning_rat"):
        make_optimizer(learning_rat=1.0)
    with pytest.raises(ValueError, match="cosine"):
        make_optimizer(schedule="cosin")


def test_weight_decay_only_on_matrices():
    tx = make_optimizer(learning_rate=0.1, weight_decay=0.5, max_grad_norm=None, schedule="constant")
    zeros = jax.tree.map(jnp.zeros_like, _params())
    updates, _ = tx.update(zeros, tx.init(_params()), _params())
    assert float(jnp.abs(updates["w"]).min()) > 0  # decayed
    assert float(jnp.abs(updates["b"]).max()) == 0  # not decayed


def test_clipping_bounds_the_gradient_norm():
    # A huge eps makes Adam's step proportional to the gradient, so clipping becomes visible:
    # two gradients along the same direction but of different norms (both > max_grad_norm) give one update.
    def update(scale, max_grad_norm):
        tx = make_optimizer(learning_rate=1.0, max_grad_norm=max_grad_norm, schedule="constant", eps=1e6)
        grads = jax.tree.map(lambda x: scale * x, _params())
        return tx.update(grads, tx.init(_params()), _params())[0]["w"]

    np.testing.assert_allclose(update(100.0, 1.0), update(200.0, 1.0), rtol=1e-6)
    assert not np.allclose(update(100.0, None), update(200.0, None), rtol=1e-3)


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
def test_guard_skips_non_finite_grads_and_keeps_state(bad):
    tx = make_optimizer(learning_rate=0.1, warmup_steps=0, total_steps=10)
    params = _params()
    state = tx.init(params)
    step = jax.jit(lambda g, s, p, loss: guarded_update(tx, g, s, p, loss))
    good = {"w": jnp.ones((3, 2)), "b": jnp.ones((2,))}
    applied = step(good, state, params, jnp.asarray(1.0))
    assert bool(applied.finite)
    assert not np.allclose(applied.params["w"], params["w"])
    poisoned = {"w": good["w"].at[0, 0].set(bad), "b": good["b"]}
    skipped = step(poisoned, applied.opt_state, applied.params, jnp.asarray(1.0))
    assert not bool(skipped.finite)
    for new, old in zip(jax.tree.leaves(skipped), jax.tree.leaves(applied[:2]), strict=False):
        np.testing.assert_array_equal(new, old)
    # A non-finite loss alone also skips.
    skipped = step(good, applied.opt_state, applied.params, jnp.asarray(bad))
    assert not bool(skipped.finite)
    np.testing.assert_array_equal(skipped.params["w"], applied.params["w"])


def test_all_finite():
    assert bool(all_finite({"a": jnp.ones(2)}, [jnp.zeros(3)]))
    assert not bool(all_finite({"a": jnp.array([1.0, jnp.nan])}))


def test_float32_master_weights_keep_small_bf16_updates_from_rounding_away():
    params = {"w": jnp.ones((4, 4), jnp.bfloat16)}
    grads = {"w": jnp.ones((4, 4), jnp.bfloat16)}

    def train(tx, steps=100):
        def step(_, carry):
            p, s = carry
            updates, s = tx.update(grads, s, p)
            return optax.apply_updates(p, updates), s

        return jax.jit(lambda p: jax.lax.fori_loop(0, steps, step, (p, tx.init(p))))(params)

    kwargs = dict(learning_rate=1e-4, schedule="constant", max_grad_norm=None, total_steps=100)
    plain, _ = train(make_optimizer(**kwargs))
    mastered, state = train(make_optimizer(**kwargs, master_dtype="float32"))
    assert plain["w"].dtype == mastered["w"].dtype == jnp.bfloat16
    assert float(plain["w"][0, 0]) == 1.0  # each 1e-4 step rounds away in bf16 (spacing 2^-8 below 1)
    master = state.master["w"]
    assert master.dtype == jnp.float32 and float(master[0, 0]) == pytest.approx(1 - 100 * 1e-4, rel=1e-3)
    assert float(mastered["w"][0, 0]) == float(master[0, 0].astype(jnp.bfloat16)) < 1.0
    mu = optax.tree_utils.tree_get(state, "mu")["w"]
    assert mu.dtype == jnp.float32
