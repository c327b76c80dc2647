"""The sections only the main job reads, each a frozen dataclass whose docstring documents its fields.

The other sections are the parts' own configs (``WorldConfig``, ``EngineConfig``, ``LossConfig``...), defined
beside the code they configure; these are the job's: the world's tokenizer, the RL loop, evaluation, the device
mesh, the warm start (SFT settings and where the cache lives), and the real recipe's checkpoint and kind.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trace_jax.config_utils import documented
from trace_jax.models import ModelConfig


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
    """The world's byte-level BPE."""

    vocab_size: int = documented(
        1024,
        "number of tokens (bytes, merges, the ReAct tags, pad and EOS); the policy's vocabulary.",
    )


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """The RL loop."""

    steps: int = documented(
        30,
        "number of RL updates; a finished run is extended by rerunning it with a larger value. The learning-rate "
        "schedule spans the whole run: rl.steps × ppo.ppo_epochs × ppo.mini_batches optimizer steps.",
    )
    prompts_per_step: int = documented(16, "training questions per step (each grows one rollout tree).")
    pool_size: int = documented(
        0,
        "the prompt pool, evenly spaced over the RL split (rl.split; every kind keeps its share; the same pool for "
        "every seed); each epoch visits it once in a fresh seeded order (``trace_jax.data.prompts``). 0: the whole "
        "split. The epochs a run makes follow from rl.steps (``rl.epochs`` under [derived]); synthetic recipe only.",
    )
    split: str = documented(
        "train",
        'the world split the prompts come from, optionally only some question kinds: ``"train:chain"`` trains on the '
        "chain questions alone (``trace_jax.data.synthetic.KINDS``). Synthetic recipe only (a search_r1 run streams "
        "``data.train_split``).",
    )
    advantage: str = documented("grpo", "advantage estimator, a key of ``trace_jax.rl.advantages.ESTIMATORS``.")
    warmup_steps: float = documented(
        0.5,
        "linear learning-rate warm-up over this many RL steps, i.e. over the first rl.warmup_steps × ppo.ppo_epochs × "
        "ppo.mini_batches optimizer steps (rounded); fractions count (0.5: the first half of step 1's optimizer "
        "steps).",
    )
    checkpoint_every: int = documented(5, "save the whole state every this many steps (and at the last step).")
    keep_checkpoints: int = documented(2, "how many recent checkpoints to keep.")
    logprob_chunk: int | None = documented(
        None,
        "compute the LM head this many positions at a time in the train step (peak logits memory [rows, chunk, vocab] "
        "instead of [rows, length, vocab]); None: the trainer's default chunk.",
    )
    preemption_grace_s: float = documented(
        25.0,
        "seconds between a SIGTERM (spot / queued capacity's preemption notice, ~30 s ahead) and the exit: the RL step "
        "under way finishes if it can, a checkpoint is written and the job exits with code 143; a step still running "
        "when too little of the grace is left to write the checkpoint is abandoned (the last checkpoint stays the "
        "resume point). Rerunning the same command resumes exactly.",
    )
    max_staleness: int = documented(
        0,
        "how many policy versions the trees a step trains on may lag the policy it trains (0: every step samples its "
        "trees with the policy it then updates, strictly one after the other). k >= 1: while the trainer updates at "
        "step t, a background thread samples step t + 1's trees with the weights the engine has (the policy of step t "
        "- 1: one version old; one engine samples one step at a time, so the lag never exceeds 1); the PPO ratio "
        "corrects the lag with the sampler's log-probs (``trace_jax.cluster.pipeline``). A step that ends at a "
        "checkpoint or an evaluation, and the last step, do not sample ahead (the next step samples with the newest "
        "policy), so checkpoints never hold work in flight and a resume is exact. One process only.",
    )


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Greedy held-out evaluation (EM / F1 per hop group) before RL, every ``every`` steps and at the end."""

    split: str = documented(
        "test",
        'world split evaluated: train, test or ood; optionally only some question kinds: ``"test:chain"`` evaluates '
        "the chain questions alone (``trace_jax.data.synthetic.KINDS``).",
    )
    num_questions: int = documented(
        150,
        "how many questions of the split, evenly spaced over it (every hop group keeps its share).",
    )
    every: int = documented(10, "also evaluate every this many RL steps; 0 evaluates only before and after RL.")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The device mesh: its axes' sizes; their product must equal the number of devices."""

    data: int = documented(1, "the size of each mesh axis; one of them may be -1 (it takes the remaining devices).")
    fsdp: int = documented(-1, "the size of each mesh axis; one of them may be -1 (it takes the remaining devices).")
    tensor: int = documented(1, "the size of each mesh axis; one of them may be -1 (it takes the remaining devices).")
    expert: int = documented(
        1,
        "the expert-parallel axis: a mixture-of-experts model's experts are split over it (and the batch with data and "
        "fsdp); 1 (the default) changes nothing, and dense models have no expert weights.",
    )
    slices: int = documented(
        1,
        "how many TPU slices the job spans over DCN (the outermost mesh axis ``slice``): the batch splits across "
        "them and each slice holds whole parameters and optimizer state (sharded by the axes above within it); "
        "gradients cross slices once per optimizer step. The axes above lay out one slice. On CPU, devices are "
        "grouped by process as stand-ins. 1 (the default): one slice.",
    )
    rollout_devices: int = documented(
        0,
        "how many devices only sample: the first ones of ``jax.devices()``; the engine decodes on them (slots split "
        "over fsdp) with its own copy of the weights, which each update sends there (``time/weight_sync_s``), and the "
        "axes above lay out the remaining devices, which train. 0 (the default): colocated, the engine decodes on the "
        "training devices. One process only.",
    )
    rollout_cpus: int = documented(
        0,
        "CPU hosts: sampling runs in a process of its own pinned to this many of the host's cores (the last ones this "
        "process may use), and the trainer's threads keep the rest (``trace_jax.job.sampling_process``). XLA:CPU runs "
        "all of a process's host devices on one thread pool, so apart devices (``rollout_devices``) still share every "
        "core; two processes do not. 0 (the default): sampling in the trainer's process. CPU backend, one JAX process, "
        "the synthetic recipe; not with ``rollout_devices``.",
    )


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Settings of the warm start."""

    model: str = documented(
        "qwen3-tiny",
        "a ``ModelConfig`` preset name; its ``vocab_size`` is replaced by the tokenizer's.",
    )
    model_overrides: tuple[tuple[str, Any], ...] = documented(
        (),
        'ModelConfig fields to change (e.g. ``(("hidden_size", 128),)``).',
    )
    react: str = documented(
        "synthetic",
        "a ``ReActConfig`` preset name for rendering when ``run_sft`` gets no env (it must match the env the RL job "
        "uses; passing that env is the safe way).",
    )
    split: str = documented("train", "the world split whose gold trajectories are trained on.")
    practice_worlds: int = documented(
        1,
        "also train on the same split of this many relabeled copies of the world (names shuffled within each type, "
        "``WorldConfig.relabel_seed``). Their facts contradict each other by name, so the policy cannot answer from "
        "memory and must learn to copy from the question and the passages, which is what transfers to unseen "
        "questions.",
    )
    batch_size: int = documented(8, "gold trajectories per SFT step (each batch from one length bucket).")
    learning_rate: float = documented(6e-3, "the AdamW peak learning rate (cosine decay over max_steps).")
    warmup_steps: int = documented(30, "linear learning-rate warm-up over this many SFT steps.")
    max_steps: int = documented(1000, "the number of training steps; the learning-rate schedule is laid out over them.")
    time_budget_s: float | None = documented(
        None,
        "None (the default) trains exactly ``max_steps`` steps, reproducibly. A number of seconds stops training early "
        "once that much wall time has passed: faster on a slow machine, but the model then depends on the machine and "
        "its load (``SFTResult.reproducible`` is False when the budget stopped it).",
    )
    weight_decay: float = documented(0.0, "AdamW's decoupled weight decay.")
    embed_init_std: float | None = documented(
        0.05,
        "re-draw the (tied) embedding with this std before training; None keeps the model's init. With unit-variance "
        "tied embeddings a fresh model's logits have std ~sqrt(hidden), an initial loss of ~50 nats, and the first "
        "hundred steps go to undoing that.",
    )
    bucket_multiple: int = documented(
        128,
        "trajectories are grouped by length rounded up to this many tokens, and a batch is cut to its bucket's width "
        "(fewer padded tokens, few compiled shapes).",
    )
    seed: int = documented(
        0,
        "seeds the model's init, the embedding re-draw, the practice worlds' relabelling and the batch order.",
    )
    log_every: int = documented(50, "log the SFT loss every this many steps.")

    def model_config(self, vocab_size: int) -> ModelConfig:
        overrides = dict(self.model_overrides)
        overrides.setdefault("vocab_size", vocab_size)
        return ModelConfig.preset(self.model, **overrides)


@dataclasses.dataclass(frozen=True)
class WarmStartConfig:
    """Where warm starts are kept."""

    cache_dir: str = documented(
        "~/.cache/trace_jax/warm_start",
        "directory shared by all runs (``~`` expands), or a bucket's (``gs://...``: the hosts of a pod need no shared "
        "filesystem); one subdirectory per warm-start key. Not part of any key: moving the cache moves nothing else.",
    )


@dataclasses.dataclass(frozen=True)
class RecipeConfig:
    """Which recipe the run follows: where its policy, tokenizer, questions and retriever come from."""

    kind: str = documented(
        "synthetic",
        '"synthetic" (the synthetic multi-hop world, a BPE trained on it, a tiny policy warm-started by SFT) or '
        '"search_r1" (a Hugging Face Qwen checkpoint, model.hf_dir, RL-trained on Search-R1 question files, data.dir, '
        "against a retriever); each kind reads only its own sections (``--show-config`` lists them).",
    )
    variant: str = documented(
        "",
        "the variant a config file was asked for (``configs/search_r1.py:<variant>``), kept in the run's config.json "
        "as a record of which sizes it chose; the job does not read it.",
    )


@dataclasses.dataclass(frozen=True)
class ModelSourceConfig:
    """The policy's Hugging Face checkpoint (recipe.kind=search_r1), loaded straight onto the mesh."""

    hf_dir: str = documented(
        "",
        "a Qwen2 / Qwen2.5 / Qwen3 / Qwen3-MoE Hugging Face directory: config.json, the safetensors (one file or "
        "sharded) and, unless tokenizer_dir says otherwise, the tokenizer files. Required. A local path or a gs:// "
        "URL (on a pod every host reads the bucket itself, only the slices of each tensor its devices hold).",
    )
    tokenizer_dir: str = documented(
        "",
        'the directory holding the tokenizer files when hf_dir lacks them ("": hf_dir).',
    )
    dtype: str = documented("", 'the policy\'s compute dtype, e.g. "bfloat16" ("": the model config\'s default).')
    param_dtype: str = documented(
        "",
        'the dtype of the weights the trainer keeps and updates (the master weights), e.g. "float32" ("": the model '
        "config's default).",
    )
