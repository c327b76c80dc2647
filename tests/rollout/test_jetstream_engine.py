"""JetStream's own orchestrator drives ``JetStreamEngine``: greedy requests get the engine's own tokens.

Needs google-jetstream (``pip install -e ".[jetstream]"``: TensorFlow comes with it through seqio, +2.2 GB), which
the ``test`` extra leaves out: there this module skips. CI runs it in a second environment with the extra
(``.ci/jetstream``), where ``TRACE_JAX_REQUIRE_JETSTREAM=1`` makes a missing JetStream a failure instead of a skip."""

import asyncio
import importlib
import logging
import os

import pytest
from flax import nnx

if os.environ.get("TRACE_JAX_REQUIRE_JETSTREAM"):
    importlib.import_module("jetstream.engine.engine_api")  # CI's JetStream environment: absent is an error
else:
    pytest.importorskip(
        "jetstream.engine.engine_api",
        reason='google-jetstream is not installed (pip install -e ".[jetstream]"; +2.2 GB with TensorFlow)',
    )

from jetstream.core.proto import jetstream_pb2

from trace_jax.models import ModelConfig, Qwen, abstract_model
from trace_jax.rollout.engine.engine import Engine, EngineConfig
from trace_jax.rollout.engine.jetstream import JetStreamEngine
from trace_jax.rollout.engine.sampling import SamplingConfig

CONFIG = ModelConfig.preset("qwen3-tiny", vocab_size=96)
PROMPTS = [[5, 17, 3, 9, 42, 8, 1], [64, 2], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [7, 7, 30]]
MAX_TOKENS = 9
DEADLINE_S = 180  # the first run compiles; under load it takes ~30 s


def _engine(params, **fields) -> Engine:
    base = dict(max_len=64, length_buckets=(64,), sampling=SamplingConfig.make_greedy(), weight_dtype=None)
    engine = Engine(abstract_model(CONFIG)[0], CONFIG, EngineConfig(**{**base, **fields}))
    engine.set_params(params)
    return engine


@pytest.fixture(scope="module")
def params():
    params = nnx.split(Qwen(CONFIG, rngs=nnx.Rngs(3)), nnx.Param)[1]
    params["embed"].value = params["embed"].value * 0.05  # unit-variance tied embeddings give peaky argmaxes
    return params


@pytest.fixture(scope="module")
def reference(params):
    """Each prompt's greedy tokens from the engine alone: all prompts in one insert, several steps a call."""
    engine = _engine(params, max_slots=len(PROMPTS), steps_per_call=4)
    state = engine.init_decode_state()
    slots = list(range(len(PROMPTS)))
    state, _ = engine.insert(None, state, PROMPTS, slots, [0] * len(PROMPTS), greedy=True, turn_limit=MAX_TOKENS)
    tokens = [[] for _ in PROMPTS]
    while state.running.any():
        state, out = engine.generate(None, state)
        for slot in slots:
            tokens[slot] += out.tokens[slot, : out.num_tokens[slot]].tolist()
    return tokens


@pytest.fixture(scope="module")
def served_engine(params):
    """Two JetStream slots (and the scratch slot) for four requests: slots are reused."""
    return _engine(params, max_slots=3, steps_per_call=1)


@pytest.fixture(scope="module")
def orchestrator():
    # Importing JetStream's orchestrator sets the root logger to DEBUG with a stdout handler; undo that after.
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    from jetstream.core import orchestrator

    root.setLevel(level)
    root.handlers[:] = handlers
    return orchestrator


class WordTokenizer:
    """Ids written as words: ``encode("5 17") == [5, 17]``, ``decode([5]) == "5 "``."""

    def encode(self, text: str) -> list[int]:
        return [int(word) for word in text.split()]

    def decode(self, ids: list[int]) -> str:
        return "".join(f"{i} " for i in ids)


def _serve(orchestrator, served: JetStreamEngine, interleaved: bool, text: bool = False) -> list:
    """Every prompt sent to JetStream's orchestrator at once; what each request gets back: its ids, or with
    ``text`` (the prompt sent as words, tokenized by the served tokenizer) its text."""
    weights = served.load_params()
    driver = orchestrator.Driver([served], [served], [weights], [weights], interleaved_mode=interleaved)
    server = orchestrator.LLMOrchestrator(driver)

    async def decode(prompt):
        if text:
            content = {"text_content": jetstream_pb2.DecodeRequest.TextContent(text=" ".join(map(str, prompt)))}
        else:
            content = {"token_content": jetstream_pb2.DecodeRequest.TokenContent(token_ids=prompt)}
        ids, words = [], ""
        async for response in server.Decode(jetstream_pb2.DecodeRequest(max_tokens=MAX_TOKENS, **content)):
            ids += list(response.stream_content.samples[0].token_ids)
            words += response.stream_content.samples[0].text
        return words if text else ids

    async def decode_all():
        # A request JetStream never sees end (its lengths or validity misreported) fails here, not hangs.
        return await asyncio.wait_for(asyncio.gather(*(decode(prompt) for prompt in PROMPTS)), DEADLINE_S)

    try:
        return asyncio.run(decode_all())
    finally:
        driver.stop()


@pytest.mark.parametrize(
    "interleaved, stop", [(True, False), (False, False), (True, True)], ids=["interleaved", "disaggregated", "stop"]
)
def test_jetstream_orchestrator_decodes_the_engines_greedy_tokens(
    orchestrator, served_engine, reference, interleaved, stop
):
    """Fails if ``prefill`` keeps JetStream's BOS, if ``insert`` forks the wrong prefix or into the wrong slot
    or recomputes the prompt, if a reused slot keeps its old sequence, or if ``ResultTokens`` misreports
    lengths (max_tokens) or validity (``stop``: a stop sequence only the engine knows ends a request)."""
    assert all(len(ids) == MAX_TOKENS for ids in reference)
    assert len({tuple(ids) for ids in reference}) == len(PROMPTS)  # distinct: a swap of requests shows
    expected, stops = reference, ()
    if stop:  # the first id of request 0 past its second that it has not sampled before
        last = next(t for i, t in enumerate(reference[0]) if i >= 2 and t not in reference[0][:i])
        stops = [[last]]
        expected = [ids[: ids.index(last) + 1] if last in ids else ids for ids in reference]
        assert expected != reference
    served = JetStreamEngine(served_engine, stop_sequences=stops)
    assert served.max_concurrent_decodes == 2 < len(PROMPTS)  # requests wait for a freed slot
    counters = dict(served_engine.counters)
    assert _serve(orchestrator, served, interleaved) == expected
    # One prefill (append) per request, then one fork into its slot: the prompt is never computed twice.
    for name in ("append_calls", "forked_sequences"):
        assert served_engine.counters[name] - counters.get(name, 0) == len(PROMPTS)


def test_text_requests_go_through_the_served_tokenizer(orchestrator, served_engine, reference):
    """Fails if ``EngineTokenizer.encode`` lets a BOS reach the engine or its ids differ from the tokenizer's,
    or if ``decode`` is not the given tokenizer's."""
    served = JetStreamEngine(served_engine, tokenizer=WordTokenizer())
    assert _serve(orchestrator, served, True, text=True) == [WordTokenizer().decode(ids) for ids in reference]
