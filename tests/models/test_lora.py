"""LoRA adapters on the tiny Qwen3: the base is unchanged at init, frozen under updates, and the factors'
gradient is the dense weight gradient projected through them; the same with a frozen int8 base (QLoRA)."""

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
    quantize_base,
    trained_part,
    without_adapters,
)
from trace_jax.rollout.engine import Engine, EngineConfig

_CONFIG = ModelConfig(
    vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
)
_TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, size=(2, 7)), jnp.int32)


def _adapted(rank=4, targets="q,k,v,o,gate,up,down", base_quant="none"):
    model = create_model(_CONFIG, nnx.Rngs(0))
    config = LoRAConfig(rank=rank, alpha=8.0, targets=targets, base_quant=base_quant)
    assert add_adapters(model, config, nnx.Rngs(1)) == len(targets.split(","))
    assert quantize_base(model, config) == (0 if base_quant == "none" else len(targets.split(",")))
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


def _dense_base(base, block, proj):
    """The float32 weight a projection's base stands for: itself, or its int8 values times their scales."""
    layer = base["layers"][block]
    if f"{proj}_scale" not in layer:
        return layer[proj].value
    return layer[proj].value.astype(jnp.float32) * layer[f"{proj}_scale"].value


@pytest.mark.parametrize("base_quant", ["none", "int8"])
def test_adapter_gradient_is_dense_gradient_projected(base_quant):
    """With an int8 base the dense gradient is taken at the dequantized base plus the adapters. Mutant caught
    (int8): ``weight`` adding the adapters to the int8 values without their scales."""
    graphdef, adapters, base = nnx.split(_adapted(base_quant=base_quant), LoRAParam, nnx.Param)
    adapters = _randomized_b(adapters)
    if base_quant == "none":
        grads, base_grads = jax.grad(_loss, argnums=(1, 2))(graphdef, adapters, base)
        # Adapted projections are frozen in the forward: no gradient reaches their base weights.
        for block, projections in _PROJECTIONS.items():
            for proj in projections:
                assert not bool(jnp.any(base_grads["layers"][block][proj].value != 0)), proj
    else:  # integer storage takes no gradient at all: only the adapters are differentiated
        assert base["layers"]["attn"]["q_proj"].value.dtype == jnp.int8
        grads = jax.grad(_loss, argnums=1)(graphdef, adapters, base)
    scale = 8.0 / 4
    # The dense gradient G of the effective weights W + s A B, from a plain model holding those sums.
    plain_graphdef, merged = nnx.split(create_model(_CONFIG, nnx.Rngs(0)), nnx.Param)
    factors = {}
    for block, projections in _PROJECTIONS.items():
        for proj in projections:
            a2, b2 = _as_matrices(*(adapters["layers"][block][f"{proj}_lora_{x}"].value for x in "ab"))
            factors[block, proj] = a2, b2
            w = _dense_base(base, block, proj)
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


@pytest.mark.parametrize(
    "bad",
    [
        dict(rank=-1),
        dict(rank=4, targets="q,x"),
        dict(rank=4, targets=""),
        dict(rank=4, base_quant="fp8"),
        dict(base_quant="int8"),  # nothing to put adapters on
    ],
)
def test_bad_config_names_the_key(bad):
    with pytest.raises(ValueError, match="lora"):
        LoRAConfig(**bad)


def test_an_int4_base_is_refused_with_its_measured_error():
    with pytest.raises(ValueError, match=r"lora\.base_quant='int4' is refused: .*greedy tokens.*base_quant=int8"):
        LoRAConfig(rank=4, base_quant="int4")


# The largest logit error over the logits' standard deviation that ``python -m trace_jax.bench.qlora_error``
# measured for an int8 base on the default job's policy (0.091), rounded up: a quantized base may move the logits
# this much, and no more, beside the same adapters on the float base.
_INT8_ERROR_OVER_LOGIT_STD = 0.1


_IN_AXES = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2, "gate_proj": 1, "up_proj": 1, "down_proj": 1}


def _uneven_columns(path, x):
    """A projection's output columns scaled by factors spread over a decade (a trained model's columns differ in
    size; a random init's do not, and would not tell one scale per channel from one per tensor)."""
    name = str(path[-1])
    if name not in _IN_AXES:
        return x
    out_shape = x.shape[1 + _IN_AXES[name] :]
    return x * 10 ** jax.random.uniform(jax.random.key(len(name)), out_shape, minval=-0.5, maxval=0.5)


def test_an_int8_base_is_one_byte_a_weight_and_moves_the_logits_within_the_measured_error():
    """The abstract state (what a planner sizes) holds int8 values and float32 scales per output channel with the
    output axes' logical names; the trained part is the adapters alone; the logits stay within the bound above of
    the float base's with the same adapters (measured here: 0.073). Mutants caught: int4 values (1.60), one scale
    per tensor (0.159), the scales' output axes unnamed."""
    base = nnx.map_state(_uneven_columns, nnx.split(create_model(_CONFIG, nnx.Rngs(0)), nnx.Param)[1])
    config, params = adapt(_CONFIG, base, LoRAConfig(rank=4, alpha=8.0), 0)
    qconfig, qparams = adapt(_CONFIG, base, LoRAConfig(rank=4, alpha=8.0, base_quant="int8"), 0)
    abstract = abstract_model(qconfig)[1]
    attn = abstract["layers"]["attn"]
    assert attn["q_proj"].value.dtype == jnp.int8 and attn["q_proj"].value.shape == (2, 64, 4, 16)
    scale = attn["q_proj_scale"]
    assert (scale.value.dtype, scale.value.shape) == (jnp.float32, (2, 1, 4, 16))
    assert scale.get_metadata()["logical_axes"] == ("layers", None, "heads", "head_dim")
    shapes = lambda p: jax.tree.map(lambda x: (x.shape, x.dtype), p)
    assert shapes(qparams) == shapes(abstract)
    assert adapters_only(trained_part(qparams))  # what a checkpoint keeps and a sync sends after the first
    factors = _randomized_b(adapter_state(params))
    logits = lambda c, p: np.asarray(nnx.merge(abstract_model(c)[0], nnx.merge_state(p, factors))(_TOKENS).logits_btv)
    want, got = logits(config, params), logits(qconfig, qparams)
    error = np.abs(got - want).max() / want.std()
    assert 0 < error <= _INT8_ERROR_OVER_LOGIT_STD, error


def test_adapt_is_the_identity_at_rank_zero_and_matches_the_adapted_architecture():
    params = nnx.split(create_model(_CONFIG, nnx.Rngs(0)), nnx.Param)[1]
    same_config, same_params = adapt(_CONFIG, params, LoRAConfig(), seed=0)
    assert same_config is _CONFIG and same_params is params
    config, adapted = adapt(_CONFIG, params, LoRAConfig(rank=2, targets="q,down"), seed=0)
    assert (config.lora_rank, config.lora_targets) == (2, "q,down")
    abstract = abstract_model(config)[1]
    assert jax.tree.map(lambda x: x.shape, adapted) == jax.tree.map(lambda x: x.shape, abstract)
    assert adapter_state(adapted)["layers"]["attn"]["q_proj_lora_a"].value.shape == (2, 64, 2)


@pytest.mark.parametrize("base_quant", ["none", "int8"])
def test_a_sync_after_the_first_sends_the_adapters_alone_and_the_engine_holds_the_updated_policy(base_quant):
    """The engine takes the whole policy once, then only the factors: it ends holding what a whole-policy sync of
    the updated policy gives, its base arrays untouched (not moved again); an int8 base stays int8 there (the
    decode programs dequantize it per layer). Catches an engine that drops the base for the factors, or keeps its
    old factors."""
    lora_config = LoRAConfig(rank=2, base_quant=base_quant)
    config, params = adapt(_CONFIG, nnx.split(create_model(_CONFIG, nnx.Rngs(0)), nnx.Param)[1], lora_config, 0)
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
    assert base_before.dtype == (jnp.int8 if base_quant == "int8" else jnp.bfloat16)
    fresh = Engine.for_model(config, engine.config)
    with pytest.raises(ValueError, match="send the whole policy first"):
        fresh.set_params(sent)


@pytest.mark.parametrize("base_quant", ["none", "int8"])
def test_the_rl_update_differentiates_and_steps_the_adapters_alone(base_quant):
    """``RLTrainer.update`` on a LoRA policy: gradient accumulators the adapters' size (none for the base), the base
    (int8 values and scales with ``base_quant=int8``) bit-identical after the step, the adapters moved. Catches
    accumulators or gradients formed for the base."""
    from tests.rl.test_trainer import CONFIG, ONE_STEP, _batch, _step  # the trainer tests' tiny policy and batches
    from trace_jax.optim import make_optimizer
    from trace_jax.rl.trainer import LossConfig, RLTrainer

    base = nnx.split(create_model(CONFIG, nnx.Rngs(0)), nnx.Param)[1]
    config, params = adapt(CONFIG, base, LoRAConfig(rank=2, base_quant=base_quant), seed=0)
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
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    assert frozen(after)["layers"]["attn"]["q_proj"].value.dtype == (jnp.int8 if base_quant == "int8" else "float32")
