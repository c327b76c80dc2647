"""One attention function for every caller (training rows, packed trees, cached decoding), fp32 accumulation.

Visibility contract (one form covers all cases): key ``s`` is visible to query ``t`` of row ``b`` iff

    s <= query_index_bt[b, t]   and   query_index_bt[b, t] < kv_end_bs[b, s]   (the second only if given)

* a plain causal forward: ``query_index_bt = 0..T-1`` (keys are the same tokens), no ``kv_end``;
* a packed tree row: the same, with ``kv_end_bs = kv_visible_end_bt`` (a key is seen by the queries of its
  own subtree only; see ``Qwen.hidden``);
* cached decoding: keys are the cache positions, ``query_index_bt`` the position each new token is written
  at (``KVCache.write_layer`` has already stored it), no ``kv_end``.

Implementations (``ATTENTION``, chosen by ``ModelConfig.attention``; "auto" picks per compile target, see below):

* ``reference``: plain XLA, scores ``[B, K, G, Tq, S]`` accumulated in float32 (``preferred_element_type``),
  softmax in float32. Long inputs are split into query blocks of ``REFERENCE_BLOCK`` rows, each rematerialised
  in the backward pass, so at most one block's scores are alive (never a [T, T] mask per head; the boolean
  mask is built per block as [B, Tq, S] and broadcast over heads). Rows in key order (``in_order``: training
  rows, packed or not) up to ``IN_ORDER_MAX_BLOCKS`` blocks skip the key blocks past each query block instead
  of masking them. The default on CPU (and TPU fallback).
* ``xla`` / ``cudnn``: ``jax.nn.dot_product_attention`` (cuDNN flash attention on GPU, fp32 accumulation
  inside the kernel). "auto" on GPU (``gpu_auto``) takes cuDNN for bf16/fp16 inputs, XLA for float32.
* ``splash``: the TPU Pallas kernels for training rows, in ``shard_map`` over every mesh axis when traced
  under a mesh (rows over data/fsdp/expert, heads over tensor when the KV heads split evenly): splash
  attention for plain causal rows, ``trace_jax.kernels.tree_attention`` (a flash kernel that computes the
  tree mask ``s <= t < kv_end[s]`` per tile) for packed and tree-packed rows. Scores stay in VMEM, never
  [T, S] in HBM. Cached decoding and rows that are not whole 128-row tiles go to ``reference``; the engine's
  decode has its own kernel (``trace_jax.rollout.engine.pages.DecodeKernel``).
* ``auto``: the platform of the devices the program is compiled for picks (``target_platform``: the abstract
  mesh's device platform when traced under a mesh, as the trainer, the planner and the engine off CPU are).
  A TPU program compiled from a CPU host holds the kernels; a CPU program holds no Mosaic call and is the
  ``reference`` program. (Choosing by ``jax.default_backend()`` gave a TPU program the CPU path.)
  ``SPLASH_INTERPRET`` runs the TPU kernels in Pallas interpret mode on any backend (tests on CPU).

The KV cache's per-layer read and write live behind ``KVCache.write_layer`` / ``KVCache.read_layer`` (see
``trace_jax.models.qwen``); ``attend_cached`` is the only caller, so a paged cache with the same two methods
plugs in without touching the layer scan.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from trace_jax import kernels
from trace_jax.registry import Registry

# Query rows per block of the reference path; a block's float32 scores are [B, H, REFERENCE_BLOCK, S]. 128, not
# 512: the default RL step's temporaries drop 2.27 -> 0.74 GiB (XLA memory analysis) at the same CPU time per
# step (bench.update's model, 4 x 512 tokens, fwd+bwd side by side in one process: 12.2 vs 12.0 CPU-s).
REFERENCE_BLOCK = 128
# Rows in key order up to this many query blocks are unrolled, each block reading only the keys before its end;
# longer rows (pod-scale 4,096-token rows: 32 blocks) keep the one-block ``lax.map`` (compile time and the
# planner's memory estimates stay those of one block).
IN_ORDER_MAX_BLOCKS = 8
# Run the TPU training kernels (splash, tree flash) in Pallas interpret mode (any backend; for tests on CPU).
SPLASH_INTERPRET = False

log = logging.getLogger(__name__)
_FALLBACKS_LOGGED: set[int] = set()  # row lengths the TPU kernels refused (logged once each)

# fn(q_bthe, k_bske, v_bske, query_index_bt, kv_end_bs | None, in_order) -> out_bthe (q's dtype).
AttentionFn = Callable[..., jax.Array]
ATTENTION: Registry[AttentionFn] = Registry("attention implementation")


# The unsigned integer of each width: a cache pool holds its values' bits (see ``as_bits``).
_BITS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def bits_dtype(dtype: Any) -> jnp.dtype:
    """The unsigned integer dtype of ``dtype``'s width."""
    return jnp.dtype(_BITS[jnp.dtype(dtype).itemsize])


def as_bits(x: jax.Array) -> jax.Array:
    """``x``'s bits as the unsigned integer of its width (the identity on unsigned integers). Scatters into a
    bf16 array run on XLA:CPU through a float32 copy of the whole array (it has no bf16 scatter); on the
    bits they run in place, with the same values landing."""
    return jax.lax.bitcast_convert_type(x, bits_dtype(x.dtype))


@jax.custom_jvp
def take_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """``jnp.take(table, ids, axis=0)`` gathered on the bits (the same values): XLA:CPU gathers from a bf16
    table through a float32 copy of the whole table otherwise. Differentiable as ``jnp.take`` (a bitcast has no
    derivative: without the rule below an embedding table would get no gradient from its lookups)."""
    return jax.lax.bitcast_convert_type(jnp.take(as_bits(table), ids, axis=0), table.dtype)


@take_rows.defjvp
def _take_rows_jvp(primals, tangents):
    table, ids = primals
    return take_rows(table, ids), jnp.take(tangents[0], ids, axis=0)


def visible_mask(query_index_bt: jax.Array, num_keys: int, kv_end_bs: jax.Array | None) -> jax.Array:
    """bool [B, T, S]: the visibility contract of the module docstring."""
    q_bt1 = query_index_bt[:, :, None]
    visible_bts = jnp.arange(num_keys)[None, None, :] <= q_bt1
    if kv_end_bs is not None:
        visible_bts = visible_bts & (q_bt1 < kv_end_bs[:, None, :])
    return visible_bts


def _attend_block(q_bthe, k_bske, v_bske, query_index_bt, kv_end_bs):
    # Head-major layouts ([B, K, G, T, E]) put both einsums in the batched-matmul form XLA's dot emitters take
    # directly; the transposes are of q/k/v and the output only, never of a [.., T, S] score block.
    b, t, h, e = q_bthe.shape
    kv = k_bske.shape[2]
    q_bkgte = q_bthe.reshape(b, t, kv, h // kv, e).transpose(0, 2, 3, 1, 4)
    k_bkse, v_bkse = k_bske.transpose(0, 2, 1, 3), v_bske.transpose(0, 2, 1, 3)
    scores = jnp.einsum("bkgte,bkse->bkgts", q_bkgte, k_bkse, preferred_element_type=jnp.float32)
    visible_bts = visible_mask(query_index_bt, k_bske.shape[1], kv_end_bs)
    # An additive mask: its backward is the identity on the scores (a select would keep the mask per head).
    bias_bts = jnp.where(visible_bts, 0.0, jnp.finfo(jnp.float32).min)
    scores = scores / math.sqrt(e) + bias_bts[:, None, None]
    probs = jax.nn.softmax(scores, axis=-1).astype(v_bske.dtype)
    out_bkgte = jnp.einsum("bkgts,bkse->bkgte", probs, v_bkse, preferred_element_type=jnp.float32)
    return out_bkgte.transpose(0, 3, 1, 2, 4).reshape(b, t, h, e).astype(q_bthe.dtype)


def _blocks_in_order(q_bthe, k_bske, v_bske, query_index_bt, kv_end_bs):
    """Rows in key order: query block i sees keys below the block's end only, so the later key blocks are
    skipped rather than masked (on 512-token rows, 10 of 16 block pairs: ~40% less attention work)."""
    t = q_bthe.shape[1]
    attend = jax.checkpoint(_attend_block, prevent_cse=False)
    outs = []
    for start in range(0, t, REFERENCE_BLOCK):
        stop = min(start + REFERENCE_BLOCK, t)
        ends = None if kv_end_bs is None else kv_end_bs[:, :stop]
        q_block, index_block = q_bthe[:, start:stop], query_index_bt[:, start:stop]
        outs.append(attend(q_block, k_bske[:, :stop], v_bske[:, :stop], index_block, ends))
    return jnp.concatenate(outs, axis=1)


@ATTENTION.register("reference")
def reference_attention(q_bthe, k_bske, v_bske, query_index_bt, kv_end_bs=None, in_order=False):
    """Float32-accumulated XLA attention, blockwise over queries past ``REFERENCE_BLOCK`` rows (rows in key
    order, up to ``IN_ORDER_MAX_BLOCKS`` blocks: each block reads only the keys it can see)."""
    b, t, h, e = q_bthe.shape
    if t <= REFERENCE_BLOCK:
        return _attend_block(q_bthe, k_bske, v_bske, query_index_bt, kv_end_bs)
    if in_order and t <= IN_ORDER_MAX_BLOCKS * REFERENCE_BLOCK:
        return _blocks_in_order(q_bthe, k_bske, v_bske, query_index_bt, kv_end_bs)
    n = -(-t // REFERENCE_BLOCK)
    pad = n * REFERENCE_BLOCK - t
    q_nbche = jnp.pad(q_bthe, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, n, REFERENCE_BLOCK, h, e).swapaxes(0, 1)
    # Padded queries see key 0 only (index 0): finite, and sliced off below.
    index_nbc = jnp.pad(query_index_bt, ((0, 0), (0, pad))).reshape(b, n, REFERENCE_BLOCK).swapaxes(0, 1)

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def one_block(args):
        q_block, index_block = args
        return _attend_block(q_block, k_bske, v_bske, index_block, kv_end_bs)

    out_nbche = jax.lax.map(one_block, (q_nbche, index_nbc))
    return out_nbche.swapaxes(0, 1).reshape(b, n * REFERENCE_BLOCK, h, e)[:, :t]


def _dot_product_attention(implementation: str | None) -> AttentionFn:
    def attend(q_bthe, k_bske, v_bske, query_index_bt, kv_end_bs=None, in_order=False):
        if in_order and kv_end_bs is None:
            return jax.nn.dot_product_attention(q_bthe, k_bske, v_bske, is_causal=True, implementation=implementation)
        mask_b1ts = visible_mask(query_index_bt, k_bske.shape[1], kv_end_bs)[:, None]
        return jax.nn.dot_product_attention(q_bthe, k_bske, v_bske, mask=mask_b1ts, implementation=implementation)

    return attend


ATTENTION.register("xla")(_dot_product_attention("xla"))
ATTENTION.register("cudnn")(_dot_product_attention("cudnn"))


@ATTENTION.register("gpu_auto")
def gpu_attention(q_bthe, k_bske, v_bske, query_index_bt, kv_end_bs=None, in_order=False):
    """cuDNN flash attention for half-precision inputs (its requirement), XLA's fused path otherwise."""
    name = "cudnn" if q_bthe.dtype in (jnp.bfloat16, jnp.float16) else "xla"
    return ATTENTION[name](q_bthe, k_bske, v_bske, query_index_bt, kv_end_bs, in_order)


def _splash_kernel(q_bthe, k_bske, v_bske, kv_end_bs):
    """One shard's training rows through the room's TPU kernels: splash for plain causal rows, the tree flash
    kernel for rows with ``kv_end``."""
    if kv_end_bs is None:
        return kernels.splash_causal(q_bthe, k_bske, v_bske, interpret=SPLASH_INTERPRET)
    return kernels.tree_flash_attention(q_bthe, k_bske, v_bske, kv_end_bs, interpret=SPLASH_INTERPRET)


@ATTENTION.register("splash")
def splash_attention(q_bthe, k_bske, v_bske, query_index_bt, kv_end_bs=None, in_order=False):
    """TPU Pallas kernels for training rows (``in_order``), in ``shard_map`` under a mesh: splash attention for
    plain causal rows, ``trace_jax.kernels.tree_attention`` (a flash kernel computing the tree mask per tile)
    for rows with ``kv_end`` (packed and tree-packed rows). Cached decoding (not in order) and rows that are not
    whole 128-row tiles go to ``reference``. Never writes [T, S] scores to HBM where a kernel runs."""
    t, s = q_bthe.shape[1], k_bske.shape[1]
    fits = kernels.splash_fits(t, s) if kv_end_bs is None else kernels.tree_fits(t, s)
    if not in_order or not fits:
        if in_order and q_bthe.shape[1] not in _FALLBACKS_LOGGED:  # training rows that miss the kernel: say so
            _FALLBACKS_LOGGED.add(q_bthe.shape[1])
            log.warning("TPU attention: rows of %d tokens are not whole %d-row tiles; reference attention (scores "
                        "in HBM) instead of the kernels", q_bthe.shape[1], kernels.BLOCK)  # fmt: skip
        return reference_attention(q_bthe, k_bske, v_bske, query_index_bt, kv_end_bs, in_order)
    return kernels.under_mesh(_splash_kernel, q_bthe, k_bske, v_bske, kv_end_bs)


def target_platform() -> str:
    """The platform of the devices the program being traced is compiled for: the abstract mesh's when traced
    under a mesh (``traced_under``, ``jax.set_mesh``; the trainer, the engine off CPU and the planner all are),
    else jax's default backend, where a jit with no mesh compiles. A TPU mesh on a CPU host says "tpu"."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    return device.platform if device is not None else jax.default_backend()


@ATTENTION.register("auto")
def auto_attention(q_bthe, k_bske, v_bske, query_index_bt, kv_end_bs=None, in_order=False):
    """The implementation of the platform the program is compiled for (``target_platform``): the TPU kernels
    (``splash``) on TPU, ``gpu_auto`` on GPU, ``reference`` on CPU (the CPU program is the reference program,
    bit for bit). Not ``jax.lax.platform_dependent``: its cond changed how XLA:CPU fuses the bf16 backward
    (other gradient bits), while the CPU program must stay what it was."""
    platform = target_platform()
    name = {"tpu": "splash", "gpu": "gpu_auto", "cuda": "gpu_auto", "rocm": "gpu_auto"}.get(platform, "reference")
    return ATTENTION[name](q_bthe, k_bske, v_bske, query_index_bt, kv_end_bs, in_order)


def resolve(implementation: str) -> str:
    """The registered implementation name (an unknown name is a clear error now); "auto" stays "auto": it is
    resolved per compile target by ``auto_attention``."""
    ATTENTION[implementation]
    return implementation


def attention(
    q_bthe: jax.Array,
    k_bske: jax.Array,
    v_bske: jax.Array,
    query_index_bt: jax.Array,
    kv_end_bs: jax.Array | None = None,
    *,
    in_order: bool = False,
    implementation: str = "auto",
) -> jax.Array:
    """Grouped-query attention under the module's visibility contract.

    Args:
      q_bthe: queries [B, T, H, E] (already rotated); k_bske, v_bske: keys / values [B, S, K, E], H % K == 0.
      query_index_bt: int32 [B, T], each query's index in key order.
      kv_end_bs: optional int32 [B, S], exclusive end of the queries that may see each key.
      in_order: the caller guarantees ``query_index = 0..T-1`` and S == T (query row t is key t; ``kv_end``
        may still narrow who sees a key). Without ``kv_end`` fused kernels use their built-in causal mask;
        the reference path skips the key blocks past each query block either way.
      implementation: a key of ``ATTENTION`` or "auto".

    Returns:
      [B, T, H, E] in q's dtype; scores, softmax and the value sum are accumulated in float32.
    """
    return ATTENTION[resolve(implementation)](q_bthe, k_bske, v_bske, query_index_bt, kv_end_bs, in_order)


def attend_cached(
    cache: Any,
    layer: jax.Array,
    q_bthe: jax.Array,
    k_btke: jax.Array,
    v_btke: jax.Array,
    positions_bt: jax.Array,
    implementation: str = "auto",
) -> tuple[jax.Array, Any]:
    """Writes this layer's new keys / values at ``positions_bt`` and attends over the slot's cache.

    ``cache`` is any object with ``write_layer(layer, positions_bt, k_btke, v_btke) -> cache`` and
    ``read_layer(layer) -> (keys_bske, values_bske)`` where key s of slot b sits at position s (a paged cache
    gathers its pages into that view). Returns ``(out_bthe, updated cache)``.
    """
    attend_layer = getattr(cache, "attend_layer", None)
    if attend_layer is not None:  # a cache with its own kernel (paged attention) decides where it applies
        return attend_layer(layer, q_bthe, k_btke, v_btke, positions_bt, implementation)
    cache = cache.write_layer(layer, positions_bt, k_btke, v_btke)
    keys_bske, values_bske = cache.read_layer(layer)
    dtype = q_bthe.dtype
    out = attention(
        q_bthe, keys_bske.astype(dtype), values_bske.astype(dtype), positions_bt, implementation=implementation
    )
    return out, cache
