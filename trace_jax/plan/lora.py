"""A LoRA job in the planner: the adapted model, the optimizer the job wraps, and what its train state and
update cost.

A LoRA job (``lora.rank > 0``, ``trace_jax.models.lora``) trains adapters on a frozen base. The job
(``trace_jax.job.training``) builds the policy with adapters and wraps its AdamW in ``lora.frozen_base``; the
trainer differentiates only ``lora.trained_part`` (the adapters). The planner builds the same abstract state,
so the update it compiles is the job's: gradients and optimizer moments adapter-sized, the base an argument
of every program that the optimizer step passes through unchanged.

Here: the model config a plan's ``--lora-*`` options ask for (``adapted``), the job's optimizer for a state
(``job_optimizer``), the bytes of a train state for the search's estimate (``train_state_bytes``), the
params of a state by kind (``param_parts``) and the model FLOPs a token of the
update needs (``train_flops_per_token``: a frozen base computes no weight gradient).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import optax

from trace_jax.models import abstract_model, lora, num_params
from trace_jax.plan.timing import matmul_params, model_flops_per_token


def adapted(config: Any, rank: int, alpha: float, targets: str, base_quant: str = "none") -> Any:
    """``config`` carrying adapters of ``rank`` on ``targets`` (scale ``alpha / rank``) and, with ``base_quant``
    (``lora.BASE_QUANT``), their frozen base quantized (QLoRA), as the job's ``models.adapt`` makes it;
    ``config`` unchanged with rank 0. A bad value raises a ``SystemExit`` naming the option."""
    if not rank:
        if base_quant != "none":
            raise SystemExit(f"--lora-base-quant {base_quant} quantizes the base under adapters; set --lora-rank")
        return config
    if not hasattr(config, "lora_rank"):
        raise SystemExit(f"--lora-rank needs a model that takes adapters; {type(config).__name__} has no lora_rank")
    try:
        lora.LoRAConfig(rank=rank, alpha=alpha, targets=targets, base_quant=base_quant)
    except ValueError as e:
        raise SystemExit(f"--lora-rank/--lora-targets/--lora-base-quant: {e}") from None
    return dataclasses.replace(
        config, lora_rank=rank, lora_alpha=alpha, lora_targets=targets, lora_base_quant=base_quant
    )


def job_optimizer(optimizer: optax.GradientTransformation, params: Any) -> optax.GradientTransformation:
    """The optimizer the job trains ``params`` with: ``optimizer`` on the adapters alone (``lora.frozen_base``)
    when ``params`` has them, else ``optimizer`` itself."""
    return lora.frozen_base(optimizer, params) if lora.has_adapters(params) else optimizer


def adapter_params(config: Any) -> int:
    """How many values the adapters of ``config`` hold (0 without adapters), from its abstract model."""
    if not getattr(config, "lora_rank", 0):
        return 0
    return sum(math.prod(x.shape) for x in jax.tree.leaves(lora.adapter_state(abstract_model(config)[1])))


def train_state_bytes(config: Any, param_bytes: int) -> int:
    """Bytes of a whole train state (all chips): params, one gradient and AdamW's two moments of the trained
    part, at ``param_bytes`` a value. Without adapters every weight is trained (4 x params); with them the base
    is held once and the adapters four times."""
    if not getattr(config, "lora_rank", 0):
        return num_params(config) * param_bytes * 4
    return (num_params(config) + 4 * adapter_params(config)) * param_bytes


def param_parts(params: Any) -> dict[str, Any]:
    """A state's params by kind: ``weights`` (with adapters: the frozen base alone, quantized or not, with its
    scales) and, with adapters, ``adapters``."""
    if not lora.has_adapters(params):
        return {"weights": params}
    return {
        "weights": params.filter(lambda path, _: not lora.is_adapter_path(path)),
        "adapters": lora.adapter_state(params),
    }


def settings(config: Any) -> dict[str, Any]:
    """The adapters a plan's update carries, for its report (empty without adapters)."""
    if not getattr(config, "lora_rank", 0):
        return {}
    return {
        "lora_rank": config.lora_rank,
        "lora_alpha": config.lora_alpha,
        "lora_targets": config.lora_targets,
        "lora_base_quant": config.lora_base_quant,
    }


def train_flops_per_token(config: Any, context: float) -> float:
    """Model FLOPs a token of the update needs (``timing.model_flops_per_token`` counts 6 x the parameters it
    multiplies by plus attention). With adapters the frozen base computes no weight gradient: 4 x those
    parameters (forward and the activations' gradient), plus 6 x the adapters' params, plus the same attention
    term."""
    full = model_flops_per_token(config, context)
    if not getattr(config, "lora_rank", 0):
        return full
    return full - 2.0 * matmul_params(config) + 6.0 * adapter_params(config)
