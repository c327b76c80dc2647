"""Model families: which nnx Module class implements a policy architecture.

``MODEL_FAMILIES`` maps a family name to the Module class built as ``cls(config, rngs=rngs)``; every part of
the framework that builds a policy (the SFT warm start, the transformer success predictor, the benchmarks)
calls ``create_model`` or ``abstract_model``, so a new family needs no change to them:

    @MODEL_FAMILIES.register("my_family")
    class MyDecoder(nnx.Module):
        def __init__(self, config, *, rngs): ...

The family of a config is ``model_family(config)``, i.e. ``config.family``. ``ModelConfig`` derives it from
its flags ("qwen3" with q/k norm, "qwen2" without); it is a property, not a field, so ``model_config.json``
files and the warm-start fingerprint (both ``dataclasses.asdict`` of the config) do not carry it. A config
of a new family is a frozen dataclass subclass of ``ModelConfig`` that overrides ``family`` (and adds the
fields the family needs).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx

from trace_jax.models import lora
from trace_jax.models.moe import QwenMoe
from trace_jax.models.qwen import ModelConfig, Qwen
from trace_jax.registry import Registry

MODEL_FAMILIES: Registry[type[nnx.Module]] = Registry(
    "model family", {"qwen2": Qwen, "qwen3": Qwen, "qwen3_moe": QwenMoe}
)


def config_to_dict(config: ModelConfig | Any) -> dict[str, Any]:
    """The config as JSON-able fields plus its ``family``, which ``config_from_dict`` reads to pick the class."""
    return {"family": model_family(config), **dataclasses.asdict(config)}


def config_from_dict(fields: dict[str, Any]) -> ModelConfig:
    """Rebuilds what ``config_to_dict`` wrote: the family's ``config_class`` (a Module class attribute; default
    ``ModelConfig``) from the fields. Fields without a ``family`` (older files) are a dense ``ModelConfig``."""
    fields = dict(fields)
    family = fields.pop("family", None)
    if "router_aux_loss_coef" in fields:  # a Qwen3-MoE config written before the field became hf_router_aux_loss_coef
        fields["hf_router_aux_loss_coef"] = fields.pop("router_aux_loss_coef")
    config_class = ModelConfig if family is None else getattr(MODEL_FAMILIES[family], "config_class", ModelConfig)
    return config_class(**fields)


def model_family(config: ModelConfig | Any) -> str:
    """The ``MODEL_FAMILIES`` key of ``config``: its ``family``."""
    return config.family


def create_model(config: ModelConfig | Any, rngs: nnx.Rngs) -> nnx.Module:
    """A freshly initialised policy of ``config``'s family, e.g. ``Qwen(config, rngs=rngs)``."""
    return MODEL_FAMILIES[model_family(config)](config, rngs=rngs)


def abstract_model(config: ModelConfig | Any) -> tuple[nnx.GraphDef, nnx.State]:
    """``(graphdef, abstract params)`` of ``create_model(config, nnx.Rngs(0))``: shapes, dtypes and logical
    axes, no memory. ``nnx.merge(graphdef, params)`` turns any matching params into a model."""
    return nnx.split(nnx.eval_shape(lambda: create_model(config, nnx.Rngs(0))), nnx.Param)


def with_adapters(params: Any, model_config: Any, rngs: nnx.Rngs) -> Any:
    """Base ``params`` (an ``nnx.State`` of a model without adapters) plus fresh adapters for
    ``model_config.lora`` (and, with its ``base_quant``, that base quantized where adapters sit): the params of
    ``create_model(model_config)`` whose base is ``params``."""
    model = nnx.merge(abstract_model(model_config.without_lora)[0], params)
    lora.add_adapters(model, model_config.lora, rngs)
    lora.quantize_base(model, model_config.lora)
    return nnx.split(model, nnx.Param)[1]


def adapt(model_config: Any, params: Any, config: lora.LoRAConfig, seed: int) -> tuple[Any, Any]:
    """``(model config, params)`` of the policy ``config`` asks for, from a base without adapters: unchanged with
    rank 0, else the config carrying the adapters and the base plus fresh adapters (initialised from ``seed``)."""
    if not config.rank:
        return model_config, params
    adapted = dataclasses.replace(
        model_config,
        lora_rank=config.rank,
        lora_alpha=config.alpha,
        lora_targets=config.targets,
        lora_base_quant=config.base_quant,
    )
    return adapted, with_adapters(params, adapted, nnx.Rngs(seed))
