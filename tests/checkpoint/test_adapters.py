"""PEFT export of a LoRA policy: peft loads the adapters onto the transformers base and computes our logits; the
merged export is a plain HF model computing the same."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
from flax import nnx
from transformers import AutoModelForCausalLM

from tests.helpers import build_hf_checkpoint, torch_logits
from trace_jax.checkpoint import adapters
from trace_jax.checkpoint.hf import load_hf
from trace_jax.models import abstract_model, adapt
from trace_jax.models.lora import LoRAConfig, adapter_state

# Qwen3-MoE as released: every layer sparse (attention adapted, the experts not).
_FAMILIES = {"qwen3": {}, "qwen3_moe": {}}


def _trained_lora_policy(hf_dir, base_quant="none"):
    """The HF checkpoint's policy with rank-4 adapters on every target, both factors random (a zero B would make
    a transposed A or a missing scale invisible)."""
    config, params = load_hf(hf_dir)
    config, params = adapt(config, params, LoRAConfig(rank=4, alpha=8.0, base_quant=base_quant), seed=0)
    keys = iter(jax.random.split(jax.random.key(1), 64))
    factors = jax.tree.map(lambda x: 0.05 * jax.random.normal(next(keys), x.shape, x.dtype), adapter_state(params))
    return config, nnx.merge_state(params, factors)


@pytest.mark.parametrize("family", sorted(_FAMILIES))
def test_peft_loads_the_adapters_onto_the_base_and_computes_our_logits(tmp_path, family):
    """Mutants caught: A or B written untransposed, lora_alpha written as alpha / rank (scale applied twice)."""
    base = build_hf_checkpoint(tmp_path / "hf", family, tie_word_embeddings=False, **_FAMILIES[family])
    config, params = _trained_lora_policy(tmp_path / "hf")
    ids = np.random.default_rng(0).integers(0, 128, (2, 9))
    ours = np.asarray(nnx.merge(abstract_model(config)[0], params)(jnp.asarray(ids)).logits_btv)
    # Premise: the adapters move the logits well past the tolerance.
    assert np.abs(ours - torch_logits(base, ids)).max() > 1e-2

    adapters.export(config, params, tmp_path / "adapter", base_model=str(tmp_path / "hf"), merged_dir=tmp_path / "m")
    written = json.loads((tmp_path / "adapter" / adapters.ADAPTER_CONFIG).read_text())
    assert (written["r"], written["lora_alpha"]) == (4, 8.0)
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "hf"), tmp_path / "adapter")
    # PEFT holds every factor we wrote, as written (its state-dict names carry the adapter's name, "default").
    loaded = {name: tensor.numpy() for name, tensor in model.state_dict().items() if ".lora_" in name}
    for name, value in adapters.peft_tensors(config, params).items():
        np.testing.assert_array_equal(loaded[name.replace(".weight", ".default.weight")], value)
    np.testing.assert_allclose(torch_logits(model.eval(), ids), ours, atol=1e-4, rtol=0)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    np.testing.assert_allclose(torch_logits(merged, ids), ours, atol=1e-4, rtol=0)


def test_a_qlora_policy_exports_the_same_adapter_and_a_merged_model_of_its_dequantized_base(tmp_path):
    """With an int8 base: the PEFT adapter is the factors as trained (the same file a float base's adapters give),
    and the merged model transformers loads (dequantized base + adapters, float32) computes our logits. Mutant
    caught: ``merged`` adding the adapters to the int8 values without their scales."""
    build_hf_checkpoint(tmp_path / "hf", "qwen3", tie_word_embeddings=False)
    config, params = _trained_lora_policy(tmp_path / "hf", base_quant="int8")
    assert params["layers"]["attn"]["q_proj"].value.dtype == jnp.int8  # premise: a quantized base
    _, float_base = _trained_lora_policy(tmp_path / "hf")
    ids = np.random.default_rng(0).integers(0, 128, (2, 9))
    ours = np.asarray(nnx.merge(abstract_model(config)[0], params)(jnp.asarray(ids)).logits_btv)

    adapters.export(config, params, tmp_path / "adapter", merged_dir=tmp_path / "m")
    written = adapters.peft_tensors(config, params)
    expected = adapters.peft_tensors(config, float_base)
    assert written.keys() == expected.keys()
    for name, value in expected.items():
        np.testing.assert_array_equal(written[name], value)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert {str(p.dtype) for p in merged.parameters()} == {"torch.float32"}
    np.testing.assert_allclose(torch_logits(merged, ids), ours, atol=1e-4, rtol=0)


def test_exports_peft_cannot_load_say_what_to_do(tmp_path):
    build_hf_checkpoint(tmp_path / "hf", "qwen3_moe", num_hidden_layers=2, mlp_only_layers=[1])
    config, params = load_hf(tmp_path / "hf")
    with pytest.raises(ValueError, match=r"lora\.rank=0"):
        adapters.export(config, params, tmp_path / "adapter")
    config, params = adapt(config, params, LoRAConfig(rank=2), seed=0)
    with pytest.raises(ValueError, match=r"lora\.targets=q,k,v,o"):
        adapters.export(config, params, tmp_path / "adapter")
