"""The two allocation solvers of TRACE (``docs/method.md``), vectorised numpy on the host.

Stage 1 (roots): split ``budget`` rollouts over a batch's prompts to maximise the expected number of mixed
groups, ``sum_i V_root(i, m_i)`` with ``V_root(v, m) = 1 - v^m - (1 - v)^m`` (and ``V_root(v, 0) = 0``).

Stage 2 (prefixes): give ``k_a`` extra continuations to anchors ``a`` to maximise
``sum_a V_pref(a, k_a)``, ``V_pref = 1 - q_a^k`` with ``q_a`` the probability that one continuation repeats the
outcome already seen under the anchor, under a budget of rollouts and of expected generated tokens, each
continuation of ``a`` costing ``cost_a`` tokens.

Both take an optional *dispersion* ``rho`` in [0, 1) per prompt / anchor *(ours)*: the predictor's ``Ṽ`` is the
mean of a Beta over the true success probability p with ``Var(p) = rho Ṽ(1 - Ṽ)``, and the values become
expectations under it (``rho = 0``, the default, is the paper's plug-in formula). A predictor that says 0.5 for a
prompt that is really all-pass or all-fail then no longer promises a mixed group.
"""

from __future__ import annotations

import numpy as np


def root_value(v: np.ndarray | float, m: np.ndarray | int) -> np.ndarray:
    """``V_root(v, m)``: P(a group of m rollouts with success probability v is mixed). Broadcasts; 0 at m = 0."""
    v = np.clip(np.asarray(v, np.float64), 0.0, 1.0)
    m = np.asarray(m)
    safe_m = np.maximum(m, 1)  # the where() below discards m <= 0; avoid 0 ** negative warnings there
    return np.where(m > 0, 1.0 - v**safe_m - (1.0 - v) ** safe_m, 0.0)


def success_moments(mean_n: np.ndarray, dispersion_n: np.ndarray | float, max_power: int) -> np.ndarray:
    """float64 [N, max_power + 1]: ``E[p^j]``, j = 0..max_power, for p ~ Beta with mean ``mean_n`` and dispersion rho.

    ``rho = 1 / (kappa + 1)`` for a Beta of concentration kappa: ``E[p^j] = prod_{i<j} (mu (1 - rho) + i rho) /
    ((1 - rho) + i rho)``; rho = 0 gives ``mu^j`` exactly.
    """
    mu = np.clip(np.asarray(mean_n, np.float64).reshape(-1, 1), 0.0, 1.0)
    rho = np.clip(np.broadcast_to(np.asarray(dispersion_n, np.float64), mu.shape[:1]).reshape(-1, 1), 0.0, 0.999)
    i = np.arange(max_power)[None, :]
    factors = (mu * (1.0 - rho) + i * rho) / ((1.0 - rho) + i * rho)
    return np.concatenate([np.ones_like(mu), np.cumprod(factors, axis=1)], axis=1)


def root_value_table(mean_b: np.ndarray, dispersion_b: np.ndarray | float, max_m: int) -> np.ndarray:
    """float64 [B, max_m + 1]: ``E[V_root(p, m)] = 1 - E[p^m] - E[(1 - p)^m]`` for m = 0..max_m (0 at m = 0)."""
    mean_b = np.asarray(mean_b, np.float64).reshape(-1)
    table = 1.0 - success_moments(mean_b, dispersion_b, max_m) - success_moments(1.0 - mean_b, dispersion_b, max_m)
    table[:, 0] = 0.0
    return np.maximum(table, 0.0)


def expected_root_value(mean_b: np.ndarray, dispersion_b: np.ndarray | float, m: int) -> np.ndarray:
    """float64 [B]: ``E[V_root(p, m)]`` for one group size m; exactly :func:`root_value` when every rho is 0."""
    if not np.any(dispersion_b):
        return root_value(mean_b, m)
    return root_value_table(mean_b, dispersion_b, m)[:, m]


def _root_gains(table_bm: np.ndarray, m_lo: int, width: int) -> np.ndarray:
    """float64 [B, width]: the gain of the (m_lo + j + 1)-th rollout of each prompt, non-increasing in j.

    ``V_root`` is concave from m = 1 on, but the first rollout alone is worth nothing (``V(0) = V(1) = 0``)
    while the second is worth ``2a``, ``a = E[p(1-p)]``. From m_lo = 0 we therefore use the concave envelope,
    which spreads ``V(2)`` over the first two rollouts; with the third rollout's exact gain ``a`` (``V(3) = 3a``
    for every p) the first three gains tie, and :func:`allocate_roots` repairs the one prompt that can end
    with a lone rollout.
    """
    gains = np.diff(table_bm[:, m_lo : m_lo + width + 1], axis=1)
    a = table_bm[:, 2:3] / 2.0 if table_bm.shape[1] > 2 else np.zeros_like(table_bm[:, :1])
    if m_lo == 0 and width >= 2:
        gains[:, : min(width, 3)] = a  # set so ties are exact, keeping each prompt's first steps together
    return np.minimum(gains, 2.0 * a if m_lo >= 1 else a)


def allocate_roots(
    values_b: np.ndarray,
    budget: int,
    min_per_prompt: int = 0,
    max_per_prompt: int | None = None,
    dispersion_b: np.ndarray | float = 0.0,
) -> np.ndarray:
    """Stage 1: rollouts per prompt maximising ``sum_i V_root(v_i, m_i)``, ``sum_i m_i <= budget``.

    Greedy by marginal gain (optimal for a sum of concave terms); prompts may get 0 when ``min_per_prompt`` is
    0 (they are filtered). Never exceeds ``budget``; spends it all unless every remaining gain is zero.

    Args:
      values_b: float [B] predicted success probabilities of the roots.
      budget: total rollouts for the batch.
      min_per_prompt / max_per_prompt: bounds on each prompt's rollouts (max defaults to ``budget``).
      dispersion_b: float [B] (or scalar) predictive dispersion rho of each root (0: plug-in ``V_root``).
    Returns:
      int64 [B] rollouts per prompt.
    """
    v_b = np.clip(np.asarray(values_b, np.float64).reshape(-1), 0.0, 1.0)
    num_prompts = v_b.shape[0]
    m_hi = budget if max_per_prompt is None else int(max_per_prompt)
    if min_per_prompt < 0 or m_hi < min_per_prompt:
        raise ValueError(f"need 0 <= min_per_prompt ({min_per_prompt}) <= max_per_prompt ({m_hi})")
    if num_prompts * min_per_prompt > budget:
        raise ValueError(
            f"budget of {budget} rollouts cannot give {num_prompts} prompts min_per_prompt={min_per_prompt} each;"
            " raise the budget or lower min_per_prompt"
        )
    m_b = np.full(num_prompts, min_per_prompt, np.int64)
    spare = budget - num_prompts * min_per_prompt
    width = min(m_hi - min_per_prompt, spare)
    if num_prompts == 0 or width <= 0:
        return m_b
    table = root_value_table(v_b, dispersion_b, max(min_per_prompt + width, 2))
    gains = _root_gains(table, min_per_prompt, width)
    # Row-major flattening orders items by (prompt, step); a stable sort keeps that order among ties.
    order = np.argsort(-gains.ravel(), kind="stable")
    chosen = order[:spare]
    chosen = chosen[gains.ravel()[chosen] > 0]
    m_b += np.bincount(chosen // width, minlength=num_prompts)
    if min_per_prompt == 0 and m_hi >= 2:
        m_b = _repair_lone_rollout(table, m_b, min(m_hi, table.shape[1] - 1))
    return m_b


def _repair_lone_rollout(table_bm: np.ndarray, m_b: np.ndarray, m_hi: int) -> np.ndarray:
    """Fixes the (at most one) prompt the envelope greedy left with a single, worthless rollout.

    Candidates: move that rollout to the best next step elsewhere; or complete the prompt's pair by taking a
    rollout from the prompt that loses least (a prompt at 2 gives up both and its spare goes to the best step).
    """
    lone = np.flatnonzero(m_b == 1)
    if lone.size == 0:
        return m_b
    p = int(lone[0])
    rows = np.arange(m_b.size)

    def value(m: np.ndarray) -> np.ndarray:
        return table_bm[rows, np.clip(m, 0, table_bm.shape[1] - 1)]

    def add_best(m: np.ndarray, exclude: int) -> np.ndarray:
        gain = np.where((m >= 2) & (m < m_hi), value(m + 1) - value(m), -np.inf)
        gain[exclude] = -np.inf
        if gain.size and np.max(gain) > 0:
            m = m.copy()
            m[int(np.argmax(gain))] += 1
        return m

    candidates = [add_best(np.where(rows == p, 0, m_b), p)]
    completed = m_b.copy()
    completed[p] = 2
    loss = np.where(m_b >= 3, value(m_b) - value(m_b - 1), np.inf)
    loss[p] = np.inf
    if np.isfinite(loss).any():
        take = completed.copy()
        take[int(np.argmin(loss))] -= 1
        candidates.append(take)
    pair_loss = np.where(m_b == 2, table_bm[:, 2], np.inf)
    pair_loss[p] = np.inf
    if np.isfinite(pair_loss).any():
        q = int(np.argmin(pair_loss))
        take = completed.copy()
        take[q] = 0
        candidates.append(add_best(take, q))
    totals = [float(value(m).sum()) for m in candidates]
    best = candidates[int(np.argmax(totals))]
    return best if max(totals) > float(value(m_b).sum()) else m_b


def repeat_probability(success_n: np.ndarray, outcome_n: np.ndarray) -> np.ndarray:
    """``q = r Ṽ + (1 - r)(1 - Ṽ)``: P(a continuation repeats outcome r) given predicted success Ṽ. float64 [N]."""
    v = np.clip(np.asarray(success_n, np.float64), 0.0, 1.0)
    r = np.asarray(outcome_n, np.float64)
    return r * v + (1.0 - r) * (1.0 - v)


def fill_by_priority(
    priority_nk: np.ndarray,
    cost_n: np.ndarray,
    token_budget: float | None,
    rollout_budget: int | None,
    max_passes: int = 4,
) -> np.ndarray:
    """Greedy knapsack fill: takes (anchor, k) items by descending priority while both budgets hold.

    Item ``(a, j)`` is anchor a's (j+1)-th continuation; it costs ``cost_n[a]`` tokens and one rollout. Items
    with priority <= 0 or a non-finite priority are never taken. Priorities must be non-increasing in j
    (ties are taken in j order), so each anchor's chosen items are a prefix and the result is a count. After
    the first item that does not fit, later passes go on with the cheaper items that still fit.

    Args:
      priority_nk: float [N, K] priority of each item.
      cost_n: float [N] expected tokens per continuation of each anchor (> 0).
      token_budget / rollout_budget: limits (None: unlimited; at least one must be given).
    Returns:
      int64 [N] continuations per anchor; ``sum(counts * cost) <= token_budget``, ``sum(counts) <= rollout_budget``.
    """
    if token_budget is None and rollout_budget is None:
        raise ValueError("fill_by_priority needs a token budget or a rollout budget")
    priority_nk = np.asarray(priority_nk, np.float64)
    num_anchors, width = priority_nk.shape
    cost_n = np.asarray(cost_n, np.float64).reshape(-1)
    assert cost_n.shape == (num_anchors,), "cost_n must have one entry per anchor"
    if np.any(cost_n <= 0):
        raise ValueError("every continuation must cost a positive number of tokens")
    tokens_left = np.inf if token_budget is None else float(token_budget)
    rollouts_left = np.inf if rollout_budget is None else float(rollout_budget)
    anchor = np.repeat(np.arange(num_anchors), width)
    flat = priority_nk.ravel()
    live = np.flatnonzero(np.isfinite(flat) & (flat > 0))
    # Row-major flattening orders items by (anchor, step); a stable sort keeps that order among ties.
    candidates = live[np.argsort(-flat[live], kind="stable")]
    counts = np.zeros(num_anchors, np.int64)
    for _ in range(max_passes):
        if candidates.size == 0 or rollouts_left < 1:
            break
        item_cost = cost_n[anchor[candidates]]
        fits = (np.cumsum(item_cost) <= tokens_left) & (np.arange(1, candidates.size + 1) <= rollouts_left)
        taken = candidates[: int(np.argmin(fits)) if not fits.all() else candidates.size]
        counts += np.bincount(anchor[taken], minlength=num_anchors)
        tokens_left -= float(cost_n[anchor[taken]].sum())
        rollouts_left -= taken.size
        rest = candidates[taken.size :]
        # All items of an anchor cost the same, so dropping those that no longer fit keeps each anchor's prefix.
        candidates = rest[cost_n[anchor[rest]] <= tokens_left]
    return counts


def allocate_prefixes(
    repeat_n: np.ndarray,
    cost_n: np.ndarray,
    token_budget: float | None,
    rollout_budget: int | None = None,
    max_per_anchor: int = 4,
    weight_n: np.ndarray | None = None,
    dispersion_n: np.ndarray | float = 0.0,
) -> np.ndarray:
    """Stage 2: continuations per anchor, greedy by marginal gain of ``V_pref`` per expected token.

    The k-th extra continuation of anchor a gains ``E[q_a^(k-1) (1 - q_a)]`` (``q^(k-1)(1-q)`` at dispersion 0;
    non-increasing in k); its priority is that gain over ``cost_n[a]``.

    Args:
      repeat_n: float [N] ``q_a`` from :func:`repeat_probability` (1.0 for anchors already mixed: no gain).
      cost_n: float [N] > 0 expected generated tokens of one continuation from each anchor.
      token_budget / rollout_budget: limits on expected tokens and continuations (None: unlimited).
      max_per_anchor: most continuations one anchor may get in this call.
      weight_n: float [N] >= 0 optional factor on each anchor's value (default 1).
      dispersion_n: float [N] (or scalar) predictive dispersion rho of each anchor's q (0: plug-in).
    Returns:
      int64 [N] continuations per anchor, within both budgets.
    """
    gains = -np.diff(success_moments(repeat_n, dispersion_n, max_per_anchor), axis=1)
    if weight_n is not None:
        gains = gains * np.asarray(weight_n, np.float64).reshape(-1, 1)
    return fill_by_priority(gains / np.asarray(cost_n, np.float64).reshape(-1, 1), cost_n, token_budget, rollout_budget)
