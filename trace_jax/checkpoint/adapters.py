"""A LoRA policy's adapters as a PEFT adapter directory (``adapter_model.safetensors`` + ``adapter_config.json``)
that ``peft.PeftModel.from_pretrained`` loads onto the transformers base model, and optionally the merged model.

The names come from the HF port's ``KEY_MAP`` (``trace_jax.checkpoint.hf``): the adapters of our projection
``layers.attn.q_proj`` at HF layer ``i`` are PEFT's ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``
``[r, in]`` and ``….lora_B.weight`` ``[out, r]`` (a torch ``Linear``'s layout: ``lora_A`` is ``A^T`` flattened, as the
base's transform flattens the projection's input axes, ``lora_B`` is ``B^T``). PEFT computes
``W x + (lora_alpha / r) B A x``, ours ``x (W + (alpha / r) A B)``: the same map with ``lora_alpha = alpha``.

``target_modules`` lists the HF module names (the last part: ``q_proj``, ``gate_proj``…) of the projections that
carry adapters. On a Qwen3-MoE, PEFT also maps ``gate_proj`` / ``up_proj`` / ``down_proj`` onto transformers' fused
expert parameters, which ours leave unadapted: the file holds no factors for them, so PEFT keeps its initial ones
there, ``lora_B`` zero, which add nothing. The same mapping takes those names off a Qwen3-MoE's dense layers
(``mlp_only_layers``), so adapters on their MLP have no PEFT form: ``export`` refuses them (real Qwen3-MoE
checkpoints have no dense layers).
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
from flax import nnx

from trace_jax.checkpoint import hf
from trace_jax.models import lora

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."


def peft_tensors(config: Any, params: nnx.State) -> dict[str, np.ndarray]:
    """Every LoRA factor of ``params`` (a ``create_model(config)`` state with adapters) under its PEFT name, in
    PEFT's layout and the params' dtype."""
    tensors = {}
    for path, variable in nnx.to_flat_state(lora.adapter_state(params)):
        base_key = ".".join(str(p) for p in lora.base_path(path))
        value = np.asarray(jax.device_get(variable.value))
        factor = "lora_A" if str(path[-1]).endswith("_lora_a") else "lora_B"
        for index, hf_key, transform in hf.hf_slots(config, base_key, value.shape):
            module = hf_key.removesuffix(".weight")
            # A [*in, r] is a kernel whose input axes are the base's: its transform gives [r, in]; B [r, *out] has
            # one input axis (the rank): Transpose(1) gives [out, r].
            factor_transform = transform if factor == "lora_A" else hf.Transpose(1)
            tensors[f"{_PEFT_PREFIX}{module}.{factor}.weight"] = factor_transform.to_hf(value[index])
    return tensors


def peft_config(config: Any, tensors: dict[str, np.ndarray], base_model: str = "") -> dict[str, Any]:
    """``adapter_config.json`` for ``tensors`` (what ``peft_tensors`` returned) of ``config.lora``."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": config.lora_rank,
        "lora_alpha": config.lora_alpha,
        "target_modules": target_modules(tensors),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def target_modules(tensors: dict[str, np.ndarray]) -> list[str]:
    """PEFT's ``target_modules`` for ``tensors``: the last parts of the adapted modules' names (``["k_proj",
    "q_proj", ...]``)."""
    return sorted({name.split(".lora_")[0].rpartition(".")[2] for name in tensors})


def export(
    config: Any,
    params: nnx.State,
    out_dir: str | os.PathLike,
    base_model: str = "",
    merged_dir: str | os.PathLike | None = None,
    token_ids: dict[str, Any] | None = None,
    max_shard_bytes: int = 0,
) -> None:
    """Writes ``params``' adapters to ``out_dir`` as a PEFT adapter directory; with ``merged_dir``, also the model
    with the adapters merged into its weights (``W + (alpha / r) A B``) as a plain HF directory (``save_hf``, with
    ``token_ids`` for its config.json and ``max_shard_bytes`` per file). ``base_model``: the
    ``base_model_name_or_path`` PEFT records (the HF directory or hub name the adapters go on)."""
    if not config.lora_rank or not lora.has_adapters(params):
        raise ValueError("the policy has no LoRA adapters (lora.rank=0): export the whole model with save_hf instead")
    dense_mlp = [p for p, _ in nnx.to_flat_state(lora.adapter_state(params)) if p[:2] == ("dense_layers", "mlp")]
    if dense_mlp:
        raise ValueError(
            "PEFT on transformers' Qwen3-MoE maps gate_proj/up_proj/down_proj onto the experts, so the adapters on "
            "this model's dense layers' MLP (mlp_only_layers) cannot be exported; train with lora.targets=q,k,v,o"
        )
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    tensors = peft_tensors(config, params)
    hf.write_safetensors(os.path.join(out_dir, ADAPTER_WEIGHTS), tensors)
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
        json.dump(peft_config(config, tensors, base_model), f, indent=2)
    if merged_dir is not None:
        hf.save_hf(config.without_lora, lora.merged(params, config.lora.scale), merged_dir, max_shard_bytes, token_ids)
