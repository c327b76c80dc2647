"""The default recipe with another allocation policy: ``--config=configs/ablation.py:<policy>``.

Policies: uniform, dynamic_sampling, root_only, tree_random, tree_entropy, trace (see
``trace_jax.allocation.policies``), and the arms of :data:`ARMS`, registered policies with other settings:

* the two mixed cells of TRACE's stage ablation (``active1_uniform2``: TRACE's stage 1 with random stage-2
  anchors; ``uniform1_active2``: uniform stage 1 with TRACE's stage 2; the other two cells are ``tree_random``
  and ``trace``);
* prompt selection (``trace_select3``, ``root_only_select3``, ``active1_uniform2_select3``): the step draws 3
  candidate prompts per prompt it trains and the policy keeps the batch's worth by predicted ``V_root``
  (``allocation.candidates_per_prompt``; the budget is the kept batch's);
* selection on the first search (``trace_select3_first_search``, ``trace_history_select3_first_search``,
  ``trace_select4_first_search`` with 4 candidates a prompt): as ``trace_select3`` / ``trace_history_select3``,
  but each candidate first gets one rollout's first turn (search call and observation) and is ranked, and stage 1
  split, on the predictor's value of that depth-1 prefix (``allocation.select_on``); the probes' tokens are
  charged, a kept prompt's probe is its first rollout;
* a warm predictor (``trace_warm``, ``trace_select3_warm``): before RL step 1 the predictor learns from 8
  rollouts on each of 96 prompts (``allocation.predictor_warmup_prompts``; that sampling is logged at step 0);
* ``trace_select3_warm_dispersion``: the same with the predictor's dispersion head, so selection and stage 1
  rank prompts by the expected ``V_root`` under the predicted spread of their success probability;
* prompt history across epochs (runs over a pool, ``rl.pool_size``): ``trace_history``, TRACE whose predictor
  also reads each prompt's outcomes on earlier visits (and trains the same predictor without them alongside, to
  log history's worth on the same anchors); ``trace_history_select3`` with prompt selection;
  ``greso`` / ``greso_select2``, the history-only baseline (GRESO's rule, without / with 2 candidates a prompt);
* the gated stage 2: ``trace_gated`` (active stage 2 only while the predictor's held-out AUC on prefixes is at
  least 0.65, random anchors otherwise) and ``trace_history_gated``;
* all of them together: ``trace_history_select3_first_search_gated`` (history, selection on the first search with
  3 candidates a prompt, and the gate).

All share the default's budget accounting: equal rollouts per prompt by default; set
``--config.allocation.tokens_per_prompt`` (and a large ``rollouts_per_prompt``) for equal generated tokens, as
``trace_jax.bench.train_curve`` does.
"""

import dataclasses
import pathlib
from typing import Any

import ml_collections

from trace_jax.allocation.policies import POLICIES
from trace_jax.configs import load_config_file


@dataclasses.dataclass(frozen=True)
class Arm:
    """A registered policy with overrides of its fields and of other ``config.allocation`` fields."""

    policy: str
    policy_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    allocation: dict[str, Any] = dataclasses.field(default_factory=dict)


SELECT3 = {"candidates_per_prompt": 3.0}
SELECT4 = {"candidates_per_prompt": 4.0}
WARM = {"predictor_warmup_prompts": 96, "predictor_warmup_rollouts": 8}
DISPERSION = {"predictor_kwargs": {"dispersion": True}}
HISTORY = {"predictor_kwargs": {"history": True}, "compare_without_history": True}
GATE = {"gate_auc": 0.65}
FIRST_SEARCH = {"select_on": "first_search"}


ARMS = {
    "active1_uniform2": Arm("trace", {"stage1": "active", "stage2": "uniform"}),
    "uniform1_active2": Arm("trace", {"stage1": "uniform", "stage2": "active"}),
    "trace_select3": Arm("trace", allocation=SELECT3),
    "root_only_select3": Arm("root_only", allocation=SELECT3),
    "active1_uniform2_select3": Arm("trace", {"stage1": "active", "stage2": "uniform"}, SELECT3),
    "trace_warm": Arm("trace", allocation=WARM),
    "trace_select3_warm": Arm("trace", allocation={**SELECT3, **WARM}),
    "trace_select3_warm_dispersion": Arm("trace", allocation={**SELECT3, **WARM, **DISPERSION}),
    "trace_history": Arm("trace", allocation=HISTORY),
    "trace_history_select3": Arm("trace", allocation={**HISTORY, **SELECT3}),
    "trace_select3_first_search": Arm("trace", allocation={**SELECT3, **FIRST_SEARCH}),
    "trace_history_select3_first_search": Arm("trace", allocation={**HISTORY, **SELECT3, **FIRST_SEARCH}),
    "trace_select4_first_search": Arm("trace", allocation={**SELECT4, **FIRST_SEARCH}),
    "greso": Arm("greso"),
    "greso_select2": Arm("greso", allocation={"candidates_per_prompt": 2.0}),
    "trace_gated": Arm("trace", GATE),
    "trace_history_gated": Arm("trace", GATE, HISTORY),
    "trace_history_select3_first_search_gated": Arm("trace", GATE, {**HISTORY, **SELECT3, **FIRST_SEARCH}),
}


def _default_config() -> ml_collections.ConfigDict:
    # Loaded by path: config files are run by ml_collections from anywhere, not imported as a package.
    return load_config_file(f"{pathlib.Path(__file__).with_name('default.py')}")


def get_config(policy: str = "trace") -> ml_collections.ConfigDict:
    if policy not in ARMS and (policy not in POLICIES or policy == "oracle"):
        choices = sorted(p for p in POLICIES if p != "oracle") + sorted(ARMS)
        raise ValueError(
            f"unknown policy {policy!r} for a training run; choose one of {choices} (oracle is simulator-only)"
        )
    arm = ARMS.get(policy, Arm(policy))
    config = _default_config()
    config.allocation.policy = arm.policy
    if arm.policy_kwargs:
        config.allocation.policy_kwargs = dict(arm.policy_kwargs)
    for field, value in arm.allocation.items():
        config.allocation[field] = value
    return config
