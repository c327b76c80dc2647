"""The real recipe: a Hugging Face Qwen checkpoint RL-trained with TRACE on Search-R1 data against a retriever.

    python -m trace_jax.train --config=configs/search_r1.py:qwen3-8b --workdir=runs/qwen3-8b \\
        --config.model.hf_dir=/data/Qwen3-8B --config.data.dir=/data/search_r1 \\
        --config.retriever.url=http://10.0.0.2:8000

Variants (``:<name>``): qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b, qwen3-14b, qwen2.5-3b, qwen2.5-7b, the
mixture of experts qwen3-30b-a3b (experts split over ``mesh.expert``, routing replay on), and ``tiny`` (a
2-layer test checkpoint on CPU: short contexts, few questions, 2 steps). The variant sets the
sizes and the mesh; the checkpoint itself always comes from ``--config.model.hf_dir`` (config.json,
safetensors and the tokenizer files; ``model.tokenizer_dir`` points elsewhere for the tokenizer).
``data.dir`` holds Search-R1 ``train`` / ``test`` (``.parquet`` or ``.jsonl``; also ``dev``, evaluated with
``--config.eval.split=dev``; a split the directory lacks stops the run at start, exit code 2). A row's
``prompt`` chat messages are rendered with the checkpoint's chat template, as Search-R1 trains on them; rows
with only a ``question`` get the ``react.template`` instruction. The retriever is a
Search-R1 HTTP server at ``retriever.url`` (``python -m trace_jax.envs.retrieval serve --corpus ...``), or
``--config.retriever.kind=bm25 --config.retriever.corpus=<corpus.jsonl>`` in process. No SFT warm start.
"""

import pathlib

import ml_collections

from trace_jax.configs import (
    BatchConfig,
    EngineConfig,
    EvalConfig,
    MeshConfig,
    ModelSourceConfig,
    ReActConfig,
    RecipeConfig,
    RetrieverConfig,
    SearchR1DataConfig,
    load_config_file,
    section,
    trim,
)

# name: (compute dtype, tensor-parallel ways, decode slots, context, per-turn tokens, prompts/step, rollouts/prompt,
#        learning rate). Contexts follow Search-R1 (4 turns of <= 500 tokens, 3 passages of <= 512 tokens each
# observation); "tiny" is sized for a CI smoke run on 2 CPU cores.
VARIANTS = {
    "tiny": ("float32", 1, 8, 384, 24, 4, 2.0, 1e-4),
    "qwen3-0.6b": ("bfloat16", 1, 128, 4096, 500, 64, 5.0, 1e-6),
    "qwen3-1.7b": ("bfloat16", 1, 128, 4096, 500, 64, 5.0, 1e-6),
    "qwen3-4b": ("bfloat16", 2, 128, 4096, 500, 64, 5.0, 1e-6),
    "qwen3-8b": ("bfloat16", 4, 128, 4096, 500, 64, 5.0, 1e-6),
    "qwen3-14b": ("bfloat16", 8, 128, 4096, 500, 64, 5.0, 1e-6),
    "qwen2.5-3b": ("bfloat16", 2, 128, 4096, 500, 64, 5.0, 1e-6),
    "qwen2.5-7b": ("bfloat16", 4, 128, 4096, 500, 64, 5.0, 1e-6),
    "qwen3-30b-a3b": ("bfloat16", 1, 128, 4096, 500, 64, 5.0, 1e-6),
}
# Mixture-of-experts variants: expert-parallel ways (``mesh.expert``; 128 experts split 8 ways, fsdp inside).
# Their sampler (bf16) and trainer (fp32 weights) may route a token differently, so the engine records every
# token's experts (sampled, prompt and observation tokens) and the trainer replays them (``engine.routing_replay``).
EXPERT_WAYS = {"qwen3-30b-a3b": 8}


def _default_config() -> ml_collections.ConfigDict:
    # Loaded by path: config files are run by ml_collections from anywhere, not imported as a package.
    return load_config_file(f"{pathlib.Path(__file__).with_name('default.py')}")


def get_config(variant: str = "qwen3-8b") -> ml_collections.ConfigDict:
    if variant not in VARIANTS:
        raise ValueError(f"unknown search_r1 variant {variant!r}; choose one of {sorted(VARIANTS)}")
    dtype, tensor, slots, max_len, turn_tokens, prompts, rollouts, lr = VARIANTS[variant]
    tiny = variant == "tiny"
    config = _default_config()  # the sampling and training sections; trim() drops what this recipe does not read
    config.recipe = section(RecipeConfig(kind="search_r1", variant=variant))
    # model.hf_dir (and data.dir) are given on the command line: where the checkpoint lives on each host.
    config.model = section(ModelSourceConfig(dtype=dtype, param_dtype="float32"))
    config.data = section(SearchR1DataConfig())
    config.retriever = section(RetrieverConfig(kind="http", url="http://127.0.0.1:8000", timeout_s=30.0))
    config.react = section(
        ReActConfig(
            template="search_r1",
            topk=3,
            max_turns=2 if tiny else 4,
            max_observation_tokens=48 if tiny else 512,
            chat_template=True,
            stop_variants=True,
        )
    )
    # Every id spelling of </search> and </answer> that ends in a completing token is a stop sequence
    # (envs/stops.py): 34 / 106 / 414 of them for Qwen-pattern byte-level BPEs of 16k / 48k / 151k ids trained
    # here on code and docs; 1024 leaves room for Qwen's own 151k vocabulary (the table is [S, 8] ids, one
    # compare per decode step). A tokenizer needing more stops the run at start with the flag to raise.
    config.engine = section(
        EngineConfig(
            max_slots=slots,
            max_len=max_len,
            steps_per_call=16 if tiny else 64,
            max_turn_tokens=turn_tokens,
            max_stop_sequences=1024,
            max_stop_len=8,
            routing_replay=variant in EXPERT_WAYS,
        )
    )
    buckets = tuple(b for b in (128, 256, 384, 512, 1024, 2048, 4096) if b <= max_len)
    config.batch = section(BatchConfig(length_buckets=buckets, fixed_length=True))
    config.allocation.rollouts_per_prompt = rollouts
    config.allocation.max_tokens_per_rollout = turn_tokens * config.react.max_turns
    config.allocation.prior_tokens_per_rollout = float(turn_tokens * 2)
    config.optim.learning_rate = lr
    # RL steps; the schedule spans rl.steps × ppo.ppo_epochs × ppo.mini_batches optimizer steps (schema.derived).
    config.rl.warmup_steps = 0 if tiny else 10
    config.rl.steps = 2 if tiny else 1000
    config.rl.prompts_per_step = prompts
    config.rl.checkpoint_every = 1 if tiny else 50
    # Search-R1 ships train / test; the run checks at start that data.dir has this split.
    config.eval = section(EvalConfig(split="test", num_questions=6 if tiny else 1000, every=0))
    config.mesh = section(MeshConfig(data=1, fsdp=-1, tensor=tensor, expert=EXPERT_WAYS.get(variant, 1)))
    return trim(config)  # no world, tokenizer, SFT or warm start: a Hugging Face checkpoint on Search-R1 data
