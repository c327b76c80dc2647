"""LoRA adapters on the tiny Qwen3: the base is unchanged at init, frozen under updates, and the factors'
gradient is the dense weight gradient projected through them."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from trace_jax.models import ModelConfig, abstract_model, adapt, create_model
from trace_jax.models.lora import (
    LoRAConfig,
    LoRAParam,
    adapter_state,
    adapters_only,
    add_adapters,
    frozen_base,
    trained_part,
    without_adapters,
)
from trace_jax.rollout.engine import Engine, EngineConfig

_CONFIG = ModelConfig(
    vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
)
_TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, size=(2, 7)), jnp.int32)


def _adapted(rank=4, targets="q,k,v,o,gate,up,down"):
    model = create_model(_CONFIG, nnx.Rngs(0))
    assert add_adapters(model, LoRAConfig(rank=rank, alpha=8.0, targets=targets), nnx.Rngs(1)) == len(
        targets.split(",")
    )
    return model


def _loss(graphdef, adapters, base):
    logits = nnx.merge(graphdef, adapters, base)(_TOKENS).logits_btv
    return jnp.mean(jax.nn.log_softmax(logits)[..., 3])


def _randomized_b(adapters):
    """Adapters with nonzero B (a zero B makes dL/dA vanish and the identity trivial)."""
    keys = iter(jax.random.split(jax.random.key(2), 64))
    return jax.tree.map(lambda x: x + 0.1 * jax.random.normal(next(keys), x.shape), adapters)


def test_rank_zero_adds_nothing():
    model = create_model(_CONFIG, nnx.Rngs(0))
    assert add_adapters(model, LoRAConfig(), nnx.Rngs(1)) == 0
    assert not nnx.state(model, LoRAParam)


def test_fresh_adapters_leave_outputs_unchanged():
    plain = create_model(_CONFIG, nnx.Rngs(0))(_TOKENS).logits_btv
    adapted = _adapted()(_TOKENS).logits_btv
    np.testing.assert_array_equal(np.asarray(adapted), np.asarray(plain))


_PROJECTIONS = {"attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def _as_matrices(a, b):
    """``A [l, *in, r]``, ``B [l, r, *out]`` as ``[l, In, r]``, ``[l, r, Out]``."""
    return a.reshape(a.shape[0], -1, a.shape[-1]), b.reshape(b.shape[0], b.shape[1], -1)


def test_adapter_gradient_is_dense_gradient_projected():
    graphdef, adapters, base = nnx.split(_adapted(), LoRAParam, nnx.Param)
    adapters = _randomized_b(adapters)
    grads, base_grads = jax.grad(_loss, argnums=(1, 2))(graphdef, adapters, base)
    # Adapted projections are frozen in the forward: no gradient reaches their base weights.
    for block, projections in _PROJECTIONS.items():
        for proj in projections:
            assert not bool(jnp.any(base_grads["layers"][block][proj].value != 0)), proj
    scale = 8.0 / 4
    # The dense gradient G of the effective weights W + s A B, from a plain model holding those sums.
    plain_graphdef, merged = nnx.split(create_model(_CONFIG, nnx.Rngs(0)), nnx.Param)
    factors = {}
    for block, projections in _PROJECTIONS.items():
        for proj in projections:
            a2, b2 = _as_matrices(*(adapters["layers"][block][f"{proj}_lora_{x}"].value for x in "ab"))
            factors[block, proj] = a2, b2
            w = base["layers"][block][proj].value
            merged["layers"][block][proj].value = w + scale * jnp.einsum("lir,lro->lio", a2, b2).reshape(w.shape)
    dense = jax.grad(lambda p: _loss(plain_graphdef, p, nnx.State({})))(merged)
    for (block, proj), (a2, b2) in factors.items():
        g = dense["layers"][block][proj].value.reshape(a2.shape[0], a2.shape[1], b2.shape[2])
        want = {"a": scale * jnp.einsum("lio,lro->lir", g, b2), "b": scale * jnp.einsum("lir,lio->lro", a2, g)}
        for x, want_x in want.items():
            got = grads["layers"][block][f"{proj}_lora_{x}"].value.reshape(want_x.shape)
            assert float(jnp.abs(want_x).max()) > 0  # premise: a gradient to compare
            rel = float(jnp.linalg.norm(got - want_x) / jnp.linalg.norm(want_x))
            assert rel <= 1e-5, (proj, x, rel)


def test_updates_leave_base_bit_identical():
    model = _adapted()
    graphdef, params = nnx.split(model, nnx.Param)
    optimizer = frozen_base(optax.adamw(1e-2, weight_decay=0.1), params)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state):
        grads = jax.grad(lambda p: jnp.mean(jax.nn.log_softmax(nnx.merge(graphdef, p)(_TOKENS).logits_btv)[..., 3]))(
            params
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    before = params
    for _ in range(3):
        params, opt_state = step(params, opt_state)
    moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), adapter_state(params), adapter_state(before))
    assert any(jax.tree.leaves(moved))  # premise: the adapters trained
    base_before = before.filter(lambda path, _: not str(path[-1]).endswith(("_lora_a", "_lora_b")))
    base_after = params.filter(lambda path, _: not str(path[-1]).endswith(("_lora_a", "_lora_b")))
    for x, y in zip(jax.tree.leaves(base_before), jax.tree.leaves(base_after), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # Optimizer moments exist for the adapters alone.
    moments = sum(x.size for x in jax.tree.leaves(opt_state) if hasattr(x, "size") and x.ndim > 0)
    assert moments == 2 * sum(x.size for x in jax.tree.leaves(adapter_state(params)))
    # The reference (adapters off) computes what the base model does.
    reference = nnx.merge(graphdef, without_adapters(params))(_TOKENS).logits_btv
    plain = create_model(_CONFIG, nnx.Rngs(0))(_TOKENS).logits_btv
    np.testing.assert_array_equal(np.asarray(reference), np.asarray(plain))


@pytest.mark.parametrize("bad", [dict(rank=-1), dict(rank=4, targets="q,x"), dict(rank=4, targets="")])
def test_bad_config_names_the_key(bad):
    with pytest.raises(ValueError, match="lora"):
        LoRAConfig(**bad)


def test_adapt_is_the_identity_at_rank_zero_and_matches_the_adapted_architecture():
    params = nnx.split(create_model(_CONFIG, nnx.Rngs(0)), nnx.Param)[1]
    same_config, same_params = adapt(_CONFIG, params, LoRAConfig(), seed=0)
    assert same_config is _CONFIG and same_params is params
    config, adapted = adapt(_CONFIG, params, LoRAConfig(rank=2, targets="q,down"), seed=0)
    assert (config.lora_rank, config.lora_targets) == (2, "q,down")
    abstract = abstract_model(config)[1]
    assert jax.tree.map(lambda x: x.shape, adapted) == jax.tree.map(lambda x: x.shape, abstract)
    assert adapter_state(adapted)["layers"]["attn"]["q_proj_lora_a"].value.shape == (2, 64, 2)


def test_a_sync_after_the_first_sends_the_adapters_alone_and_the_engine_holds_the_updated_policy():
    """The engine takes the whole policy once, then only the factors: it ends holding what a whole-policy sync of
    the updated policy gives, its base arrays untouched (not moved again). Catches an engine that drops the base
    for the factors, or keeps its old factors."""
    config, params = adapt(_CONFIG, nnx.split(create_model(_CONFIG, nnx.Rngs(0)), nnx.Param)[1], LoRAConfig(rank=2), 0)
    engine = Engine.for_model(config, EngineConfig(max_slots=2, max_len=16, page_size=8, weight_dtype="bfloat16"))
    engine.set_params(params)
    base_before = engine.params["layers"]["attn"]["q_proj"].value
    updated = nnx.merge_state(params, _randomized_b(adapter_state(params)))
    sent = trained_part(updated)
    assert adapters_only(sent) and 0 < len(jax.tree.leaves(sent)) < len(jax.tree.leaves(updated))  # premise
    held = engine.set_params(sent)
    want = Engine.for_model(config, engine.config).set_params(updated)
    for got, expected in zip(jax.tree.leaves(held), jax.tree.leaves(want), strict=True):
        assert got.dtype == expected.dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(expected, np.float32))
    assert held["layers"]["attn"]["q_proj"].value is base_before
    fresh = Engine.for_model(config, engine.config)
    with pytest.raises(ValueError, match="send the whole policy first"):
        fresh.set_params(sent)


def test_the_rl_update_differentiates_and_steps_the_adapters_alone():
    """``RLTrainer.update`` on a LoRA policy: gradient accumulators the adapters' size (none for the base), the base
    bit-identical after the step, the adapters moved. Catches accumulators or gradients formed for the base."""
    from tests.rl.test_trainer import CONFIG, ONE_STEP, _batch, _step  # the trainer tests' tiny policy and batches
    from trace_jax.optim import make_optimizer
    from trace_jax.rl.trainer import LossConfig, RLTrainer

    base = nnx.split(create_model(CONFIG, nnx.Rngs(0)), nnx.Param)[1]
    config, params = adapt(CONFIG, base, LoRAConfig(rank=2), seed=0)
    params = nnx.merge_state(params, _randomized_b(adapter_state(params)))  # a zero B leaves A without gradient
    optimizer = make_optimizer(learning_rate=1e-2, warmup_steps=0, total_steps=10, schedule="constant")
    trainer = RLTrainer(abstract_model(config)[0], frozen_base(optimizer, params), LossConfig(), update=ONE_STEP)
    batch = _batch(seed=0)
    accumulators = jax.eval_shape(trainer._zero_acc, params, jax.tree.map(jnp.asarray, batch))[1]
    adapter_sizes = sorted(x.size for x in jax.tree.leaves(adapter_state(params)))
    assert sorted(x.size for x in jax.tree.leaves(accumulators)) == adapter_sizes
    before = jax.device_get(params)
    state, metrics = _step(trainer, trainer.init_state(params, jax.random.key(0)), batch)
    assert metrics["update_applied"] == 1.0 and metrics["grad_norm"] > 0
    after = jax.device_get(state.params)
    moved = [
        not np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(adapter_state(after)), jax.tree.leaves(adapter_state(before)), strict=True)
    ]
    assert all(moved)
    frozen = lambda p: p.filter(lambda path, _: not str(path[-1]).endswith(("_lora_a", "_lora_b")))
    for a, b in zip(jax.tree.leaves(frozen(after)), jax.tree.leaves(frozen(before)), strict=True):
        np.testing.assert_array_equal(a, b)
