"""The real recipe: a Hugging Face Qwen3 checkpoint, Search-R1 files and a retrieval server, through TRACE
training and back out to Hugging Face; token-in/token-out across turns; a stalled server mid-run.

The checkpoint is a tiny random Qwen3 saved by transformers, with a byte-level BPE trained here (Qwen's
pre-tokenizer, special tokens and a ChatML template; ``</search>`` is several ids). Its embedding and head
carry one planted chain (``tests/search_r1_fixtures.py``) so that its rollouts call the search tool. The
data directory is Search-R1's ``train`` (parquet, with each row's chat ``prompt``) / ``test`` (jsonl).
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from tests import search_r1_fixtures as fixtures
from tests.helpers import torch_logits
from trace_jax.checkpoint.hf import load_hf
from trace_jax.checkpoint.state import StateCheckpointer
from trace_jax.configs import load_config_file, validate
from trace_jax.data.tokenizer import load_tokenizer
from trace_jax.envs.react import (
    OBSERVATION_CLOSE,
    OBSERVATION_OPEN,
    RETRIEVAL_FAILED_TEXT,
    STOP_TAGS,
    format_passages,
)
from trace_jax.envs.retrieval.retriever import BM25Retriever, HttpRetriever, make_server
from trace_jax.envs.stops import stop_id_sequences
from trace_jax.job import build, cli, recipes
from trace_jax.job.commands import hf_main
from trace_jax.job.evaluate import evaluate
from trace_jax.models import abstract_model
from trace_jax.rl.advantages import compute_advantages
from trace_jax.rl.batch import BatchConfig, build_batch

REPO = pathlib.Path(__file__).resolve().parents[2]
TINY = f"{REPO}/configs/search_r1.py:tiny"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return fixtures.write_all(tmp_path_factory.mktemp("search_r1"))


class StallingRetriever:
    """BM25 behind the server, counting the queries it answered; every ``stall_every``-th search call first
    sleeps ``stall_s`` (past the client's deadline: that call fails, the next ones are answered)."""

    def __init__(self, inner, stall_every: int = 0, stall_s: float = 0.0):
        self.inner, self.queries, self.calls, self.stalls = inner, 0, 0, 0
        self.stall_every, self.stall_s = stall_every, stall_s

    def search(self, queries, topk):
        self.calls += 1
        self.queries += len(queries)
        if self.stall_every and self.calls % self.stall_every == 0:
            self.stalls += 1
            time.sleep(self.stall_s)
        return self.inner.search(queries, topk)


def tiny_config(files, **retriever) -> ml_collections.ConfigDict:
    config = load_config_file(TINY)
    config.model.hf_dir = str(files["hf"])
    config.data.dir = str(files["data"])
    config.retriever.update(retriever)
    return config


def test_train_over_a_stalling_http_server_checkpoints_evaluates_and_exports_what_transformers_loads(files, tmp_path):
    """One whole run covers the recipe end to end (on Search-R1's train / test splits, with no split flag) and
    a retrieval server that stalls on some calls."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert sorted(p.name for p in files["data"].iterdir()) == ["test.jsonl", "train.parquet"]  # premise: no dev

    timeout_s = 1.0
    counting = StallingRetriever(BM25Retriever.from_jsonl(files["corpus"]), stall_every=3, stall_s=1.3 * timeout_s)
    server = make_server(counting, port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    workdir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "trace_jax.train",
        f"--config={TINY}",
        f"--config.model.hf_dir={files['hf']}",
        f"--config.data.dir={files['data']}",
        f"--config.retriever.url=http://127.0.0.1:{server.server_port}",
        f"--config.retriever.timeout_s={timeout_s}",
        "--config.loss.entropy_coef=0.01",  # a gradient even when every reward ties, so the policy moves
        f"--workdir={workdir}",
    ]
    try:
        run = subprocess.run(
            command, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=900
        )
    finally:
        server.shutdown()
        server.server_close()
    assert run.returncode == 0, run.stderr[-4000:]
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["steps"] == 2
    assert counting.queries >= 8  # every rollout of both steps and both evaluations searched over HTTP
    # A stalled search cost one deadline, was counted in the step's metrics, and the run went on.
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    failures = sum(r.get("rollout/retrieval_failures", 0) for r in records)
    assert counting.stalls >= 1 and 1 <= failures <= counting.stalls, (counting.stalls, failures)
    assert not any("eval.split" in arg for arg in command)
    assert [row["group"] for row in summary["eval_after"]] == ["hotpotqa", "nq", "all"]  # EM/F1 per source
    assert StateCheckpointer(workdir / build.CHECKPOINTS).latest_step() == 2

    export = pathlib.Path(summary["exports"][recipes.EXPORT_DIR])
    config = build.load_run_config(workdir)
    start, params, source = recipes.latest_policy(config, workdir)
    world = start.world
    assert source == "rl step 2"
    _, initial = load_hf(files["hf"])
    pairs = zip(jax.tree.leaves(params), jax.tree.leaves(initial), strict=True)
    moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in pairs)
    assert moved > 1e-6  # premise: the export is the trained policy, not the checkpoint we started from

    tokenizer = AutoTokenizer.from_pretrained(export)
    assert tokenizer.chat_template and tokenizer.get_vocab() == world.tokenizer.get_vocab()
    ids = np.asarray([world.env.prompt_ids(world.world.questions("test")[0])])
    model = nnx.merge(abstract_model(start.model_config)[0], params)
    ours = np.asarray(model(jnp.asarray(ids))[0])  # ModelOutput: logits first
    theirs = torch_logits(AutoModelForCausalLM.from_pretrained(export).eval(), ids)
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)

    assert hf_main(["export", "--workdir", str(workdir), "--out", str(tmp_path / "again")]) == 0  # the CLI, by hand
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again").eval()
    np.testing.assert_array_equal(torch_logits(again, ids), theirs)
    assert AutoTokenizer.from_pretrained(tmp_path / "again").get_vocab() == world.tokenizer.get_vocab()

    # Both exports keep the input checkpoint's token ids and generation config (catches a config.json written
    # from the architecture alone, which loses bos/eos).
    source_config = json.loads((files["hf"] / "config.json").read_text())
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    assert source_config["bos_token_id"] != source_config["eos_token_id"]  # premise: two distinct ids to keep
    for out in (export, tmp_path / "again"):
        exported = json.loads((out / "config.json").read_text())
        assert {k: exported.get(k) for k in keys} == {k: source_config[k] for k in keys}
        generation = (files["hf"] / recipes.GENERATION_CONFIG).read_text()
        assert (out / recipes.GENERATION_CONFIG).read_text() == generation


def test_a_stop_table_over_the_engine_maximum_fails_at_start_with_the_flag_to_raise(files, tmp_path):
    config = tiny_config(files, kind="bm25", corpus=str(files["corpus"]))
    tokenizer = load_tokenizer(files["hf"])
    count = len(stop_id_sequences(tokenizer, STOP_TAGS, config.react.max_stop_len))
    assert 2 < count <= config.engine.max_stop_sequences  # premise: several spellings, and they fit
    config.engine.max_stop_sequences = count - 1
    run = validate.validate(config)
    with pytest.raises(ValueError, match=f"--config.engine.max_stop_sequences={count} or more"):
        recipes.source_of(run).start(run, tmp_path)


def test_an_eval_split_the_data_lacks_stops_the_start_with_a_config_error_naming_the_splits(files, tmp_path):
    config = tiny_config(files, kind="bm25", corpus=str(files["corpus"]))
    assert config.eval.split == "test"  # premise: the recipe's default is a split Search-R1 ships
    config.eval.split = "dev"
    run = validate.validate(config)
    with pytest.raises(cli.ConfigError, match=r"eval.split='dev' .*\['test', 'train'\]") as raised:
        recipes.source_of(run).start(run, tmp_path)
    assert raised.value.exit_code == cli.ExitCode.CONFIG  # exit code 2, before anything is loaded
    assert not (tmp_path / "tfds").exists()


@pytest.fixture(scope="module")
def greedy_run(files, tmp_path_factory):
    """A greedy runner of the tiny checkpoint in the search_r1 world (BM25 over the corpus in process)."""
    workdir = tmp_path_factory.mktemp("world")
    config = validate.validate(tiny_config(files, kind="bm25", corpus=str(files["corpus"])))
    start = recipes.source_of(config).start(config, workdir)
    runner = build.build_runner(config, start.model_config, start.params, start.world, greedy=True)
    return start.world, runner


def test_the_first_rollout_reads_the_rows_chat_prompt_then_the_sampled_ids_and_observations_masked(files, greedy_run):
    """The run's first training prompt is its parquet row's ``prompt`` messages in the checkpoint's chat
    template (catches rendering ``question`` with the project's own template instead); the trainer sees the
    sampled ids, then the observation ids with loss mask zero exactly on them."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    world, runner = greedy_run
    env, tokenizer = world.env, world.tokenizer
    config = validate.validate(tiny_config(files, kind="bm25", corpus=str(files["corpus"])))
    task = recipes.source_of(config).prompt_stream(config, world).next_batch()[0]
    (row,) = [r for r in pq.read_table(files["data"] / "train.parquet").to_pylist() if r["id"] == task["id"]]
    hf_tokenizer = AutoTokenizer.from_pretrained(files["hf"])
    prompt = hf_tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, return_dict=False)
    by_template = env.prompt_ids({"question": row["question"], "golden_answers": ["x"]}).tolist()
    assert prompt != by_template and fixtures.SYSTEM_PROMPT in hf_tokenizer.decode(prompt)  # premise: they differ
    (tree,) = evaluate(runner, env, [task]).trees
    assert tree[0].token_ids.tolist() == prompt
    (leaf,) = tree.leaves()
    turns = [tree[i] for i in tree.path(leaf) if i != 0]
    assert len(turns) == 2 and turns[0].info["action"] == "search"  # premise: a multi-turn trajectory
    planted = tokenizer.encode(fixtures.PLANTED_TURN, add_special_tokens=False)
    assert turns[0].token_ids.tolist() == planted  # the engine's greedy ids, stopped on a merged "</search>\n"
    (passages,) = env.retriever.search([turns[0].info["query"]], env.config.topk)
    assert passages  # premise: the observation holds passages
    observation = (
        tokenizer.encode(OBSERVATION_OPEN, add_special_tokens=False)
        + tokenizer.encode(format_passages(passages), add_special_tokens=False)[: env.config.max_observation_tokens]
        + tokenizer.encode(OBSERVATION_CLOSE, add_special_tokens=False)
    )
    assert turns[0].observation_ids.tolist() == observation  # tokenized once, piece by piece

    batch, info = build_batch([tree], compute_advantages("grpo", [tree]), BatchConfig(length_buckets=(512,)))
    assert info.num_rows == 1  # one tree with one leaf: its one path, in the default (tree-packed) layout
    row = 0
    want = prompt + turns[0].token_ids.tolist() + observation + turns[1].token_ids.tolist()
    n = int(batch.lengths[row])
    assert batch.tokens[row, :n].tolist() == want
    mask = [0] * len(prompt) + [1] * len(turns[0].token_ids) + [0] * len(observation) + [1] * len(turns[1].token_ids)
    assert batch.loss_mask[row, :n].tolist() == mask


def test_the_engine_turn_ends_at_a_stop_tag_its_id_table_misses_and_the_next_turn_reads_the_kept_ids(
    files, greedy_run, tmp_path
):
    """A checkpoint writing ``" </search>"`` (a leading-space merge the id table does not list) on the real
    engine: the turn is cut at the completing id, the slot restarted from the kept history, and the next
    turn's log-probs equal a plain forward over prompt + kept ids + observation."""
    world, runner = greedy_run
    env, tokenizer = world.env, world.tokenizer
    turn = "<search> Quilon </search>\n"
    ids = tokenizer.encode(turn, add_special_tokens=False)
    table = [tuple(s) for s in env.stop_sequences]
    assert not any(tuple(ids[n - len(s) : n]) == s for s in table for n in range(len(s), len(ids) + 1))  # premise
    model_config, params = load_hf(fixtures.write_checkpoint(tmp_path / "hf", tokenizer, turn))
    spaced = build.build_runner(
        validate.validate(tiny_config(files, kind="bm25", corpus=str(files["corpus"]))), model_config, params, world,
        greedy=True,
        engine=runner.engine,
    )  # fmt: skip
    task = world.world.questions("test")[0]
    try:
        (tree,) = evaluate(spaced, env, [task]).trees
    finally:
        runner.set_params(load_hf(files["hf"])[1])  # the shared engine back on the fixture's checkpoint
    (leaf,) = tree.leaves()
    first, second = (tree[i] for i in tree.path(leaf) if i != 0)
    assert first.token_ids.tolist() == ids and first.info["stop_reason"] == "stop_sequence"
    assert first.info["action"] == "search" and len(first.observation_ids)
    history = np.concatenate([env.prompt_ids(task), first.token_ids, first.observation_ids, second.token_ids])
    model = nnx.merge(abstract_model(model_config)[0], params)
    logprobs = np.asarray(jax.nn.log_softmax(model(jnp.asarray(history[None]))[0][0], axis=-1))
    start = len(history) - len(second.token_ids)
    rows = logprobs[np.arange(start - 1, len(history) - 1)]
    np.testing.assert_allclose(second.logprobs, rows[np.arange(len(rows)), second.token_ids], atol=1e-4)
    assert second.token_ids.tolist() == rows.argmax(-1).tolist()  # still greedy after the observation


def test_a_stalled_retrieval_server_costs_bounded_time_per_search_is_counted_and_the_run_goes_on(greedy_run):
    world, runner = greedy_run
    env = world.env
    stalled = socket.socket()  # listens and never answers: connections sit in the backlog
    stalled.bind(("127.0.0.1", 0))
    stalled.listen(64)
    client = HttpRetriever(f"http://127.0.0.1:{stalled.getsockname()[1]}", timeout_s=0.5, max_attempts=3)
    bm25, env.retriever, failures_before = env.retriever, client, env.retrieval_failures
    tasks = world.world.questions("test")[:4]
    try:
        start = time.monotonic()
        result = evaluate(runner, env, tasks)
        elapsed = time.monotonic() - start
    finally:
        env.retriever = bm25
        stalled.close()
    searches = env.retrieval_failures - failures_before
    assert searches == len(tasks) and client.failures == len(tasks)  # every search failed, each counted once
    assert all(len(tree.leaves()) == 1 for tree in result.trees)  # every rollout still reached a leaf
    failed_obs = [tree[1].observation_ids for tree in result.trees]
    assert all(world.tokenizer.decode(ids.tolist()).count(RETRIEVAL_FAILED_TEXT.strip()) == 1 for ids in failed_obs)
    assert elapsed < searches * (0.5 + 0.5) + 30  # the deadline per search, plus decoding; not a hang


def in_bucket(files: dict[str, pathlib.Path], gcs: Any) -> list[str]:
    """Copies ``fixtures.write_all``'s checkpoint, question files and corpus into the emulated bucket ``gcs``
    (``tests.gcs_emulator``) and returns the job's overrides that read every one of them from there: BM25 over the
    bucket's corpus, one RL step, two evaluation questions."""
    from etils import epath

    from trace_jax import paths

    paths.copy_tree(files["hf"], gcs.gs("hf"))
    paths.copy_tree(files["data"], gcs.gs("data"))
    epath.Path(files["corpus"]).copy(epath.Path(gcs.gs("corpus.jsonl")))
    return [
        f"--config.model.hf_dir={gcs.gs('hf')}",
        f"--config.data.dir={gcs.gs('data')}",
        "--config.retriever.kind=bm25",
        f"--config.retriever.corpus={gcs.gs('corpus.jsonl')}",
        "--config.rl.steps=1",
        "--config.eval.num_questions=2",
    ]


def test_a_lora_run_reads_every_input_from_a_bucket_and_exports_there_what_transformers_and_peft_load(files, tmp_path):
    """The recipe with LoRA by one override (``lora.rank``), the checkpoint, its tokenizer, ``data.dir``, the BM25
    corpus and the workdir (so the prepared TFDS files too) all ``gs://`` in an emulated bucket, nothing of them on
    this disk: a 1-step run exits 0 and ``hf_export/`` lands in the bucket (after a download): transformers loads the
    merged model, and peft loads ``adapter/`` (rank 4) onto the original checkpoint (the logits' agreement is
    ``tests/checkpoint/test_adapters.py``'s). Fails on any reader that assumes a local path (``pathlib.Path`` /
    ``open`` on ``data.dir`` or the corpus: not found) and on a recipe that ignores ``lora.rank`` (no adapter)."""
    import peft
    from etils import epath
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.gcs_emulator import gcs_emulator
    from trace_jax import paths

    with gcs_emulator("bucket") as gcs:
        inputs = in_bucket(files, gcs)
        command = [
            *(sys.executable, "-m", "trace_jax.train", f"--config={TINY}", *inputs),
            *("--config.lora.rank=4", f"--workdir={gcs.gs('run')}"),
        ]
        env = dict(os.environ, PYTHONPATH=str(REPO), **gcs.env)
        run = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-4000:]
        bucket = epath.Path(gcs.gs(""))
        assert (bucket / "run" / "tfds").is_dir()  # premise: the prepared questions were kept in the bucket
        export = bucket / "run" / recipes.EXPORT_DIR
        assert (export / "config.json").is_file()
        assert (export / recipes.ADAPTER_DIR / "adapter_config.json").is_file()
        paths.copy_tree(export, tmp_path / "export")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "export")
    assert tokenizer.get_vocab() == load_tokenizer(files["hf"]).get_vocab()
    ids = np.asarray([tokenizer.encode("Where was Kalo born?")])
    assert np.isfinite(torch_logits(merged, ids)).all()
    adapter = tmp_path / "export" / recipes.ADAPTER_DIR
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 4
    adapted = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(files["hf"]), adapter).eval()
    assert np.isfinite(torch_logits(adapted, ids)).all()  # shapes of every factor match the base's (else it raises)
