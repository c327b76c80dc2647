"""Policy models (Flax nnx): the one door through which the rest of the framework builds and describes them.

    from trace_jax.models import ModelConfig, abstract_model, create_model, num_params
    config = ModelConfig.preset("qwen3-tiny")
    graphdef, state = abstract_model(config)          # shapes, dtypes and shardings; nothing allocated
    model = create_model(config, nnx.Rngs(0))         # the Module of the config's family, initialised

``family`` holds ``MODEL_FAMILIES``, the registry from a family name (``config.family``) to the Module class
that implements it, through which ``create_model`` and ``abstract_model`` dispatch; ``qwen`` holds the
Qwen2/Qwen3 dense decoder (families "qwen2" and "qwen3"); ``moe`` the Qwen3-MoE decoder built from it (family
"qwen3_moe": ``MoeConfig``, ``QwenMoe``, the load-balancing ``router_aux_loss``); ``attention`` the attention
kernels they call; ``lora`` the low-rank adapters a ``ModelConfig`` may carry (``adapt`` adds them to a base).
"""

from trace_jax.models.family import (
    MODEL_FAMILIES,
    abstract_model,
    adapt,
    config_from_dict,
    config_to_dict,
    create_model,
    model_family,
)
from trace_jax.models.moe import MoeConfig, MoeOutput, QwenMoe, RouterStats, router_aux_loss
from trace_jax.models.qwen import PRESETS, KVCache, ModelConfig, ModelOutput, Qwen, num_params

__all__ = [
    "MODEL_FAMILIES",
    "PRESETS",
    "KVCache",
    "ModelConfig",
    "ModelOutput",
    "MoeConfig",
    "MoeOutput",
    "Qwen",
    "QwenMoe",
    "RouterStats",
    "abstract_model",
    "adapt",
    "config_from_dict",
    "config_to_dict",
    "create_model",
    "model_family",
    "num_params",
    "router_aux_loss",
]
