"""JetStream's ``Engine`` interface over the decode engine, so JetStream's orchestrator and gRPC server serve a
policy trained here (evaluation, demos). Needs ``pip install -e ".[jetstream]"`` (google-jetstream, which
pulls TensorFlow through seqio); nothing else in the package imports this module.

    engine = Engine.for_model(model_config, EngineConfig(max_slots=9, sampling=SamplingConfig.make_greedy()))
    served = JetStreamEngine(engine, params=params, eos_ids=(eos,), tokenizer=hf_tokenizer)
    driver = orchestrator.Driver([served], [served], [served.load_params()], [served.load_params()],
                                 interleaved_mode=True)

How JetStream's calls map onto the engine's:

* ``prefill`` appends the prompt to a scratch slot (the engine's last one, never offered to JetStream) and
  keeps it as a ``Prefix``: its KV pages are held and its next-token logits banked; the slot is freed at once;
* ``insert`` forks that prefix into the orchestrator's slot (its full pages are shared, nothing is
  recomputed), freeing whatever the slot held first, then drops the prefix;
* ``generate`` is one engine ``generate`` call: up to ``steps_per_call`` tokens per running slot, returned as
  ``ResultTokens`` with that many columns (a token past a slot's stop is invalid, which JetStream reads as
  done). A request's ``max_tokens`` is checked by JetStream once per call, so with ``steps_per_call = k`` it
  gets the largest multiple of k tokens up to ``max_tokens`` (``k = 1``: exactly ``max_tokens``).

Threads: JetStream prefills and generates from different threads; every engine call here runs under one
lock, since the engine's state is one host object. Prefixes waiting between ``prefill`` and ``insert`` hold
bank rows and pages; a semaphore bounds them to what the pool holds beside every slot at ``max_len``, and
``prefill`` waits for a ticket (JetStream's queues are bounded, so ``insert`` keeps returning them).

JetStream prepends ``tokenizer.bos_id`` to every fresh request; with no BOS (Qwen) the tokenizer reports
``NO_ID`` (-1, never an id) and ``prefill`` drops it. A slot JetStream has finished with keeps decoding (the
interface has no call that says so) until the orchestrator inserts into it again: wasted steps, never wrong
tokens.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jetstream.engine import engine_api, token_utils, tokenizer_api, tokenizer_pb2

from trace_jax.rollout.engine.engine import AppendItem, Engine, Prefix, SlotState

# No token has this id: the BOS of a model without one, the EOS of a tokenizer without one.
NO_ID = -1
# JetStream pads prompts to one of these lengths and needs max_prefill_length to be one of them.
PREFILL_BUCKETS = tuple(2**i for i in range(4, 16))

# google-jetstream 0.2.2's orchestrator deletes each inserted prefix with ``jax.tree_map``, which JAX has
# since removed; without the alias its generate thread dies (and takes the process with it).
if not hasattr(jax, "tree_map"):
    jax.tree_map = jax.tree.map


class EngineTokenizer(tokenizer_api.Tokenizer):
    """JetStream's tokenizer over any object with ``encode(str) -> ids`` and ``decode(ids) -> str`` (a
    ``transformers`` tokenizer); ``None`` serves token-id requests only. ``eos_ids`` end a request."""

    def __init__(self, tokenizer: Any = None, eos_ids: Sequence[int] = (), bos_id: int | None = None):
        self._tokenizer, self._eos_ids, self._bos_id = tokenizer, tuple(int(i) for i in eos_ids), bos_id

    def _require(self) -> Any:
        if self._tokenizer is None:
            raise ValueError("this JetStreamEngine has no tokenizer: send token_content requests, or pass tokenizer=")
        return self._tokenizer

    def encode(self, s: str, **kwargs) -> tuple[Any, int]:
        ids = np.asarray(self._require().encode(s), np.int32)
        return token_utils.pad_tokens(ids, self.bos_id, self.pad_id, **kwargs)

    def decode(self, token_ids: list[int], **kwargs) -> str:
        return self._require().decode(token_ids)

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def eos_id(self) -> int:
        return self._eos_ids[0] if self._eos_ids else NO_ID

    @property
    def bos_id(self) -> int:
        return NO_ID if self._bos_id is None else self._bos_id

    @property
    def stop_tokens(self) -> set[int]:
        return set(self._eos_ids)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Prefilled:
    """What ``prefill`` hands JetStream: a kept ``Prefix`` (host handle; the pages stay in the engine's pool). A
    pytree with no leaves, so the orchestrator's ``device_put`` and deletion of it are no-ops."""

    prefix: Prefix

    def tree_flatten(self):
        return (), self.prefix

    @classmethod
    def tree_unflatten(cls, prefix, children):
        return cls(prefix)


class JetStreamEngine(engine_api.Engine):
    """``jetstream.engine.engine_api.Engine`` over an ``Engine`` (see the module docstring).

    Args:
      engine: the decode engine; JetStream gets ``max_slots - 1`` slots (the last is the prefill scratch slot).
      params: weights to serve (``engine.set_params``); ``None``: the engine's current copy.
      tokenizer: for text requests (``EngineTokenizer``); ``None``: token-id requests only.
      eos_ids / stop_sequences: end a sequence on device (JetStream also stops on ``eos_ids``).
      bos_id: the model's BOS id; ``None``: it has none (the one JetStream prepends is dropped).
      greedy: argmax decoding; otherwise the engine's ``sampling`` with seeds ``seed``, ``seed + 1``, ...
      max_prefill_length: longest prompt (one of ``PREFILL_BUCKETS``); default the largest below ``max_len``.
      warmup: compile the engine's whole program set now (``Engine.warmup``) rather than on first use.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        params: Any = None,
        tokenizer: Any = None,
        eos_ids: Sequence[int] = (),
        stop_sequences: Sequence[Sequence[int]] = (),
        bos_id: int | None = None,
        greedy: bool = True,
        seed: int = 0,
        max_prefill_length: int | None = None,
        warmup: bool = False,
    ):
        cfg = engine.config
        if cfg.max_slots < 2:
            raise ValueError(f"EngineConfig.max_slots={cfg.max_slots}: JetStream needs one slot plus the scratch slot")
        below = [b for b in PREFILL_BUCKETS if b < cfg.max_len]
        self._max_prefill = max_prefill_length or (below[-1] if below else 0)
        if self._max_prefill not in below:
            raise ValueError(
                f"max_prefill_length={self._max_prefill} must be one of {below} (JetStream's prefill buckets below "
                f"EngineConfig.max_len={cfg.max_len})"
            )
        self.engine, self.greedy, self._seed = engine, greedy, seed
        if params is not None:
            engine.set_params(params)
        self.tokenizer = EngineTokenizer(tokenizer, eos_ids, bos_id)
        self._lock = threading.Lock()
        self._state = engine.init_decode_state(stop_sequences, eos_ids)
        self._scratch = cfg.max_slots - 1
        self._generated = np.zeros(cfg.max_slots, np.int32)  # tokens each slot's request has been sent
        # Pages left beside every JetStream slot at max_len (the trash page excluded), in prompts of the
        # longest prefill; a waiting prefix holds at most that many.
        spare = cfg.pool_pages - 1 - self.max_concurrent_decodes * cfg.pages_per_slot
        tickets = min(cfg.max_slots, spare // self._state.pool.pages_for(self._max_prefill))
        if tickets < 1:
            raise ValueError(
                f"EngineConfig.num_pages={cfg.pool_pages} leaves no room for a prefill beside "
                f"{self.max_concurrent_decodes} slots at max_len; raise it (0 = the default)"
            )
        self._tickets = threading.BoundedSemaphore(tickets)
        if warmup:
            engine.warmup(None, self._state)

    # ------------------------------------------------------------------------------------- the calls
    def prefill(
        self, *, params: Any, existing_prefix: Prefilled | None = None, padded_tokens: Any, true_length: int
    ) -> Prefilled:
        if existing_prefix is not None:
            raise NotImplementedError("prefill on top of an existing prefix (JetStream session_cache) is not served")
        ids = np.asarray(padded_tokens)[:true_length]
        if len(ids) and ids[0] == NO_ID:
            ids = ids[1:]
        self._tickets.acquire()  # outside the lock: insert (which returns tickets) must keep running
        with self._lock:
            item = AppendItem(self._scratch, ids, reset=True, keep=True)
            self._state, result = self.engine.append(params, self._state, [item])
            self.engine.free_resource(self._state, self._scratch)
        return Prefilled(result.prefixes[0])

    def insert(self, prefix: Prefilled, decode_state: SlotState, slot: int) -> SlotState:
        with self._lock:
            if self._state.active[slot]:
                self.engine.free_resource(self._state, slot)
            seed, self._seed = self._seed, self._seed + 1
            limit = self.engine.config.max_len  # JetStream's max_tokens and the context bound a request
            self.engine.fork(self._state, [prefix.prefix], [slot], [seed], greedy=self.greedy, turn_limit=limit)
            self.engine.drop_prefix(self._state, prefix.prefix)
            self._generated[slot] = 0
        self._tickets.release()
        return self._state

    def free_resource(self, decode_state: SlotState, slot: int) -> SlotState:
        """Frees ``slot`` at once (``insert`` frees a slot it reuses anyway)."""
        with self._lock:
            if self._state.active[slot]:
                self.engine.free_resource(self._state, slot)
        return self._state

    def generate(self, params: Any, decode_state: SlotState) -> tuple[SlotState, engine_api.ResultTokens]:
        with self._lock:
            self._state, out = self.engine.generate(params, self._state)
            self._generated += out.num_tokens
            generated = self._generated.copy()
        k = out.tokens.shape[1]
        valid = np.arange(k)[None, :] < out.num_tokens[:, None]
        data = np.concatenate([out.tokens, valid.astype(np.int32), generated[:, None]], axis=1)
        return self._state, engine_api.ResultTokens(data, (0, k), (k, 2 * k), (2 * k, 2 * k + 1), 1)

    # ---------------------------------------------------------------------------- the rest of the API
    def init_decode_state(self, *args, **kwargs) -> SlotState:
        """The adapter's one slot state (``prefill`` uses its scratch slot, so there is never a second)."""
        return self._state

    def load_params(self, *args, **kwargs) -> Any:
        return self.engine.params

    def get_prefix_destination_sharding(self) -> Any:
        return self.engine.layout.replicated

    def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
        return tokenizer_pb2.TokenizerParameters()

    def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> EngineTokenizer:
        return self.tokenizer

    @property
    def max_concurrent_decodes(self) -> int:
        return self.engine.config.max_slots - 1

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self._max_prefill

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self.engine.layout.mesh

    @property
    def colocated_cpus(self) -> None:
        return None
