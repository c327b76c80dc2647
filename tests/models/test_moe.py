"""Qwen3-MoE against transformers on tiny random checkpoints; grouped vs dense experts; the aux loss; presets."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from tests.helpers import build_hf_checkpoint, torch_logits
from trace_jax.checkpoint.hf import load_hf
from trace_jax.models import (
    PRESETS,
    KVCache,
    ModelConfig,
    MoeConfig,
    QwenMoe,
    abstract_model,
    config_from_dict,
    config_to_dict,
    create_model,
    num_params,
    router_aux_loss,
)
from trace_jax.rollout.engine.engine import Engine, EngineConfig
from trace_jax.rollout.engine.sampling import SamplingConfig

# Top-k 2 and 8, norm_topk_prob on and off, all-sparse and mixed dense/sparse layers, tied and untied heads.
CASES = {
    "top2-norm-allsparse-tied": dict(tie_word_embeddings=True, norm_topk_prob=True),
    "top8-nonorm-firstdense-untied": dict(
        tie_word_embeddings=False,
        num_experts=8,
        num_experts_per_tok=8,
        norm_topk_prob=False,
        num_hidden_layers=3,
        mlp_only_layers=[0],
    ),
    "top2-nonorm-step2-untied": dict(
        tie_word_embeddings=False, norm_topk_prob=False, num_hidden_layers=4, decoder_sparse_step=2
    ),
}


def load_model(hf_dir, **overrides):
    config, params = load_hf(hf_dir, **overrides)
    return nnx.merge(abstract_model(config)[0], params)


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return path, build_hf_checkpoint(path, "qwen3_moe", **CASES[request.param])


def test_logits_match_transformers(checkpoint):
    path, reference = checkpoint
    model = load_model(path)
    config = model.config
    assert isinstance(model, QwenMoe) and config.family == "qwen3_moe"
    # Premise: the case has the layer kinds and gate settings it is named for (mutant: a config field ignored).
    hf_sparse = tuple(i for i, layer in enumerate(reference.model.layers) if hasattr(layer.mlp, "gate"))
    assert config.sparse_layers == hf_sparse
    assert config.norm_topk_prob == reference.config.norm_topk_prob
    ids = np.random.default_rng(0).integers(0, 128, (3, 11))
    ours = np.asarray(model(jnp.asarray(ids)).logits_btv)
    assert np.abs(ours - torch_logits(reference, ids)).max() <= 1e-4


def test_aux_loss_matches_transformers(checkpoint):
    """Catches a load-balancing loss over the wrong rows (per layer instead of pooled) or without the E factor."""
    path, reference = checkpoint
    model = load_model(path)
    ids = np.random.default_rng(1).integers(0, 128, (2, 9))
    _, _, (stats, _) = model.forward_hidden(jnp.asarray(ids))
    with torch.no_grad():
        want = reference(torch.tensor(ids), output_router_logits=True).aux_loss.item()
    assert want > 1.0  # premise: a non-trivial value (1.0 is perfect balance)
    assert float(stats.tokens) == ids.size * len(model.config.sparse_layers)
    assert abs(float(router_aux_loss(stats)) - want) <= 1e-5


@pytest.mark.parametrize("checkpoint", ["top2-nonorm-step2-untied"], indirect=True)
def test_decoding_through_the_cache_equals_one_forward(checkpoint):
    """Each layer writes its own KV-cache row in a mixed model (mutant: stack-relative cache rows)."""
    path, _ = checkpoint
    model = load_model(path)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 128, (2, 7)))
    full = model(ids).logits_btv
    out = model(ids[:, :4], cache=KVCache.init(model.config, batch=2, max_len=8))
    steps = [out.logits_btv]
    for t in range(4, 7):
        out = model(ids[:, t : t + 1], cache=out.cache)
        steps.append(out.logits_btv)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5)


def _loss_and_grads(config, tokens, weights):
    model = create_model(config, nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(params):
        logits = nnx.merge(graphdef, params)(tokens).logits_btv
        return jnp.sum(logits * weights)

    return jax.value_and_grad(loss)(params)


def test_grouped_experts_equal_the_dense_reference_in_values_and_gradients():
    """Catches a grouped path that mis-sorts tokens, drops a choice or cuts the gates' gradient."""
    config = dataclasses.replace(PRESETS["qwen3-moe-tiny"], vocab_size=64, mlp_only_layers=(0,), num_layers=3)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 64, (2, 6)))
    weights = jnp.asarray(np.random.default_rng(4).normal(size=(2, 6, 64)), jnp.float32)
    grouped_loss, grouped = _loss_and_grads(config, tokens, weights)
    dense_loss, dense = _loss_and_grads(dataclasses.replace(config, expert_compute="dense"), tokens, weights)
    np.testing.assert_allclose(grouped_loss, dense_loss, rtol=1e-5)
    router_grad = grouped["moe_layers"]["mlp"]["router"].value
    assert np.abs(np.asarray(router_grad)).max() > 1e-4  # premise: the router learns through the gates
    for (path, a), (_, b) in zip(
        jax.tree_util.tree_leaves_with_path(grouped), jax.tree_util.tree_leaves_with_path(dense), strict=True
    ):
        # Summation order differs (sorted groups vs one einsum): float32 noise relative to the leaf's scale.
        scale = float(np.abs(np.asarray(b)).max())
        np.testing.assert_allclose(a, b, atol=1e-5 * scale, rtol=1e-4, err_msg=jax.tree_util.keystr(path))


def test_param_tree_has_two_stacks_and_an_expert_axis():
    config = dataclasses.replace(PRESETS["qwen3-moe-tiny"], num_layers=3, mlp_only_layers=(1,))
    _, params = abstract_model(config)
    assert set(params) == {"embed", "dense_layers", "moe_layers", "final_norm"}
    assert params["dense_layers"]["mlp"]["up_proj"].value.shape == (1, 64, 128)
    gate = params["moe_layers"]["mlp"]["gate_proj"]
    assert gate.value.shape == (2, 4, 64, 32)
    assert gate.get_metadata()["logical_axes"] == ("layers", "expert", "embed", "mlp")
    assert config.layer_stacks() == {"dense_layers": (1,), "moe_layers": (0, 2)}
    built = sum(x.size for x in jax.tree.leaves(params))
    assert num_params(config) == built


def test_config_round_trips_through_hf_json_and_model_config_json():
    config = dataclasses.replace(PRESETS["qwen3-moe-tiny"], mlp_only_layers=(1,), decoder_sparse_step=1)
    assert ModelConfig.from_hf(config.to_hf()) == config
    # model_config.json (json turns the tuple into a list) names the family, so the MoE class comes back.
    again = config_from_dict(json.loads(json.dumps(config_to_dict(config))))
    assert type(again) is MoeConfig and again == config
    dense = PRESETS["qwen3-tiny"]
    assert config_from_dict(dataclasses.asdict(dense)) == dense  # files written without a family stay dense


def test_the_checkpoints_load_balancing_coefficient_is_carried_under_its_own_name():
    """config.json's ``router_aux_loss_coef`` is ``MoeConfig.hf_router_aux_loss_coef`` (one name, one meaning: the
    RL loss's weight is ``LossConfig.router_aux_loss_coef``), back under the HF name on export; a
    model_config.json written with the old field name still loads."""
    config = dataclasses.replace(PRESETS["qwen3-moe-tiny"], hf_router_aux_loss_coef=0.02)
    hf = config.to_hf()
    assert hf["router_aux_loss_coef"] == 0.02 and "hf_router_aux_loss_coef" not in hf
    assert ModelConfig.from_hf(hf).hf_router_aux_loss_coef == 0.02
    old = config_to_dict(config)
    old["router_aux_loss_coef"] = old.pop("hf_router_aux_loss_coef")
    assert config_from_dict(old) == config


# Published sizes (billions: total / active per token).
PUBLISHED = {"qwen3-30b-a3b": (30.5, 3.3), "qwen3-235b-a22b": (235, 22)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_moe_preset_sizes_match_published(name):
    total, active = PUBLISHED[name]
    config = PRESETS[name]
    assert abs(num_params(config) / 1e9 - total) / total < 0.01
    assert abs(config.active_params() / 1e9 - active) / active < 0.03


def test_bad_moe_configs_are_clear_errors():
    with pytest.raises(ValueError, match="num_experts_per_tok=5"):
        ModelConfig.preset("qwen3-moe-tiny", num_experts_per_tok=5)
    with pytest.raises(ValueError, match="mlp_only_layers"):
        ModelConfig.preset("qwen3-moe-tiny", mlp_only_layers=(7,))
    with pytest.raises(ValueError, match="expert_compute"):
        ModelConfig.preset("qwen3-moe-tiny", expert_compute="sparse")


def test_the_paged_engine_decodes_greedily_like_transformers_generate(tmp_path):
    """The engine's paged cache and decode loop run the MoE (mutant: a layer reading another's cache rows)."""
    reference = build_hf_checkpoint(tmp_path, "qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1])
    config, params = load_hf(tmp_path)
    engine_config = EngineConfig(
        max_slots=2, max_len=32, steps_per_call=8, max_turn_tokens=8, length_buckets=(32,), row_buckets=(2,),
        sampling=SamplingConfig.make_greedy(), weight_dtype=None,
    )  # fmt: skip
    engine = Engine(abstract_model(config)[0], config, engine_config)
    engine.set_params(params)
    prompts = [[5, 17, 3, 99, 42, 8, 1], [64, 2]]
    state, _ = engine.insert(None, engine.init_decode_state(), prompts, [0, 1], [0, 0])
    _, out = engine.generate(None, state)
    for slot, prompt in enumerate(prompts):
        with torch.no_grad():
            ids = reference.generate(
                torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        assert out.tokens[slot, : out.num_tokens[slot]].tolist() == ids[0, len(prompt) :].tolist()
