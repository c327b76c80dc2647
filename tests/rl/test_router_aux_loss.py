"""The trainer's load-balancing term against transformers' ``load_balancing_loss_func`` (Qwen3-MoE): one optimizer
step over padded rows cut into micro-batches adds ``coef x`` the loss of the whole step's non-padding tokens, in
value and in gradient, under every loss aggregation."""

import jax
import numpy as np
import optax
import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from tests.helpers import build_hf_checkpoint
from trace_jax.checkpoint.hf import load_hf
from trace_jax.models import abstract_model
from trace_jax.rl.advantages import compute_advantages
from trace_jax.rl.batch import BatchConfig, build_batch
from trace_jax.rl.losses import AGGREGATIONS, LossConfig
from trace_jax.rl.trainer import RLTrainer, UpdateConfig
from trace_jax.rollout.tree import ROOT, RolloutTree

LENGTH = 16  # row length: every row below is shorter, so each is padded


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(our config, our params, transformers' model) of one random tiny Qwen3-MoE (2 sparse layers, 4 experts)."""
    path = tmp_path_factory.mktemp("moe")
    reference = build_hf_checkpoint(path, "qwen3_moe", norm_topk_prob=True)
    config, params = load_hf(path)
    return config, params, reference


def _trees(seed=0):
    """Six one-turn trees of unequal lengths (prompt 2-5 tokens, 2-7 sampled), rewards mixed in each group."""
    rng = np.random.default_rng(seed)
    trees = []
    for task in range(3):
        tree = RolloutTree(rng.integers(2, 128, size=int(rng.integers(2, 6))), task=task)
        for reward in (1.0, 0.0):
            n = int(rng.integers(2, 8))
            tree.add_turn(ROOT, rng.integers(2, 128, size=n), sample_logprobs=-rng.random(n) - 1.0, reward=reward)
        trees.append(tree)
    return trees


def _batch(loss_config):
    trees = _trees()
    config = BatchConfig(layout="paths", length_buckets=(LENGTH,), row_buckets=None, skip_zero_advantage=False)
    batch, _ = build_batch(trees, compute_advantages("grpo", trees), config, loss_config)
    return batch


def _step(config, params, loss_config, batch):
    """One optimizer step (SGD, learning rate 1) over micro-batches of 2 rows: (new params, metrics)."""
    graphdef = abstract_model(config)[0]
    update = UpdateConfig(ppo_epochs=1, mini_batches=1, micro_rows=2)
    trainer = RLTrainer(graphdef, optax.sgd(1.0), loss_config, update=update)
    state = trainer.init_state(jax.tree.map(lambda x: x.copy(), params), jax.random.key(0))
    state, metrics = trainer.update(state, batch)
    assert metrics["micro_batches"] == 3  # premise: the step's statistics span micro-batches
    return state.params, metrics


def _transformers_aux(reference, batch, grad=False):
    """transformers' load-balancing loss of the batch's rows (its forward, its attention mask for the padding),
    and with ``grad`` the gradient of that loss on each sparse layer's router ([layers, d, E], ours' layout)."""
    lengths = np.asarray(batch.lengths)
    ids = torch.tensor(np.asarray(batch.tokens), dtype=torch.long)
    mask = torch.tensor(np.arange(ids.shape[1])[None] < lengths[:, None], dtype=torch.long)
    reference.zero_grad()
    with torch.set_grad_enabled(grad):
        out = reference(ids, attention_mask=mask, output_router_logits=True)
        config = reference.config
        aux = load_balancing_loss_func(out.router_logits, config.num_experts, config.num_experts_per_tok, mask)
        if not grad:
            return float(aux)
        aux.backward()
    routers = [layer.mlp.gate.weight.grad.numpy().T for layer in reference.model.layers]
    return float(aux.detach()), np.stack(routers)


def test_the_logged_load_balancing_loss_is_transformers_over_the_steps_non_padding_tokens(checkpoint):
    """Mutant M5 (the statistics count padding tokens: the block's token mask ignored) fails here: transformers
    with the attention mask leaves the padding out. So does a loss averaged over micro-batches instead of pooled."""
    config, params, reference = checkpoint
    batch = _batch(LossConfig())
    lengths = np.asarray(batch.lengths)
    assert (lengths < LENGTH).all() and len(set(lengths.tolist())) > 2  # premise: padded rows of unequal lengths
    want = _transformers_aux(reference, batch)
    with torch.no_grad():
        unmasked = reference(torch.tensor(np.asarray(batch.tokens)), output_router_logits=True).aux_loss.item()
    assert abs(unmasked - want) > 1e-3  # premise: counting the padding changes the value
    _, metrics = _step(config, params, LossConfig(), batch)
    assert metrics["router_aux_loss"] == pytest.approx(want, abs=2e-6)


@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
def test_the_coefficient_adds_exactly_coef_times_transformers_loss_under_every_aggregation(checkpoint, aggregation):
    """Under each aggregation (Dr. GRPO's ``seq-mean-token-sum-norm`` included) the step's loss with coef c is the
    loss with coef 0 plus c x transformers' loss of the step, and the router's update differs by c x the gradient of
    transformers' loss (SGD, learning rate 1). Fails if the term is divided by the policy loss's denominator (its
    weight then depends on the aggregation: ~100x smaller under Dr. GRPO), weighted by each micro-batch's trained
    tokens, or computed per micro-batch (different f_e, different gradient)."""
    config, params, reference = checkpoint
    coef = 0.5
    off = LossConfig(aggregation=aggregation, norm_length=LENGTH)
    on = LossConfig(aggregation=aggregation, norm_length=LENGTH, router_aux_loss_coef=coef)
    batch = _batch(off)
    want, want_grad = _transformers_aux(reference, batch, grad=True)
    params_off, metrics_off = _step(config, params, off, batch)
    params_on, metrics_on = _step(config, params, on, batch)
    assert metrics_on["loss"] - metrics_off["loss"] == pytest.approx(coef * want, abs=2e-6)
    moved = lambda p: np.asarray(p["moe_layers"]["mlp"]["router"].value)
    delta = moved(params_off) - moved(params_on)  # = coef x the gradient of the load-balancing loss
    assert np.abs(want_grad).max() > 1e-3  # premise: the router gets a gradient from the loss
    np.testing.assert_allclose(delta, coef * want_grad, atol=2e-6, rtol=1e-4)
