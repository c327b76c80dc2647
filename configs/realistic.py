"""The default recipe on a realistic-difficulty world: ``--config=configs/realistic.py[:<policy>]``.

A real RLVR pool is U-shaped for the current policy: most prompts are all-correct or all-wrong (the TRACE
paper's Qwen3-8B uniform baseline mixes only 26.8% of its groups). This world aims at that shape
with three kinds of train prompts in about these shares: 1..5-hop *chain* questions weighted to the
short end (~43%, the learnable middle), *buried* questions whose first lookup the retriever cannot answer
(~30%, p ~ 0: ``bury_passages`` look-alikes stating wrong facts out-rank the entity's passage, and the warm
start never sees their answers: ``config.sft.split = "train:chain,trivial"``) and *trivial* ones that end
with their answer (~27%, p ~ 1: "What is the studio of Zorvak? Hint: Kelmo."; the gold trace is the bare
answer); lookalike distractors (0-4 per entity, each stating a wrong object for a real relation); trajectories
are up to 6 turns.

The policy is the default tiny Qwen3 (2 layers, width 64, ~0.14M parameters with the 1024-token BPE) with 1,200
SFT steps. ``configs/realistic_large.py`` is the same run with a 3.4M-parameter policy (4 layers, width 256,
2,000 SFT steps; its warm-start time is in docs/log/evidence-2026-11-30-to-12-03.md, "A 3.4M-parameter
policy"). ``POLICY_OVERRIDES`` changes the policy here. What this preset gives after the warm start is measured
by ``python -m trace_jax.bench.difficulty`` (docs/evidence.md, "The realistic-difficulty pool").

The policy argument is as for ``configs/ablation.py`` (default ``trace``).
"""

import pathlib

import ml_collections

from trace_jax.configs import WorldConfig, load_config_file, section

# ModelConfig overrides of the policy (the tokenizer sets vocab_size); none: the default tiny policy (see above).
POLICY_OVERRIDES = ()

# The multi-epoch experiment's prompt pool and passes over it (~10 minutes a run on 2 shared cores): 32 of the
# train questions, evenly spaced (chain, buried and trivial keep their shares), 8 a step, 3 epochs. Not applied
# by get_config, so the fresh-prompt commands of docs/evidence.md keep their meaning: pass
# ``--pool-size 32 --epochs 3`` to ``trace_jax.bench.train_curve``, or ``--config.rl.pool_size=32
# --config.rl.prompts_per_step=8 --config.rl.steps=12`` to ``trace_jax.train``.
POOL_SIZE, EPOCHS = 32, 3

WORLD = WorldConfig(
    max_hops=5,
    ood_hops=6,
    questions_per_hop=84,  # 420 chain questions in all, split by hop_weights
    hop_weights=(0.35, 0.3, 0.2, 0.1, 0.05),
    distractor_probs=(0.1, 0.2, 0.3, 0.2, 0.2),
    distractor_style="lookalike",
    buried_questions=500,
    buried_entity_fraction=0.2,
    bury_passages=4,
    trivial_questions=500,  # ~320 train: every distinct (entity, relation) pair outside the buried ones
)


def _ablation_config(policy: str) -> ml_collections.ConfigDict:
    # Loaded by path: config files are run by ml_collections from anywhere, not imported as a package.
    return load_config_file(f"{pathlib.Path(__file__).with_name('ablation.py')}:{policy}")


def get_config(policy: str = "trace") -> ml_collections.ConfigDict:
    config = _ablation_config(policy)
    config.world = section(WORLD)
    config.react.max_turns = WORLD.max_hops + 1  # one search per hop, then the answer
    config.sft.model_overrides = [list(item) for item in POLICY_OVERRIDES]
    # Fixed steps (reproducible). 1,200, not the default 1,000: a sharper copy of a trivial question's answer. It
    # also gave the preset a new warm-start key when the trivial wording changed (the key hashes configs, not code).
    config.sft.max_steps = 1200
    config.sft.split = "train:chain,trivial"  # no buried gold traces: their answers would be memorised
    config.engine.max_len = 768  # a 5-hop trajectory with 3 passages per observation
    config.batch.length_buckets = [128, 256, 384, 512, 640, 768]
    return config
