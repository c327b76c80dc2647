"""The default recipe with another allocation policy: ``--config=configs/ablation.py:<policy>``.

Policies: uniform, dynamic_sampling, root_only, tree_random, tree_entropy, trace (see
``trace_jax.allocation.policies``). All share the default's budget accounting: equal rollouts per prompt by
default; set ``--config.allocation.tokens_per_prompt`` (and a large ``rollouts_per_prompt``) for equal generated
tokens, as ``trace_jax.bench.train_curve`` does.
"""

import pathlib

import ml_collections

from trace_jax.allocation.policies import POLICIES
from trace_jax.config_utils import load_config_file


def _default_config() -> ml_collections.ConfigDict:
    # Loaded by path: config files are run by ml_collections from anywhere, not imported as a package.
    return load_config_file(f"{pathlib.Path(__file__).with_name('default.py')}")


def get_config(policy: str = "trace") -> ml_collections.ConfigDict:
    if policy not in POLICIES or policy == "oracle":
        choices = sorted(p for p in POLICIES if p != "oracle")
        raise ValueError(
            f"unknown policy {policy!r} for a training run; choose one of {choices} (oracle is simulator-only)"
        )
    config = _default_config()
    config.allocation.policy = policy
    return config
