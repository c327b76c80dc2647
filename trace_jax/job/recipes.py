"""Where a run's policy, tokenizer, questions and retriever come from, chosen by ``config.recipe.kind``.

* ``synthetic`` (the default): the synthetic multi-hop world, a
  BPE trained on it, and a tiny Qwen3 warm-started by SFT on gold trajectories (``trace_jax.job.sft``).
* ``search_r1``: a Hugging Face Qwen2/Qwen3 checkpoint (``config.model.hf_dir``) loaded by ``load_hf``
  straight onto the run's mesh, its own tokenizer and chat template, Search-R1 question files read
  through TFDS + grain (``trace_jax.data.search_r1``), the retriever the ``retriever`` section names
  (BM25 over a corpus file or a Search-R1 HTTP server), no SFT. A row's own ``prompt`` chat messages are
  what the policy reads (``ReActEnv.prompt_ids``). At the end of training the policy is exported as a HF
  directory with the tokenizer files beside it (``<workdir>/hf_export``), keeping the input checkpoint's
  token ids and generation config.

Each kind is a :class:`RecipeSource` in ``SOURCES``. Export a run's newest policy by hand::

    python -m trace_jax.hf export --workdir runs/qwen3-8b --out exported/
"""

from __future__ import annotations

import dataclasses
import pathlib
import tempfile
from collections.abc import Callable
from typing import Any, Protocol

import jax
from flax import nnx

from trace_jax import paths
from trace_jax.checkpoint import adapters
from trace_jax.checkpoint.hf import HF_SIDE_FILES, TOKEN_ID_KEYS, hf_token_ids, load_hf, save_hf
from trace_jax.checkpoint.state import StateCheckpointer
from trace_jax.configs import RECIPES, Reads, RunConfig, schema
from trace_jax.data.prompts import PromptStream
from trace_jax.data.search_r1 import SearchR1Data
from trace_jax.data.tfds_builders import search_r1_files
from trace_jax.data.tokenizer import load_tokenizer
from trace_jax.envs.react import ReActEnv
from trace_jax.envs.retrieval.retriever import build_retriever
from trace_jax.job import build, cli
from trace_jax.models import ModelConfig, adapt, lora
from trace_jax.parallel import multihost
from trace_jax.registry import Registry

EXPORT_DIR = "hf_export"
# A LoRA policy's export: its adapters in PEFT's form, in this folder of the (merged) HF directory.
ADAPTER_DIR = "adapter"
# Everything of a HF checkpoint directory that describes its tokenizer and generation defaults.
TOKENIZER_FILES = HF_SIDE_FILES
GENERATION_CONFIG = "generation_config.json"


@dataclasses.dataclass
class Start:
    """Where a run starts: its world and policy (parameters on the mesh when one was given).

    source: which policy this is, for logs ("sft warm start", "hf checkpoint <dir>", "rl step 7").
    message: one console line about how the start was obtained.
    facts: reproducible facts for the summary's ``warm_start`` entry (always has ``reproducible``).
    directory: where the starting policy lives (the warm-start cache entry, the HF checkpoint).
    tokenizer_dir: the HF tokenizer directory of the policy (exported beside it).
    token_ids: the policy's ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` (those it has), written into
      an export's config.json.
    world_dir: a local folder whose ``tokenizer/`` rebuilds the world (``build.build_world``'s ``workdir``) in a
      sampling process; empty: ``directory``.
    """

    world: build.World
    model_config: ModelConfig
    params: nnx.State
    source: str
    message: str = ""
    facts: dict[str, Any] = dataclasses.field(default_factory=lambda: {"reproducible": True})
    directory: str = ""
    tokenizer_dir: str = ""
    token_ids: dict[str, Any] = dataclasses.field(default_factory=dict)
    world_dir: str = ""


class RecipeSource(Protocol):
    splits: tuple[str, ...]  # the splits ``world.world.questions`` knows
    reads: Reads  # the sections and keys of the run's config it reads (``trace_jax.configs.RECIPES``)

    def start(
        self,
        config: RunConfig,
        workdir: pathlib.Path,
        mesh: Any = None,
        progress: Callable[[int, str], Any] | None = None,
        notify: Callable[[str], Any] | None = None,
    ) -> Start:
        """The world (questions, the policy's tokenizer, the environment) and the starting policy.
        ``progress`` / ``notify``: console hooks for long work (a warm start)."""
        ...

    def prompt_stream(self, config: RunConfig, world: build.World) -> Any:
        """Training prompt batches: ``next_batch()``, ``state_dict()``, ``load_state_dict(state)``."""
        ...

    def finish(self, config: RunConfig, workdir: pathlib.Path, policy: Start) -> dict[str, str]:
        """Work after the last step (export); returns what it wrote, by name, for the summary."""
        ...


SOURCES: Registry[type] = Registry("recipe kind")


@SOURCES.register("synthetic")
class SyntheticSource:
    splits = ("train", "test", "ood")
    reads = RECIPES["synthetic"]

    def start(self, config, workdir, mesh=None, progress=None, notify=None):
        warm = build.build_warm_start(config, progress=progress, notify=notify)
        sft = warm.sft
        message = (
            f"warm start {'trained' if warm.trained else 'reused'}: {sft.steps} SFT steps, "
            f"loss {sft.final_loss:.3f} ({warm.entry.directory})"
        )
        return Start(
            warm.world,
            sft.model_config,
            sft.params,
            "sft warm start",
            message,
            warm.describe(),
            str(warm.entry.directory),
            str(warm.entry.local / "tokenizer"),  # where build.build_world keeps it
            _tokenizer_token_ids(warm.world.tokenizer),
            str(warm.entry.local),
        )

    def prompt_stream(self, config, world):
        rows = world.world.questions(config.rl.split)
        return PromptStream(rows, schema.prompts_drawn_per_step(config), config.seed, config.rl.pool_size)

    def finish(self, config, workdir, policy):
        return {}


def _tokenizer_token_ids(tokenizer: Any) -> dict[str, int]:
    ids = {key: getattr(tokenizer, key, None) for key in TOKEN_ID_KEYS}
    return {key: int(value) for key, value in ids.items() if value is not None}


def _check_splits(config: RunConfig) -> None:
    """Fails before anything is loaded when ``data.train_split`` or ``eval.split`` is not a file in ``data.dir``
    (a ``cli.ConfigError``: one line naming the splits found)."""
    data_dir = config.data.dir
    if not data_dir or not paths.as_path(data_dir).is_dir():
        return  # SearchR1Data says what is wrong with the directory itself
    found = sorted(search_r1_files(data_dir))
    for key, split in (("data.train_split", config.data.train_split), ("eval.split", config.eval.split)):
        if found and split not in found:
            raise cli.ConfigError(
                f"{key}={split!r} but data.dir={data_dir} holds the splits {found}: pass --config.{key}=<one of them>"
            )


def _tokenizer_dir(config: RunConfig) -> str:
    return config.model.tokenizer_dir or _hf_dir(config)


def _hf_dir(config: RunConfig) -> str:
    hf_dir = config.model.hf_dir
    if not hf_dir:
        raise ValueError("model.hf_dir is empty: pass --config.model.hf_dir=<a Qwen2/Qwen3 Hugging Face directory>")
    if not (paths.as_path(hf_dir) / "config.json").is_file():
        raise FileNotFoundError(f"model.hf_dir={hf_dir!r} has no config.json: it is not a Hugging Face checkpoint")
    return hf_dir


def _check_stop_table(config: RunConfig, env: ReActEnv, tokenizer_dir: str) -> None:
    """Fails before any model is loaded when the engine's stop table cannot hold the tokenizer's stop-tag
    spellings (``envs.stops.stop_id_sequences``)."""
    count, limit = len(env.stop_sequences), config.engine.max_stop_sequences
    if count > limit:
        raise ValueError(
            f"the tokenizer in {tokenizer_dir} spells the stop tags in {count} id sequences but "
            f"engine.max_stop_sequences={limit}: pass --config.engine.max_stop_sequences={count} or more"
        )


@SOURCES.register("search_r1")
class SearchR1Source:
    splits = ("train", "dev", "test")
    reads = RECIPES["search_r1"]

    def start(self, config, workdir, mesh=None, progress=None, notify=None):
        hf_dir = _hf_dir(config)
        _check_splits(config)
        tokenizer = load_tokenizer(_tokenizer_dir(config))
        retriever = build_retriever(config.retriever)
        env = ReActEnv(tokenizer, retriever, config.react)
        _check_stop_table(config, env, _tokenizer_dir(config))
        data = SearchR1Data(config.data, paths.as_path(workdir) / "tfds", publish=jax.process_index() == 0)
        dtypes = {k: getattr(config.model, k) for k in ("dtype", "param_dtype") if getattr(config.model, k)}
        model_config, params = load_hf(hf_dir, mesh=mesh, **dtypes)
        if len(tokenizer) > model_config.vocab_size:
            raise ValueError(
                f"the tokenizer has {len(tokenizer)} ids but {hf_dir} embeds only {model_config.vocab_size}; "
                "model.tokenizer_dir must be this checkpoint's tokenizer"
            )
        facts = {"hf_dir": hf_dir, "steps": 0, "reproducible": True}
        world = build.World(data, tokenizer, env)
        source = f"hf checkpoint {hf_dir}"
        message = f"policy: {hf_dir}"
        token_ids = hf_token_ids(hf_dir)
        return Start(world, model_config, params, source, message, facts, hf_dir, _tokenizer_dir(config), token_ids)

    def prompt_stream(self, config, world):
        # rl.pool_size and rl.split are the synthetic recipe's (``reads``): a search_r1 run streams its whole
        # data.train_split. Every process reads the whole step's batch: all of them run the scheduler over every
        # tree, and each samples the trees it owns (``trace_jax.cluster.sharded_rollouts``).
        return world.world.stream(config.data.train_split, schema.prompts_drawn_per_step(config), config.seed, 0, 1)

    def finish(self, config, workdir, policy):
        out = paths.as_path(workdir) / EXPORT_DIR
        params = jax.tree.map(multihost.to_host, policy.params)  # collective: the weights span every host
        if jax.process_index() == 0:
            export_policy(policy, params, out)
        return {EXPORT_DIR: str(out)}


def source_of(config: RunConfig) -> RecipeSource:
    """The source ``config.recipe.kind`` names."""
    return SOURCES[config.recipe.kind]()


def latest_policy(config: RunConfig, workdir: pathlib.Path, mesh: Any = None) -> tuple[Start, nnx.State, str]:
    """The newest policy of a run: the latest RL checkpoint's params, else the starting policy's; with the
    run's start (world, model config) and a description of which policy it is."""
    start = source_of(config).start(config, paths.as_path(workdir), mesh)
    # lora.rank > 0: the checkpoint holds the adapters alone; the policy is the start's base with them.
    model_config, params = adapt(start.model_config, start.params, config.lora, config.seed)
    restored = StateCheckpointer(paths.as_path(workdir) / build.CHECKPOINTS).restore_latest(
        target={"params": lora.trained_part(params)}, keys=["params"]
    )
    if restored is None:
        return start, start.params, start.source
    start = dataclasses.replace(start, model_config=model_config)
    return start, lora.with_trained_part(params, restored.state["params"]), f"rl step {restored.step}"


def export_policy(start: Start, params: nnx.State, out: str | pathlib.Path, max_shard_bytes: int = 0) -> pathlib.Path:
    """Writes ``params`` of the run that began at ``start`` as a HF checkpoint directory (``save_hf``, with
    the start's token ids in config.json; a LoRA policy merged, its adapters also in PEFT's form under
    ``ADAPTER_DIR``) and copies the tokenizer files of ``start.tokenizer_dir`` beside it,
    so ``AutoModelForCausalLM`` and ``AutoTokenizer`` both load ``out``; ``generation_config.json`` comes from
    the start checkpoint's directory when it has one. ``out`` may be a bucket URL: the directory is written
    locally, then copied up."""
    if paths.is_url(out):
        with tempfile.TemporaryDirectory() as local:
            export_policy(start, params, local, max_shard_bytes)
            paths.copy_tree(local, out)
        return paths.as_path(out)
    out = pathlib.Path(out)
    if lora.has_adapters(params):  # the merged model where the policy goes, its adapters in PEFT's form beside
        adapters.export(
            start.model_config, params, out / ADAPTER_DIR, start.directory, out, start.token_ids, max_shard_bytes
        )
    else:
        save_hf(start.model_config, params, out, max_shard_bytes, token_ids=start.token_ids)
    tokenizer_dir = paths.as_path(start.tokenizer_dir)  # local or a bucket
    copied = [name for name in TOKENIZER_FILES if (tokenizer_dir / name).is_file()]
    if "tokenizer.json" not in copied and "tokenizer.model" not in copied:
        raise FileNotFoundError(f"{tokenizer_dir} holds no tokenizer.json / tokenizer.model to export beside the model")
    for name in copied:
        (tokenizer_dir / name).copy(paths.as_path(out / name), overwrite=True)
    generation = paths.as_path(start.directory) / GENERATION_CONFIG if start.directory else None
    if generation is not None and generation.is_file():  # the checkpoint's own, when the tokenizer lives elsewhere
        generation.copy(paths.as_path(out / GENERATION_CONFIG), overwrite=True)
    return out


def export_run(workdir: str | pathlib.Path, out: str | pathlib.Path, max_shard_bytes: int = 0) -> str:
    """Exports the newest policy of the run in ``workdir`` (with its tokenizer files) to the HF directory
    ``out``; returns which policy it is ("rl step N" or the starting policy)."""
    run = paths.as_path(workdir)
    if not (run / build.CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{run} has no {build.CONFIG_FILE}: pass the --workdir of a trace_jax.train run")
    config = build.load_run_config(run)
    start, params, policy = latest_policy(config, run)
    export_policy(start, params, out, max_shard_bytes)
    return policy
