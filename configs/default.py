"""The default recipe: a tiny Qwen3-architecture agent on the synthetic multi-hop world, TRACE allocation.

Sized to finish on 2 CPU cores in about 15 minutes, warm start included (the warm start trains a fixed
1,000 steps and is cached, so later runs of the same world/tokenizer/SFT settings skip it). Every field can be
overridden on the command line (``--config.rl.steps=40``); each section is one part's config dataclass
(``trace_jax.schema.SECTIONS``), whose docstring explains the fields: ``python -m trace_jax.train
--show-config`` prints them all.
"""

import ml_collections

from trace_jax.allocation.scheduler import SchedulerConfig
from trace_jax.config_utils import to_config
from trace_jax.data.synthetic import WorldConfig
from trace_jax.envs.react import ReActConfig
from trace_jax.envs.retriever import RetrieverConfig
from trace_jax.job.schema import EvalConfig, MeshConfig, RLConfig, TokenizerConfig
from trace_jax.job.sft import SFTConfig
from trace_jax.job.warm_start import WarmStartConfig
from trace_jax.optim import OptimizerConfig
from trace_jax.parallel.distributed import DistributedConfig
from trace_jax.rl.batch import BatchConfig
from trace_jax.rl.losses import LossConfig
from trace_jax.rl.trainer import UpdateConfig
from trace_jax.rollout.engine import EngineConfig
from trace_jax.rollout.runner import RunnerConfig


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    del arg
    config = ml_collections.ConfigDict()
    config.seed = 0
    config.world = to_config(WorldConfig())
    config.tokenizer = to_config(TokenizerConfig(vocab_size=1024))
    config.react = to_config(ReActConfig.preset("synthetic"))
    config.retriever = to_config(RetrieverConfig())  # BM25 over the world's corpus
    config.sft = to_config(SFTConfig(max_steps=1000, time_budget_s=None))  # fixed steps: reproducible
    config.warm_start = to_config(WarmStartConfig())
    config.engine = to_config(EngineConfig(max_slots=32, max_len=512, steps_per_call=32, max_turn_tokens=48))
    config.runner = to_config(RunnerConfig(refill_after=4))
    config.allocation = to_config(SchedulerConfig(policy="trace", rollouts_per_prompt=8.0, max_depth=8))
    # fixed_length: every row is 512 long (tree-packed to the largest bucket), so the trainer compiles once.
    config.batch = to_config(
        BatchConfig(length_buckets=(128, 256, 384, 512), row_buckets=(32, 64, 96, 128, 192, 256), fixed_length=True)
    )
    config.loss = to_config(LossConfig(policy_loss="ppo", aggregation="token-mean"))
    config.ppo = to_config(UpdateConfig())  # epochs x mini-batches per rollout batch, behaviour log-probs
    config.optim = to_config(
        OptimizerConfig(learning_rate=2e-4, warmup_steps=2, total_steps=30, max_grad_norm=1.0, schedule="constant")
    )
    config.rl = to_config(
        RLConfig(
            steps=30,
            prompts_per_step=16,
            advantage="grpo",
            micro_batches=1,
            recompute_old_logprobs=False,
            checkpoint_every=5,
            keep_checkpoints=2,
        )
    )
    config.eval = to_config(EvalConfig(split="test", num_questions=150, every=10))
    config.mesh = to_config(MeshConfig(data=1, fsdp=-1, tensor=1))
    config.distributed = to_config(DistributedConfig())
    return config
