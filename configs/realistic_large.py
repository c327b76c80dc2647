"""The realistic world with a 3.4M-parameter policy: ``--config=configs/realistic_large.py[:<policy>]``.

Everything but the policy is ``configs/realistic.py``'s: the same world, tokenizer, ReAct settings and SFT data.
The policy is the Qwen3 architecture at 4 layers and width 256 (4 heads of 64, MLP 768; 3,410,688 parameters
with the 1,024-token BPE), warm-started for 2,000 SFT steps. What it gives after the warm start is measured by
``python -m trace_jax.bench.difficulty --config configs/realistic_large.py`` (docs/log/evidence-2026-11-30-to-12-03.md,
"A 3.4M-parameter policy").

The policy argument is as for ``configs/ablation.py`` (default ``trace``).
"""

import pathlib

import ml_collections

from trace_jax.configs import load_config_file

POLICY_OVERRIDES = (("hidden_size", 256), ("intermediate_size", 768), ("num_layers", 4), ("head_dim", 64))
SFT_STEPS = 2000


def get_config(policy: str = "trace") -> ml_collections.ConfigDict:
    # Loaded by path: config files are run by ml_collections from anywhere, not imported as a package.
    config = load_config_file(f"{pathlib.Path(__file__).with_name('realistic.py')}:{policy}")
    config.sft.model_overrides = [list(item) for item in POLICY_OVERRIDES]
    config.sft.max_steps = SFT_STEPS
    return config
