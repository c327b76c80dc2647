"""TRACE allocation: where a step's sampling budget goes, over prompt roots and turn prefixes.

    from trace_jax.allocation import SchedulerConfig, TreeScheduler, make_policy
    scheduler = TreeScheduler(backend, make_policy("trace"), SchedulerConfig(rollouts_per_prompt=8.0))

``policies`` (the registry ``POLICIES``), ``solvers`` (stage-1 root and stage-2 prefix allocation), ``scheduler``
(the host loop that asks a rollout backend for continuations), ``context`` (budget and cost bookkeeping),
``predictor`` (the shared success predictor), ``anchors`` / ``replay`` / ``calibration`` (what it learns from
and how it is scored), ``simulate`` (a ground-truth simulator backend for experiments without a model).
"""

from trace_jax.allocation.policies import POLICIES, AllocationPolicy, make_policy
from trace_jax.allocation.predictor import PREDICTORS, SuccessPredictor, make_predictor
from trace_jax.allocation.scheduler import SchedulerConfig, ScheduleResult, TreeScheduler
from trace_jax.allocation.simulate import Simulator, SimulatorConfig

__all__ = [
    "POLICIES",
    "PREDICTORS",
    "AllocationPolicy",
    "ScheduleResult",
    "SchedulerConfig",
    "Simulator",
    "SimulatorConfig",
    "SuccessPredictor",
    "TreeScheduler",
    "make_policy",
    "make_predictor",
]
