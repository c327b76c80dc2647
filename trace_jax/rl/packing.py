"""Rollout trees -> rows of tokens for the trainer: where every token sits, what it sees, who predicts it.

Two layouts, by name (``LAYOUTS``):

* ``tree`` (default): each tree's unique tokens once, nodes in depth-first pre-order, several trees per row
  (first-fit decreasing). A token sees exactly its ancestors on its own root-to-leaf path: with pre-order,
  the keys a token may see end where its node's subtree ends (``visible_end``), which is the form
  ``Qwen.hidden(..., kv_visible_end_bt=...)`` takes, so no [T, T] mask is built on the host. Positions
  continue along the path (RoPE). A tree larger than a row is split into pieces: a piece repeats the path
  from the root to its first node as untrained context, so every token is trained exactly once. Pieces of
  one tree that land in the same row share that context: a row holds each node of a tree at most once
  (``pack_pieces`` counts only the nodes a row does not hold yet).
* ``paths`` (the fallback for models without packed rows): one row per leaf path, in leaf order; a turn
  shared by several leaves trains in the first row that holds it and is context in the others.

The log-prob of a token comes from the hidden state of its *predecessor on its path* (the parent node's
last token for a node's first token), not from row position t - 1: ``predecessor`` carries that index.
Nodes with no finished leaf under them are left out (nothing trains them and nothing they precede trains).
Everything here is host-side numpy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from trace_jax.registry import Registry
from trace_jax.rollout.tree import ROOT, RolloutTree

Piece = list[tuple[int, bool]]  # (node id, trains here) in pre-order; a piece starts with its root's node
# How ``tree_pieces`` cuts a tree that does not fit a row: the children of a split node in as few pieces as fit,
# or one piece each.
PIECE_SPLITS = ("fewest", "each")


@dataclasses.dataclass
class RowLayout:
    """Where every token of a batch sits (host numpy; all per-token arrays int32 [R, T] unless noted).

    tokens: ids exactly as sampled (``pad_id`` on padding).
    positions: RoPE position = the token's index along its root-to-leaf path (0 on padding).
    visible_end: key ``i`` is visible to query ``j`` iff ``i <= j < visible_end[i]`` (padding: ``i + 1``).
    predecessor: row index of the token whose hidden state predicts this one (itself when there is none:
      the first prompt token, and padding).
    tree / node: input tree index and node id of the token (-1 on padding).
    offset: the token's index within its node's ``token_ids + observation_ids``.
    trains: bool [R, T]: this occurrence trains the token (a sampled turn token, first occurrence only).
    lengths: int32 [R] filled positions per row.
    leaf_rows: per tree, {leaf node id: row} of the row whose occurrence of the leaf node trains it.
    """

    tokens: np.ndarray
    positions: np.ndarray
    visible_end: np.ndarray
    predecessor: np.ndarray
    tree: np.ndarray
    node: np.ndarray
    offset: np.ndarray
    trains: np.ndarray
    lengths: np.ndarray
    leaf_rows: list[dict[int, int]]


def routing_rows(trees: Sequence[RolloutTree], layout: RowLayout) -> np.ndarray | None:
    """int32 [R, T, sparse layers, top-k]: the recorded experts (``Node.routed_experts``) of every token at each
    of its places in the rows, context copies included (each is a forward input): sampled tokens, and the
    prompt and observation tokens the engine appended; -1 on padding and on tokens without a record (a node
    without one, a record of the sampled tokens only, rows the engine never filled). None when no node holds
    a record."""
    records = [node.routed_experts for tree in trees for node in tree if node.routed_experts is not None]
    if not records:
        return None
    out = np.full((*layout.tokens.shape, *records[0].shape[1:]), -1, np.int32)
    for r, c in zip(*np.nonzero(layout.tree >= 0), strict=True):
        record = trees[layout.tree[r, c]][layout.node[r, c]].routed_experts
        if record is not None and layout.offset[r, c] < record.shape[0]:
            out[r, c] = record[layout.offset[r, c]]
    return out


ShapeFn = Callable[[int, int], tuple[int, int]]  # (rows, longest row) -> padded (R, T), R >= rows, T >= longest
Layout = Callable[[Sequence[RolloutTree], int, ShapeFn, int], RowLayout]
# ``fn(trees, capacity, shape, pad_id) -> RowLayout`` by name; rows hold at most ``capacity`` tokens.
LAYOUTS: Registry[Layout] = Registry("row layout")


def kept_children(tree: RolloutTree) -> list[list[int]]:
    """Per node, its children that have a finished leaf under them (creation order)."""
    counts = tree.subtree_sums()
    return [[c for c in node.children if counts[c] > 0] for node in tree.nodes]


def _preorder(children: list[list[int]], start: int) -> list[int]:
    out, stack = [], [start]
    while stack:
        y = stack.pop()
        out.append(y)
        stack.extend(reversed(children[y]))
    return out


def tree_pieces(tree: RolloutTree, capacity: int, split: str = "fewest") -> list[Piece]:
    """The tree's kept nodes cut into pieces of at most ``capacity`` tokens, each node trained in one piece.

    A subtree that fits (with the path above it as context) is one piece. Otherwise its top node ``y`` is
    split off: the child subtrees that fit beside the path down to ``y`` become pieces that repeat that path
    as context (``y`` trains in the first), by ``split``, and each child that does not fit is placed the same
    way one level down:

    * ``"fewest"``: the children grouped first-fit decreasing into as few pieces as fit, so the fewest context
      repeats, but pieces of half a row or more, which rarely share a row;
    * ``"each"``: a piece per child. ``pack_pieces`` puts pieces of one tree side by side in a row at the cost
      of their own nodes only, so it regroups them where they fit together, and the small pieces fill the room
      other trees leave.

    ``tree_layout`` packs both and keeps the one the trainer runs fewer rows of.
    """
    if split not in PIECE_SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {PIECE_SPLITS}")
    if not tree.leaves():
        return []
    children = kept_children(tree)
    size = [n.num_tokens for n in tree.nodes]
    subtree = list(size)
    for node in reversed(tree.nodes[1:]):
        if node.node_id in children[node.parent]:
            subtree[node.parent] += subtree[node.node_id]
    pieces: list[Piece] = []

    def place(y: int, context: list[int], context_len: int) -> None:
        if context_len + subtree[y] <= capacity:
            pieces.append([(c, False) for c in context] + [(n, True) for n in _preorder(children, y)])
            return
        base = context_len + size[y]
        if base > capacity:
            raise ValueError(
                f"a root-to-leaf path has more than {capacity} tokens, the row capacity; add a larger length "
                "bucket to BatchConfig.length_buckets or lower the rollout token limits"
            )
        fitting = [c for c in children[y] if base + subtree[c] <= capacity]
        if split == "fewest":
            groups = pack_rows([subtree[c] for c in fitting], capacity - base)
        else:
            groups = [[g] for g in range(len(fitting))]
        for i, group in enumerate(groups or [[]]):
            piece = [(c, False) for c in context] + [(y, i == 0)]
            pieces.append(piece + [(n, True) for g in group for n in _preorder(children, fitting[g])])
        for c in children[y]:
            if base + subtree[c] > capacity:
                place(c, [*context, y], base)

    place(ROOT, [], 0)
    return pieces


def path_pieces(tree: RolloutTree) -> list[Piece]:
    """One chain per leaf (leaf order); a node trains in the first chain that holds it."""
    trained: set[int] = set()
    pieces = []
    for leaf in tree.leaves():
        piece = []
        for y in tree.path(leaf):
            piece.append((y, y not in trained))
            trained.add(y)
        pieces.append(piece)
    return pieces


def _piece_length(tree: RolloutTree, piece: Piece) -> int:
    return sum(tree[y].num_tokens for y, _ in piece)


def pack_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: indices of ``lengths`` grouped into rows of at most ``capacity`` tokens."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, room in enumerate(free):
            if lengths[i] <= room:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(capacity - lengths[i])
    return rows


def _fill(layout: RowLayout, r: int, start: int, tree_index: int, tree: RolloutTree, piece: Piece) -> int:
    """Writes ``piece`` into row ``r`` from ``start``; returns the next free index."""
    last: dict[int, int] = {}  # node -> row index of the last token on its path so far
    path_end: dict[int, int] = {}  # node -> path position after its tokens
    span: dict[int, tuple[int, int]] = {}
    i = start
    for y, trains in piece:
        node = tree[y]
        parent = node.parent
        n = node.num_tokens
        base = 0 if parent is None else path_end[parent]
        before = i if parent is None else last[parent]  # the root's first token has no predecessor
        sl = slice(i, i + n)
        layout.tokens[r, sl] = np.concatenate([node.token_ids, node.observation_ids])
        layout.positions[r, sl] = base + np.arange(n)
        layout.predecessor[r, sl] = np.r_[before, np.arange(i, i + n - 1)][:n]
        layout.tree[r, sl] = tree_index
        layout.node[r, sl] = y
        layout.offset[r, sl] = np.arange(n)
        layout.trains[r, sl] = trains and parent is not None and np.arange(n) < node.token_ids.shape[0]
        if trains and node.is_leaf:
            layout.leaf_rows[tree_index][y] = r
        last[y] = i + n - 1 if n else before
        path_end[y] = base + n
        span[y] = (i, i + n)
        i += n
    end = {y: stop for y, (_, stop) in span.items()}
    for y, _ in reversed(piece):  # a node's keys stay visible to the end of its subtree in this piece
        parent = tree[y].parent
        if parent in end:
            end[parent] = max(end[parent], end[y])
    for y, (first, stop) in span.items():
        layout.visible_end[r, first:stop] = end[y]
    return i


def pack_pieces(
    trees: Sequence[RolloutTree], pieces: list[tuple[int, Piece]], capacity: int
) -> tuple[list[list[int]], list[int]]:
    """First-fit decreasing of ``(tree index, piece)`` into rows of at most ``capacity`` tokens, where a piece
    costs only the tokens of the nodes its row does not hold yet (pieces of one tree share their context).
    Returns the rows (piece indices) and their tokens, every node of a tree once however many of its pieces the
    row holds."""
    rows: list[list[int]] = []
    held: list[dict[int, set[int]]] = []  # per row: tree index -> node ids already in the row
    used: list[int] = []

    def cost(r: int, p: int) -> int:
        t, piece = pieces[p]
        have = held[r].get(t, set())
        return sum(trees[t][y].num_tokens for y, _ in piece if y not in have)

    lengths = [_piece_length(trees[t], piece) for t, piece in pieces]
    for p in sorted(range(len(pieces)), key=lambda p: -lengths[p]):
        r = next((r for r in range(len(rows)) if used[r] + cost(r, p) <= capacity), None)
        if r is None:
            rows.append([])
            held.append({})
            used.append(0)
            r = len(rows) - 1
        used[r] += cost(r, p)
        rows[r].append(p)
        held[r].setdefault(pieces[p][0], set()).update(y for y, _ in pieces[p][1])
    return rows, used


def _merge(tree: RolloutTree, parts: list[Piece]) -> Piece:
    """One piece holding every node of ``parts`` once, in the tree's pre-order (a node trains if it trains in
    any part; parts are ancestor-closed, so the union is too)."""
    trains: dict[int, bool] = {}
    for part in parts:
        for y, t in part:
            trains[y] = trains.get(y, False) or t
    order = {y: i for i, y in enumerate(_preorder(kept_children(tree), ROOT))}
    return [(y, trains[y]) for y in sorted(trains, key=order.__getitem__)]


def _layout(
    trees: Sequence[RolloutTree], pieces: list[tuple[int, Piece]], rows: list[list[int]], shape_fn: ShapeFn, pad_id: int
) -> RowLayout:
    merged_rows = []
    for row in rows:  # pieces of one tree in one row become one piece (their shared context once)
        by_tree: dict[int, list[Piece]] = {}
        for p in row:
            by_tree.setdefault(pieces[p][0], []).append(pieces[p][1])
        merged_rows.append(
            [(t, parts[0] if len(parts) == 1 else _merge(trees[t], parts)) for t, parts in by_tree.items()]
        )
    pieces = [item for row in merged_rows for item in row]
    starts = np.cumsum([0] + [len(row) for row in merged_rows])
    rows = [list(range(starts[r], starts[r + 1])) for r in range(len(merged_rows))]
    lengths = [_piece_length(trees[t], p) for t, p in pieces]
    shape = shape_fn(len(rows), max((sum(lengths[i] for i in row) for row in rows), default=0))
    index = np.broadcast_to(np.arange(shape[1], dtype=np.int32), shape)
    layout = RowLayout(
        tokens=np.full(shape, pad_id, np.int32),
        positions=np.zeros(shape, np.int32),
        visible_end=(index + 1).astype(np.int32),
        predecessor=index.astype(np.int32).copy(),
        tree=np.full(shape, -1, np.int32),
        node=np.full(shape, -1, np.int32),
        offset=np.zeros(shape, np.int32),
        trains=np.zeros(shape, bool),
        lengths=np.zeros(shape[0], np.int32),
        leaf_rows=[{} for _ in trees],
    )
    for r, members in enumerate(rows):
        i = 0
        for p in members:
            tree_index, piece = pieces[p]
            i = _fill(layout, r, i, tree_index, trees[tree_index], piece)
        layout.lengths[r] = i
    return layout


@LAYOUTS.register("tree")
def tree_layout(trees: Sequence[RolloutTree], capacity: int, shape: ShapeFn, pad_id: int = 0) -> RowLayout:
    """Tree-packed rows of at most ``capacity`` tokens, padded to ``shape(rows, longest row)``. The trees are cut
    both ways of ``PIECE_SPLITS`` and packed; the layout keeps the one with fewer padded rows (what the trainer
    runs), then fewer tokens (on a tie, the first: the fewest context repeats)."""
    best = None
    for split in PIECE_SPLITS:
        pieces = [(t, p) for t, tree in enumerate(trees) for p in tree_pieces(tree, capacity, split)]
        rows, tokens = pack_pieces(trees, pieces, capacity)
        cost = (shape(len(rows), max(tokens, default=0))[0], sum(tokens))
        if best is None or cost < best[0]:
            best = (cost, pieces, rows)
    _, pieces, rows = best
    return _layout(trees, pieces, rows, shape, pad_id)


@LAYOUTS.register("paths")
def paths_layout(trees: Sequence[RolloutTree], capacity: int, shape: ShapeFn, pad_id: int = 0) -> RowLayout:
    """One row per leaf path (leaf order within a tree, trees in order); refuses paths over ``capacity``."""
    pieces = [(t, p) for t, tree in enumerate(trees) for p in path_pieces(tree)]
    longest = max((_piece_length(trees[t], p) for t, p in pieces), default=0)
    if longest > capacity:
        raise ValueError(
            f"a row has {longest} tokens, more than the row capacity {capacity}; add a larger length bucket "
            "to BatchConfig.length_buckets or lower the rollout token limits"
        )
    return _layout(trees, pieces, [[i] for i in range(len(pieces))], shape, pad_id)
