"""Policy models (Flax nnx): the one door through which the rest of the framework builds and describes them.

    from trace_jax.models import ModelConfig, abstract_model, num_params
    config = ModelConfig.preset("qwen3-tiny")
    graphdef, state = abstract_model(config)          # shapes, dtypes and shardings; nothing allocated

``qwen`` holds the Qwen2/Qwen3 dense decoder; ``attention`` the attention kernels it calls.
"""

from trace_jax.models.qwen import PRESETS, KVCache, ModelConfig, ModelOutput, Qwen, abstract_model, num_params

__all__ = ["PRESETS", "KVCache", "ModelConfig", "ModelOutput", "Qwen", "abstract_model", "num_params"]
