"""Policy models (Flax nnx): the one door through which the rest of the framework builds and describes them.

    from trace_jax.models import ModelConfig, abstract_model, create_model, num_params
    config = ModelConfig.preset("qwen3-tiny")
    graphdef, state = abstract_model(config)          # shapes, dtypes and shardings; nothing allocated
    model = create_model(config, nnx.Rngs(0))         # the Module of the config's family, initialised

``family`` holds ``MODEL_FAMILIES``, the registry from a family name (``config.family``) to the Module class
that implements it, through which ``create_model`` and ``abstract_model`` dispatch; ``qwen`` holds the
Qwen2/Qwen3 dense decoder (families "qwen2" and "qwen3"); ``attention`` the attention kernels it calls.
"""

from trace_jax.models.family import MODEL_FAMILIES, abstract_model, create_model, model_family
from trace_jax.models.qwen import PRESETS, KVCache, ModelConfig, ModelOutput, Qwen, num_params

__all__ = [
    "MODEL_FAMILIES",
    "PRESETS",
    "KVCache",
    "ModelConfig",
    "ModelOutput",
    "Qwen",
    "abstract_model",
    "create_model",
    "model_family",
    "num_params",
]
