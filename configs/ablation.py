"""The default recipe with another allocation policy: ``--config=configs/ablation.py:<policy>``.

Policies: uniform, dynamic_sampling, root_only, tree_random, tree_entropy, trace (see
``trace_jax.allocation.policies``) and the two mixed cells of TRACE's stage ablation, :data:`STAGE_ARMS`
(``active1_uniform2``: TRACE's stage 1 with random stage-2 anchors; ``uniform1_active2``: uniform stage 1 with
TRACE's stage 2; the other two cells are ``tree_random`` and ``trace``). All share the default's budget
accounting: equal rollouts per prompt by default; set ``--config.allocation.tokens_per_prompt`` (and a large
``rollouts_per_prompt``) for equal generated tokens, as ``trace_jax.bench.train_curve`` does.
"""

import pathlib

import ml_collections

from trace_jax.allocation.policies import POLICIES
from trace_jax.config_utils import load_config_file

# arm -> TRACE with these (stage 1, stage 2): the stage ablation's cells that are no registered policy.
STAGE_ARMS = {
    "active1_uniform2": ("active", "uniform"),
    "uniform1_active2": ("uniform", "active"),
}


def _default_config() -> ml_collections.ConfigDict:
    # Loaded by path: config files are run by ml_collections from anywhere, not imported as a package.
    return load_config_file(f"{pathlib.Path(__file__).with_name('default.py')}")


def get_config(policy: str = "trace") -> ml_collections.ConfigDict:
    if policy not in STAGE_ARMS and (policy not in POLICIES or policy == "oracle"):
        choices = sorted(p for p in POLICIES if p != "oracle") + sorted(STAGE_ARMS)
        raise ValueError(
            f"unknown policy {policy!r} for a training run; choose one of {choices} (oracle is simulator-only)"
        )
    config = _default_config()
    config.allocation.policy = "trace" if policy in STAGE_ARMS else policy
    if policy in STAGE_ARMS:
        stage1, stage2 = STAGE_ARMS[policy]
        config.allocation.policy_kwargs = {"stage1": stage1, "stage2": stage2}
    return config
