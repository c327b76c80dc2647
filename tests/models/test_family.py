"""Model families: the registry, ``create_model`` / ``abstract_model`` dispatch, and a family added by a test."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from trace_jax.models import MODEL_FAMILIES, ModelConfig, Qwen, abstract_model, create_model, model_family


def _leaves(state):
    return jax.tree_util.tree_leaves_with_path(state)


def test_registry_lists_the_qwen_families():
    assert {"qwen2", "qwen3"} <= set(MODEL_FAMILIES)
    assert MODEL_FAMILIES["qwen2"] is Qwen and MODEL_FAMILIES["qwen3"] is Qwen
    assert model_family(ModelConfig.preset("qwen2-tiny")) == "qwen2"
    assert model_family(ModelConfig.preset("qwen3-tiny")) == "qwen3"


def test_create_model_is_qwen_param_for_param():
    config = ModelConfig.preset("qwen3-tiny")
    assert config.family == "qwen3"
    ours = nnx.state(create_model(config, nnx.Rngs(0)), nnx.Param)
    reference = nnx.state(Qwen(config, rngs=nnx.Rngs(0)), nnx.Param)
    other_seed = nnx.state(Qwen(config, rngs=nnx.Rngs(1)), nnx.Param)
    # Premise: the comparison below can tell two initialisations apart.
    assert any(not np.array_equal(a, b) for (_, a), (_, b) in zip(_leaves(reference), _leaves(other_seed), strict=True))
    assert jax.tree_util.tree_structure(ours) == jax.tree_util.tree_structure(reference)
    for (path, a), (_, b) in zip(_leaves(ours), _leaves(reference), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, path
        assert np.array_equal(a, b), path


def _qwen_split(config):
    return nnx.split(nnx.eval_shape(lambda: Qwen(config, rngs=nnx.Rngs(0))), nnx.Param)


@pytest.mark.parametrize("preset", ["qwen2-tiny", "qwen3-tiny"])
def test_abstract_model_matches_the_qwen_one(preset):
    config = ModelConfig.preset(preset)
    graphdef, params = abstract_model(config)
    reference_graphdef, reference_params = _qwen_split(config)
    # Premise: graphdefs of different architectures compare unequal.
    flipped = dataclasses.replace(config, tie_word_embeddings=not config.tie_word_embeddings)
    assert reference_graphdef != _qwen_split(flipped)[0]
    assert graphdef == reference_graphdef
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(reference_params)
    for (path, a), (_, b) in zip(_leaves(params), _leaves(reference_params), strict=True):
        assert (a.shape, a.dtype) == (b.shape, b.dtype), path
    axes = [v.get_metadata()["logical_axes"] for v in jax.tree_util.tree_leaves(params, is_leaf=_is_param)]
    reference_axes = [
        v.get_metadata()["logical_axes"] for v in jax.tree_util.tree_leaves(reference_params, is_leaf=_is_param)
    ]
    assert axes and axes == reference_axes


def _is_param(x):
    return isinstance(x, nnx.Variable)


@dataclasses.dataclass(frozen=True)
class _ConfigOf(ModelConfig):
    """A config naming any family (the way a new family's config does: a subclass overriding ``family``)."""

    family_name: str = "qwen3"

    @property
    def family(self) -> str:
        return self.family_name


def test_unknown_family_is_a_clear_error():
    config = _ConfigOf(**dataclasses.asdict(ModelConfig.preset("qwen3-tiny")), family_name="no_such_family")
    assert "no_such_family" not in MODEL_FAMILIES
    with pytest.raises(ValueError, match=r"unknown model family 'no_such_family'; choose one of") as raised:
        create_model(config, nnx.Rngs(0))
    assert "qwen2" in str(raised.value) and "qwen3" in str(raised.value)
    with pytest.raises(ValueError, match=r"unknown model family 'no_such_family'"):
        abstract_model(config)


class _Bigram(nnx.Module):
    """A one-table language model: logits of the next token from the current one."""

    def __init__(self, config, *, rngs: nnx.Rngs):
        self.config = config
        self.table = nnx.Param(jax.random.normal(rngs.params(), (config.vocab_size, config.vocab_size)))

    def __call__(self, tokens_bt):
        return self.table.value[tokens_bt]


@pytest.fixture
def bigram_family():
    name = "test_bigram"
    assert name not in MODEL_FAMILIES
    MODEL_FAMILIES.register(name)(_Bigram)
    try:
        yield name
    finally:
        MODEL_FAMILIES.pop(name)


def test_a_registered_family_is_what_create_and_abstract_build(bigram_family):
    config = _ConfigOf(**dataclasses.asdict(ModelConfig.preset("qwen3-tiny")), family_name=bigram_family)
    assert model_family(config) == bigram_family
    model = create_model(config, nnx.Rngs(0))
    assert type(model) is _Bigram and not isinstance(model, Qwen)
    assert model(np.array([[1, 2]])).shape == (1, 2, config.vocab_size)
    graphdef, params = abstract_model(config)
    assert {str(k) for k in params} == {"table"}
    assert params["table"].value.shape == (config.vocab_size, config.vocab_size)
    assert isinstance(nnx.merge(graphdef, nnx.state(model, nnx.Param)), _Bigram)
    # The Qwen families are untouched by the new one.
    assert type(create_model(ModelConfig.preset("qwen3-tiny"), nnx.Rngs(0))) is Qwen
