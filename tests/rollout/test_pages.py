"""Paged KV: the page pool's reference counts, and paged decoding with forks at several depths against the
contiguous cache (one page per slot)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trace_jax.models import ModelConfig, Qwen, abstract_model
from trace_jax.rollout.engine.engine import AppendItem, Engine, EngineConfig
from trace_jax.rollout.engine.pages import TRASH_PAGE, PagePool
from trace_jax.rollout.engine.sampling import SamplingConfig


def test_a_fork_shares_full_pages_and_copies_only_the_partial_one():
    pool = PagePool(num_pages=16, page_size=4, max_slots=3, pages_per_slot=4)
    pool.reserve(0, 10)  # pages for positions 0..9: three pages, the last partly filled
    assert pool.owned[0] == 3 and pool.in_use == 3
    held = pool.hold(0, 10)
    copy_from, copy_to = pool.fork(held, 1, 10)
    assert pool.table[1, :2].tolist() == pool.table[0, :2].tolist()  # full pages shared
    assert copy_from == pool.table[0, 2] and copy_to == pool.table[1, 2] != copy_from
    assert pool.in_use == 4 and pool.stats.fork_copies == 1
    assert pool.fork(held, 2, 8) == (TRASH_PAGE, TRASH_PAGE)  # a page-aligned prefix copies nothing
    pool.release(0)
    assert pool.in_use == 4, "the held prefix and the children keep the pages alive"
    pool.drop(held)
    pool.release(1)
    pool.release(2)
    assert pool.in_use == 0 and (pool.refcount[1:] == 0).all()
    with pytest.raises(RuntimeError, match="num_pages"):
        PagePool(num_pages=3, page_size=4, max_slots=1, pages_per_slot=4).reserve(0, 16)


CONFIG = ModelConfig.preset("qwen3-tiny", vocab_size=96)


def _tree_rollout(page_size: int):
    """Forks at depth 0 (the prompt), 1 and 2 (after observations), one of them after its source was freed.
    Returns per-slot (tokens, logprobs) of every turn, the page stats and the bytes of one page."""
    params = nnx.split(Qwen(CONFIG, rngs=nnx.Rngs(3)), nnx.Param)[1]
    params["embed"].value = params["embed"].value * 0.05  # unit-variance tied embeddings give peaky argmaxes
    engine_config = EngineConfig(
        max_slots=6, max_len=32, steps_per_call=4, max_turn_tokens=4, length_buckets=(32,), row_buckets=(6,),
        page_size=page_size, sampling=SamplingConfig.make_greedy(), weight_dtype=None,
    )  # fmt: skip
    engine = Engine(abstract_model(CONFIG)[0], CONFIG, engine_config)
    engine.set_params(params)
    turns: dict[int, list] = {slot: [] for slot in range(6)}

    def decode(state):
        state, out = engine.generate(None, state)
        for slot in np.flatnonzero(out.num_tokens):
            n = out.num_tokens[slot]
            turns[int(slot)].append((out.tokens[slot, :n].tolist(), out.logprobs[slot, :n]))
        return state

    state = engine.init_decode_state()
    state, first = engine.insert(None, state, [[5, 17, 3, 9, 42, 8, 1]], [0], [0], keep=True)
    state = engine.fork(state, [first.prefixes[0]] * 2, [1, 2], [1, 2])
    state = decode(state)
    state = engine.free_resource(state, [0])
    items = [AppendItem(1, [40, 41, 42], keep=True), AppendItem(2, [50, 51], keep=True)]
    state, second = engine.append(None, state, items)
    state = engine.fork(state, [*second.prefixes, first.prefixes[0]], [3, 4, 0], [3, 4, 5])
    state = decode(state)
    state, third = engine.append(None, state, [AppendItem(3, [60], keep=True)])
    state = engine.fork(state, third.prefixes, [5], [6])
    state = decode(state)
    page_bytes = 2 * CONFIG.num_layers * page_size * CONFIG.num_kv_heads * CONFIG.head_dim * 4
    return turns, state.pool.stats, page_bytes, engine, params, state


@pytest.fixture(scope="module")
def paged_and_contiguous():
    return _tree_rollout(4), _tree_rollout(32)


def test_paged_decode_equals_the_contiguous_engine_for_forks_at_several_depths(paged_and_contiguous):
    (paged, *_), (contiguous, *_) = paged_and_contiguous
    assert sum(len(t) for t in paged.values()) == 3 + 5 + 2 and paged.keys() == contiguous.keys()
    assert len({tuple(paged[s][-1][0]) for s in range(6)}) > 2, "premise: the forks decode different things"
    for slot in paged:
        for (tokens_p, logprobs_p), (tokens_c, logprobs_c) in zip(paged[slot], contiguous[slot], strict=True):
            assert tokens_p == tokens_c
            np.testing.assert_allclose(logprobs_p, logprobs_c, atol=1e-5)


def test_paged_forks_match_teacher_forcing_of_each_history(paged_and_contiguous):
    _, _, _, _, params, state = paged_and_contiguous[0]
    # Slot 5 was forked at depth 2; its last turn's log-probs must be those of its whole history, recomputed.
    model = nnx.merge(abstract_model(CONFIG)[0], params)
    history = [5, 17, 3, 9, 42, 8, 1]
    turns = paged_and_contiguous[0][0]
    history += turns[1][0][0] + [40, 41, 42] + turns[3][0][0] + [60]
    last = turns[5][-1]
    ids = jnp.asarray([history + last[0]])
    logp = np.asarray(jax.nn.log_softmax(model(ids).logits_btv[0], -1))
    start = len(history)
    expected = logp[np.arange(start - 1, start + len(last[0]) - 1), last[0]]
    np.testing.assert_allclose(last[1], expected, atol=1e-5)
    assert state.lengths[5] == len(history) + len(last[0])


def test_a_fork_copies_at_most_one_partial_page_per_child(paged_and_contiguous):
    # Measured on the pool's table and free list, not on its counters: a child references the held full pages
    # and takes exactly one new page, for the partly filled last one (none at a page boundary). Catches the
    # mutants "share one full page fewer" (full = length // page_size - 1) and "copy every page".
    pool = PagePool(num_pages=16, page_size=4, max_slots=3, pages_per_slot=4)
    pool.reserve(0, 14)
    held = pool.hold(0, 10)  # positions 0-9: two full pages and a partial one
    for child, length, full, partial in ((1, 10, 2, 1), (2, 8, 2, 0)):
        in_use = pool.in_use
        source, copy = pool.fork(held, child, length)
        assert pool.in_use - in_use == partial
        assert pool.table[child, :full].tolist() == held[:full]
        if partial:
            assert source == held[full] and copy == pool.table[child, full] and copy not in held
        else:
            assert source == copy == TRASH_PAGE
    assert pool.stats.fork_copies == 1 and pool.stats.shared_by_forks == 4  # the counters agree
    # In the engine's tree rollout: forks shared pages, and the paged pool takes fewer bytes than whole rows.
    (_, paged, paged_page, *_), (_, contiguous, contiguous_page, *_) = paged_and_contiguous
    assert paged.shared_by_forks > 0
    assert paged.fork_copies * paged_page * 4 <= contiguous.fork_copies * contiguous_page
    assert paged.allocated * paged_page < contiguous.allocated * contiguous_page


def test_a_sequence_started_from_held_pages_decodes_like_a_fresh_prefill():
    """``AppendItem.start``: the held history's pages are shared, only its last id is recomputed, and the
    continuation equals prefilling the whole history from scratch (greedy tokens, log-probs)."""
    params = nnx.split(Qwen(CONFIG, rngs=nnx.Rngs(3)), nnx.Param)[1]
    params["embed"].value = params["embed"].value * 0.05
    engine_config = EngineConfig(
        max_slots=4, max_len=32, steps_per_call=6, max_turn_tokens=6, length_buckets=(32,), row_buckets=(4,),
        page_size=4, sampling=SamplingConfig.make_greedy(), weight_dtype=None,
    )  # fmt: skip
    engine = Engine(abstract_model(CONFIG)[0], CONFIG, engine_config)
    engine.set_params(params)
    history = [5, 17, 3, 9, 42, 8, 1, 40, 41, 42]  # 10 ids: two full pages and a partial one
    state = engine.init_decode_state()
    state, first = engine.append(None, state, [AppendItem(0, history, reset=True, hold=True)])
    held = first.held[0]
    assert held.row is None and held.length == len(history)
    state = engine.free_resource(state, [0])  # the held pages outlive the slot
    allocated = state.pool.stats.allocated
    tokens_before = engine.counters["append_tokens"]
    items = [AppendItem(1, history, reset=True, seed=1, start=held), AppendItem(2, history, reset=True, seed=1)]
    state, _ = engine.append(None, state, items)
    assert state.pool.table[1, :2].tolist() == held.pages[:2], "full pages are shared, not recomputed"
    assert state.pool.table[1, 2] != held.pages[2]
    assert state.pool.stats.allocated - allocated == 1 + 3  # slot 1: its copy of the partial page; slot 2: 3
    state, out = engine.generate(None, state)
    assert out.num_tokens[1] == out.num_tokens[2] == 6
    assert out.tokens[1].tolist() == out.tokens[2].tolist()
    np.testing.assert_allclose(out.logprobs[1], out.logprobs[2], atol=1e-5)
    np.testing.assert_allclose(out.hidden[1], out.hidden[2], atol=1e-5)
    assert engine.counters["append_tokens"] - tokens_before == 1 + len(history)  # ids run through the model
