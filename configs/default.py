"""The default recipe: a tiny Qwen3-architecture agent on the synthetic multi-hop world, TRACE allocation.

Sized to finish on 2 CPU cores in a few minutes, warm start included (README, quick start; the warm start trains
a fixed 1,000 steps and is cached, so later runs of the same world/tokenizer/SFT settings skip it). Every field can be
overridden on the command line (``--config.rl.steps=40``); each section is one part's config dataclass
(``trace_jax.configs.SECTIONS``), whose docstring explains the fields: ``python -m trace_jax.train
--show-config`` prints them all. A value that differs from its dataclass's default says why in a comment.
"""

import ml_collections

from trace_jax.configs import (
    BatchConfig,
    DistributedConfig,
    EngineConfig,
    EvalConfig,
    LoRAConfig,
    LossConfig,
    MeshConfig,
    OptimizerConfig,
    ReActConfig,
    RecipeConfig,
    RetrieverConfig,
    RLConfig,
    RunnerConfig,
    SchedulerConfig,
    SFTConfig,
    TokenizerConfig,
    UpdateConfig,
    WarmStartConfig,
    WorldConfig,
    section,
)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    del arg
    config = ml_collections.ConfigDict()
    config.seed = 0
    config.recipe = section(RecipeConfig(kind="synthetic"))  # the synthetic world, a warm start by SFT
    config.world = section(WorldConfig())
    config.tokenizer = section(TokenizerConfig(vocab_size=1024))
    config.react = section(ReActConfig.preset("synthetic"))  # the synthetic world's prompt and turn sizes
    config.retriever = section(RetrieverConfig())  # BM25 over the world's corpus
    config.sft = section(SFTConfig(max_steps=1000, time_budget_s=None))  # fixed steps: reproducible
    config.warm_start = section(WarmStartConfig())
    # Sized for the tiny policy on 2 CPU cores: 32 slots decoding 32 steps per call, turns of <= 48 tokens.
    config.engine = section(EngineConfig(max_slots=32, max_len=512, steps_per_call=32, max_turn_tokens=48))
    config.runner = section(RunnerConfig(refill_after=4))  # 4 turns per host round trip: fewer syncs on CPU
    # max_depth 8 still tells every turn depth apart (react.max_turns is 5 here, 6 in realistic.py).
    config.allocation = section(SchedulerConfig(policy="trace", rollouts_per_prompt=8.0, max_depth=8))
    # Length buckets up to engine.max_len; fixed_length: every row is 512 long (tree-packed to the largest
    # bucket), so the trainer compiles once. skip_zero_advantage: the all-right and all-wrong groups are counted
    # in the loss's denominator but never run through the update (their gradient is exactly 0).
    config.batch = section(
        BatchConfig(length_buckets=(128, 256, 384, 512), fixed_length=True, skip_zero_advantage=True)
    )
    config.loss = section(LossConfig(policy_loss="ppo", aggregation="token-mean"))
    # Epochs x mini-batches per rollout batch, behaviour log-probs. micro_rows 0: one row per device a call (no
    # padding rows to fill a call, the smallest activations); docs/benchmarks.md, "Sampling beside training".
    config.ppo = section(UpdateConfig(micro_rows=0))
    # The tiny policy's learning rate, held constant (OptimizerConfig's generic defaults: 1e-5, cosine). The
    # schedule's length and warm-up are derived from rl.steps and rl.warmup_steps (schema.derived).
    config.optim = section(OptimizerConfig(learning_rate=2e-4, max_grad_norm=1.0, schedule="constant"))
    config.lora = section(LoRAConfig())  # rank 0: full fine-tuning; --config.lora.rank=8 trains adapters only
    config.rl = section(
        RLConfig(
            steps=30,
            prompts_per_step=16,
            advantage="grpo",
            warmup_steps=0.5,  # 2 of the first step's 4 optimizer steps (2 epochs x 2 mini-batches)
            checkpoint_every=5,
            keep_checkpoints=2,
        )
    )
    config.eval = section(EvalConfig(split="test", num_questions=150, every=10))
    config.mesh = section(MeshConfig(data=1, fsdp=-1, tensor=1))
    config.distributed = section(DistributedConfig())
    return config
