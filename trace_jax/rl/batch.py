"""Rollout trees -> ``TrainBatch``: per-token tokens, attention layout, weights and advantages, shapes bucketed.

Layout (``trace_jax.rl.packing``): ``BatchConfig.layout="tree"`` packs each tree's unique tokens (several trees
per row) so every token is processed once; ``"paths"`` gives one row per leaf path (the fallback). Token ids
are exactly as sampled (text is never re-tokenized). Per-token arrays are aligned with the tokens.

Objective. Training every root-to-leaf path separately, aggregated as ``LossConfig.aggregation`` says, is
the reference (``trace_jax.rl.losses``). Each sampled turn token is trained at exactly one place with the
sums over the paths through it of ``c_ℓ``, ``c_ℓ·max(A(ℓ, y), 0)`` and ``c_ℓ·min(A(ℓ, y), 0)`` (``c_ℓ`` the
aggregation's path coefficient), which gives the per-path loss and gradient exactly for ppo / grpo /
gspo_turn. GSPO's sequence-level ratio needs the whole path: ``BatchInfo.path_tokens`` lists every path's
trained tokens (``trace_jax.rl.sequences``). ``check_objective`` refuses the combinations that cannot be
exact. Prompt tokens, observation (tool) tokens, context copies and padding have weight 0. Behaviour
log-probs are the sampler's ``sample_logprobs`` (the distribution actually sampled); the trainer may
recompute them.

Shapes. The length ``T`` is the smallest of ``length_buckets`` that fits the longest row, or with
``fixed_length`` always the row capacity (``pack_length``, default the largest bucket), so every batch of a
run has one ``T`` and the trainer's fixed-shape micro-batch programs (``RLTrainer.update``) compile once.
The row count is padded (with weight-0 rows) to the smallest of ``row_buckets`` that fits (past the largest,
a multiple of it), then to a multiple of ``row_multiple``. ``take_rows`` cuts rows out of a batch and pads
them to a fixed count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from trace_jax.buckets import bucket, round_up
from trace_jax.config_utils import documented
from trace_jax.rl.advantages import ESTIMATORS, NodeAdvantages
from trace_jax.rl.losses import AGGREGATIONS, LossConfig
from trace_jax.rl.packing import LAYOUTS, RowLayout, routing_rows
from trace_jax.rl.sequences import PathTokens
from trace_jax.rollout.tree import RolloutTree


class TrainBatch(NamedTuple):
    """Device-side training rows (a pytree of arrays; ``ref_logprobs`` may be None). Shapes [B, T] unless noted.

    tokens: int32 ids exactly as sampled, ``pad_id`` on padding.
    positions: int32 RoPE positions along each token's path.
    visible_end: int32: key i is visible to query j iff i <= j < visible_end[i] (``Qwen.hidden``).
    predecessor: int32 row index of the token whose hidden state predicts this one (itself: no context).
    weights: float32 Σ over the token's paths of the aggregation coefficient c_ℓ (0 = not trained here).
    adv_pos / adv_neg: float32 Σ over the token's paths of c_ℓ·max(A, 0) / c_ℓ·min(A, 0).
    old_logprobs: float32 behaviour log-probs (0 where weight is 0).
    segment_ids: int32 the token's turn within its row (1, 2, ...) on trained tokens, 0 elsewhere.
    paths: float32 [B] number of leaf paths whose leaf turn trains in the row (seq-mean denominators).
    lengths: int32 [B] filled positions per row.
    ref_logprobs: float32 reference-policy log-probs, or None until filled in by the trainer.
    seq_loss / seq_grad: float32 sequence-level GSPO terms (``trace_jax.rl.sequences.sequence_terms``), filled
      in by the trainer before each optimizer step; None otherwise.
    routing: int32 [B, T, sparse layers, top-k] the sampler's expert selection of each token the rollouts
      recorded (sampled, prompt and observation tokens), -1 on tokens without a record and on padding
      (``trace_jax.rl.packing.routing_rows``), which the trainer's forward replays; None when the rollouts
      recorded none (a dense policy, or ``EngineConfig.routing_replay`` off).
    """

    tokens: np.ndarray
    positions: np.ndarray
    visible_end: np.ndarray
    predecessor: np.ndarray
    weights: np.ndarray
    adv_pos: np.ndarray
    adv_neg: np.ndarray
    old_logprobs: np.ndarray
    segment_ids: np.ndarray
    paths: np.ndarray
    lengths: np.ndarray
    ref_logprobs: np.ndarray | None = None
    seq_loss: np.ndarray | None = None
    seq_grad: np.ndarray | None = None
    routing: np.ndarray | None = None

    @property
    def loss_mask(self) -> np.ndarray:
        """float32 [B, T]: 1 on the tokens this batch trains."""
        return (np.asarray(self.weights) > 0).astype(np.float32)

    @property
    def advantages(self) -> np.ndarray:
        """float32 [B, T]: the weighted mean advantage of each trained token (0 elsewhere)."""
        weights = np.asarray(self.weights)
        total = np.asarray(self.adv_pos) + np.asarray(self.adv_neg)
        return np.where(weights > 0, total / np.where(weights > 0, weights, 1.0), 0.0).astype(np.float32)


@dataclasses.dataclass
class BatchInfo:
    """Host-side bookkeeping of a batch.

    Attributes:
      num_rows: real rows (before padding).
      num_tokens: real tokens over all rows (what the forward pass processes, padding excluded).
      num_padded_tokens: rows × T after padding (what the forward pass computes).
      num_path_tokens: tokens of all leaf paths (what one-row-per-path training would process, unpadded).
      num_trained_tokens: tokens with non-zero weight (each sampled turn token at most once).
      num_trees_skipped: trees left out by ``skip_zero_advantage``.
      skipped_denominator: the share of the loss denominator (``trace_jax.rl.losses.loss_denominator``) that
        the skipped trees hold: their trained tokens' weights, or their trained paths. ``RLTrainer.update``
        adds it to the rows' own, so the batch trains the objective of every tree given (0 when none skipped).
      layout: where every token sits (tree / node / offset per position).
      path_tokens: every leaf path's trained tokens and advantages (sequence-level GSPO's input).
    """

    num_rows: int
    num_tokens: int
    num_padded_tokens: int
    num_path_tokens: int
    num_trained_tokens: int
    num_trees_skipped: int
    skipped_denominator: float
    layout: RowLayout = dataclasses.field(repr=False)
    path_tokens: PathTokens = dataclasses.field(repr=False)


SEGMENT_WEIGHTS = ("leaves", "one")


@dataclasses.dataclass(frozen=True)
class BatchConfig:
    """How trees become rows."""

    layout: str = documented(
        "tree",
        'key of ``trace_jax.rl.packing.LAYOUTS``: "tree" (packed, each unique token once) or "paths" (one row per leaf '
        "path; for models without packed-row support).",
    )
    length_buckets: tuple[int, ...] = documented(
        (64, 128, 256, 512, 1024, 2048, 4096),
        "allowed row lengths T (ascending); a path longer than the largest is an error.",
    )
    row_buckets: tuple[int, ...] | None = documented(
        (8, 16, 32, 64, 128, 256, 512, 1024),
        "allowed row counts before ``row_multiple`` padding; None: no row bucketing.",
    )
    row_multiple: int = documented(
        1,
        "the row count is padded to a multiple of this. ``RLTrainer.update`` runs only the rows that hold tokens "
        "(in micro-batches of ``RLTrainer.micro_rows``, which the main job sets here so the tree packing fills "
        "whole micro-batches) and drops the padding rows.",
    )
    pack_length: int | None = documented(
        None,
        'tokens per packed row ("tree"); None: the largest length bucket with ``fixed_length``, else the length bucket '
        "of the longest path, so a packed row costs what a path row costs. Larger packs more trees per row (attention "
        "cost grows as T²).",
    )
    fixed_length: bool = documented(
        False,
        'every row is the row capacity long (``pack_length`` or the largest length bucket; for "paths" the largest '
        "bucket) whatever the batch holds: one row length T for the whole run. A training loop wants it (its update "
        "compiles once), with length buckets ending at the engine's ``max_len``, as every config sets; the default is "
        "False because a batch built once (tests, benchmarks) is then as long as its longest row needs, not the "
        "default buckets' 4096.",
    )
    segment_weight: str = documented(
        "leaves",
        '"leaves": the per-path objective; "one": each turn weighs 1 whatever its leaf count (a tree-native objective, '
        "token-mean only).",
    )
    skip_zero_advantage: bool = documented(
        False,
        "leave out of the rows the trees whose every advantage is 0, and count them in "
        "``BatchInfo.skipped_denominator``. Their tokens' policy-gradient terms are exactly 0, so with that "
        "denominator the update's objective and gradient are those of the whole batch, at the cost of the trees that "
        "carry signal only. A term outside the advantage (``LossConfig.kl_coef``, ``entropy_coef``, "
        "``router_aux_loss_coef``) trains every token, so with one none is left out; nor when no tree carries signal.",
    )
    pad_id: int = documented(
        0,
        "token id used for padding (never trained, never attended to by real tokens); the main job uses its "
        "tokenizer's.",
    )

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; choose one of {sorted(LAYOUTS)}")
        if self.segment_weight not in SEGMENT_WEIGHTS:
            raise ValueError(f"segment_weight must be one of {SEGMENT_WEIGHTS}, got {self.segment_weight!r}")
        if not self.length_buckets or list(self.length_buckets) != sorted(self.length_buckets):
            raise ValueError(f"length_buckets must be a non-empty ascending tuple, got {self.length_buckets}")
        if self.row_multiple < 1:
            raise ValueError(f"row_multiple must be >= 1, got {self.row_multiple}")
        if self.pack_length is not None and self.pack_length > self.length_buckets[-1]:
            raise ValueError(f"pack_length={self.pack_length} exceeds the largest length bucket")


def check_objective(estimator: str | None, loss: LossConfig, batch: BatchConfig) -> None:
    """Raises ValueError for a combination whose gradient is not the per-path one (call it at config time).

    Every advantage estimator × aggregation is exact with every policy loss (see the module docstring).
    Refused: ``segment_weight="one"`` with a per-path aggregation or with ``gspo`` (whose ratio is a path's).
    """
    if estimator is not None:
        ESTIMATORS[estimator]  # an unknown name raises with the choices
    if batch.segment_weight == "one" and loss.policy_loss == "gspo":
        raise ValueError(
            "policy_loss 'gspo' weighs whole root-to-leaf paths, but segment_weight='one' weighs turns; use "
            "segment_weight='leaves' (or policy_loss='gspo_turn', a ratio per turn)"
        )
    if batch.segment_weight == "one" and AGGREGATIONS[loss.aggregation].per_path:
        raise ValueError(
            f"segment_weight='one' weighs turns, not paths, so aggregation {loss.aggregation!r} (a mean over "
            "paths) has no meaning with it; use aggregation='token-mean' or segment_weight='leaves'"
        )


def _row_count(n: int, config: BatchConfig) -> int:
    """Padded row count: the row bucket (past the largest, a multiple of it), then a multiple of ``row_multiple``."""
    buckets = config.row_buckets
    if buckets:
        n = bucket(n, buckets, "rows") if n <= buckets[-1] else round_up(n, buckets[-1])
    return round_up(n, config.row_multiple)


class _NodeTables(NamedTuple):
    """Per-node training values of all kept trees, flattened (node g of tree t is ``base[t] + node_id``)."""

    weights: np.ndarray  # float64 [G] Σ c_ℓ over the node's paths
    adv_pos: np.ndarray  # float64 [G]
    adv_neg: np.ndarray  # float64 [G]
    base: np.ndarray  # int64 [trees]
    logprobs: list[np.ndarray]  # per node: behaviour log-probs of token_ids + zeros for observations
    path_coefficients: list[np.ndarray]  # per tree: float64 [leaves] c_ℓ
    path_advantages: list[np.ndarray]  # per tree: float64 [nodes, leaves] A(ℓ, y)


def _trained_tokens_per_path(tree: RolloutTree) -> np.ndarray:
    """int64 [num_leaves]: sampled turn tokens on each leaf's path."""
    return np.asarray([sum(tree[y].token_ids.shape[0] for y in tree.path(leaf)[1:]) for leaf in tree.leaves()])


def _node_tables(
    trees: Sequence[RolloutTree], advantages: Sequence[NodeAdvantages], config: BatchConfig, loss: LossConfig
) -> _NodeTables:
    path_tokens = [_trained_tokens_per_path(t) for t in trees]
    aggregation = AGGREGATIONS[loss.aggregation]
    weights, pos, neg, logprobs, base, path_coef, path_adv = [], [], [], [], [], [], []
    for tree, adv, n_tokens in zip(trees, advantages, path_tokens, strict=True):
        num_leaves = n_tokens.shape[0]
        under = tree.subtree_sums(np.eye(num_leaves)) if num_leaves else np.zeros((len(tree), 0))
        under[0] = 0.0  # the root is never trained
        path_coef.append(aggregation.path_coefficients(n_tokens, loss, config.length_buckets[-1]))
        coef = under * path_coef[-1][None, :]
        a = adv.path_advantages(tree)
        path_adv.append(a)
        w, p, m = coef.sum(1), (coef * np.maximum(a, 0)).sum(1), (coef * np.minimum(a, 0)).sum(1)
        if config.segment_weight == "one":
            count = np.maximum(under.sum(1), 1.0)
            w, p, m = (w > 0).astype(np.float64), p / count, m / count
        base.append(sum(len(t) for t in trees[: len(base)]))
        weights.append(w)
        pos.append(p)
        neg.append(m)
        logprobs += [np.r_[node.sample_logprobs, np.zeros(node.observation_ids.shape[0])] for node in tree]
    return _NodeTables(
        np.concatenate(weights),
        np.concatenate(pos),
        np.concatenate(neg),
        np.asarray(base, np.int64),
        logprobs,
        path_coef,
        path_adv,
    )


def _tree_terms(
    trees: Sequence[RolloutTree], advantages: Sequence[NodeAdvantages], config: BatchConfig, loss: LossConfig
) -> tuple[np.ndarray, np.ndarray]:
    """Per tree: whether any of its tokens carries a policy-gradient term (a non-zero ``c_ℓ·A(ℓ, y)`` sum,
    what ``adv_pos`` / ``adv_neg`` hold), and the loss denominator its rows would hold: Σ of its trained tokens'
    weights (each sampled turn token once, as the rows train it), or its paths with a trained token."""
    tables = _node_tables(trees, advantages, config, loss)
    per_path = AGGREGATIONS[loss.aggregation].per_path
    ends = np.r_[tables.base[1:], len(tables.weights)]
    signal, denominators = [], []
    for tree, start, end in zip(trees, tables.base, ends, strict=True):
        nodes = slice(start, end)
        signal.append(bool(np.any(tables.adv_pos[nodes]) or np.any(tables.adv_neg[nodes])))
        if per_path:
            denominators.append(float(np.count_nonzero(_trained_tokens_per_path(tree))))
        else:
            tokens = np.asarray([node.token_ids.shape[0] for node in tree])
            denominators.append(float(np.sum(np.maximum(tables.weights[nodes], 0.0) * tokens)))
    return np.asarray(signal, bool), np.asarray(denominators)


def _path_tokens(trees: Sequence[RolloutTree], tables: _NodeTables, flat: np.ndarray, trains: np.ndarray) -> PathTokens:
    """Every leaf path's trained tokens (``flat``: global node id per position; ``trains``: where it trains)."""
    rows, cols = np.nonzero(trains)
    node_of = flat[rows, cols]
    order = np.argsort(node_of, kind="stable")
    node_of, position = node_of[order], (rows * trains.shape[1] + cols)[order]
    bounds = np.searchsorted(node_of, np.arange(len(tables.weights) + 1))
    path, where, advantage = [], [], []
    for t, tree in enumerate(trees):
        for j, leaf in enumerate(tree.leaves()):
            index = sum(len(c) for c in tables.path_coefficients[:t]) + j
            for y in tree.path(leaf)[1:]:
                g = tables.base[t] + y
                span = position[bounds[g] : bounds[g + 1]]
                path.append(np.full(span.size, index, np.int64))
                where.append(span.astype(np.int64))
                advantage.append(np.full(span.size, tables.path_advantages[t][y, j]))
    cat = lambda parts, dtype: np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)
    return PathTokens(
        cat(path, np.int64), cat(where, np.int64), cat(advantage, np.float64), cat(tables.path_coefficients, np.float64)
    )


def build_batch(
    trees: Sequence[RolloutTree],
    advantages: Sequence[NodeAdvantages],
    config: BatchConfig | None = None,
    loss: LossConfig | None = None,
) -> tuple[TrainBatch, BatchInfo]:
    """Rows for every tree (see the module docstring); ``advantages[i]`` belongs to ``trees[i]``.

    ``loss`` (default ``LossConfig()``) supplies the aggregation, which decides each path's coefficient.
    """
    config = config or BatchConfig()
    loss = loss or LossConfig()
    check_objective(None, loss, config)
    if len(trees) != len(advantages):
        raise ValueError(f"{len(trees)} trees but {len(advantages)} advantage sets")
    with_leaves = [i for i, tree in enumerate(trees) if tree.leaves()]
    if not with_leaves:
        raise ValueError(f"no rows to train: none of the {len(trees)} trees has a leaf")
    kept, skipped_denominator, skipped = with_leaves, 0.0, 0
    if config.skip_zero_advantage and not (loss.kl_coef or loss.entropy_coef or loss.router_aux_loss_coef):
        signal, denominators = _tree_terms(
            [trees[i] for i in with_leaves], [advantages[i] for i in with_leaves], config, loss
        )
        if signal.any():  # with none, every tree stays: the update then runs as without the option
            kept = [i for i, keep in zip(with_leaves, signal, strict=True) if keep]
            skipped, skipped_denominator = int((~signal).sum()), float(denominators[~signal].sum())
    trees = [trees[i] for i in kept]
    advantages = [advantages[i] for i in kept]
    longest_path = max(t.prefix_length(leaf) for t in trees for leaf in t.leaves())
    if longest_path > config.length_buckets[-1]:
        raise ValueError(
            f"a row has {longest_path} tokens, more than the largest length bucket {config.length_buckets[-1]}; "
            "add a larger bucket to length_buckets or lower the rollout token limits"
        )
    capacity = config.length_buckets[-1]
    if config.layout == "tree" and not config.fixed_length:
        capacity = config.pack_length or bucket(longest_path, config.length_buckets, "path length")
    elif config.layout == "tree":
        capacity = config.pack_length or capacity
    if config.fixed_length:
        shape = lambda rows, longest: (_row_count(rows, config), capacity)
    else:
        shape = lambda rows, longest: (_row_count(rows, config), bucket(longest, config.length_buckets, "row length"))
    layout = LAYOUTS[config.layout](trees, capacity, shape, config.pad_id)
    tables = _node_tables(trees, advantages, config, loss)

    filled = layout.tree >= 0
    flat = np.where(filled, tables.base[np.maximum(layout.tree, 0)] + np.maximum(layout.node, 0), 0)
    trains = layout.trains & (tables.weights[flat] > 0)
    pick = lambda table: np.where(trains, table[flat], 0.0).astype(np.float32)
    old = np.zeros(layout.tokens.shape, np.float32)
    rows_t, cols_t = np.nonzero(trains)
    old[rows_t, cols_t] = [tables.logprobs[g][o] for g, o in zip(flat[trains], layout.offset[trains], strict=True)]
    segment_ids = np.zeros(layout.tokens.shape, np.int32)
    for r in range(layout.tokens.shape[0]):
        ids = flat[r][trains[r]]
        if ids.size:
            segment_ids[r][trains[r]] = np.unique(ids, return_inverse=True)[1] + 1
    paths = np.zeros(layout.tokens.shape[0], np.float32)
    for t, tree in enumerate(trees):
        for leaf, n in zip(tree.leaves(), _trained_tokens_per_path(tree), strict=True):
            if n > 0:
                paths[layout.leaf_rows[t][leaf]] += 1.0
    batch = TrainBatch(
        tokens=layout.tokens,
        positions=layout.positions,
        visible_end=layout.visible_end,
        predecessor=layout.predecessor,
        weights=pick(tables.weights),
        adv_pos=pick(tables.adv_pos),
        adv_neg=pick(tables.adv_neg),
        old_logprobs=old,
        segment_ids=segment_ids,
        paths=paths,
        lengths=layout.lengths,
        routing=routing_rows(trees, layout),
    )
    info = BatchInfo(
        layout=layout,
        num_rows=int((layout.lengths > 0).sum()),
        num_tokens=int(layout.lengths.sum()),
        num_padded_tokens=int(layout.tokens.size),
        num_path_tokens=int(sum(t.prefix_length(leaf) for t in trees for leaf in t.leaves())),
        num_trained_tokens=int(trains.sum()),
        num_trees_skipped=skipped,
        skipped_denominator=skipped_denominator,
        path_tokens=_path_tokens(trees, tables, flat, trains),
    )
    return batch, info


def take_rows(batch: TrainBatch, rows: np.ndarray, count: int) -> TrainBatch:
    """Host rows ``rows`` (int indices) of ``batch``, then weight-0 padding rows up to ``count`` rows.

    A padding row trains nothing and each of its positions sees only itself (``visible_end = t + 1``,
    ``predecessor = t``), so it changes no loss, gradient or metric. ``ref_logprobs`` may be None.
    """
    rows = np.asarray(rows, np.int64)
    if rows.size > count:
        raise ValueError(f"{rows.size} rows do not fit in {count}")
    t = np.asarray(batch.tokens).shape[1]
    index = np.broadcast_to(np.arange(t, dtype=np.int32), (count - rows.size, t))
    special = {"visible_end": index + 1, "predecessor": index}
    unrecorded = -1  # a padding row's tokens have no routing record (``routing``)

    def take(name: str, x: np.ndarray | None) -> np.ndarray | None:
        if x is None:
            return None
        x = np.asarray(x)[rows]
        fill = unrecorded if name == "routing" else 0
        pad = special.get(name, np.full((count - rows.size, *x.shape[1:]), fill, x.dtype))
        return np.concatenate([x, pad.astype(x.dtype)])

    return TrainBatch(*(take(name, x) for name, x in zip(TrainBatch._fields, batch, strict=True)))
