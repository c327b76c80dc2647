"""``trace_jax.plan.attribution``: a compiled program's FLOPs and bytes by the source line and the pass that
made them, read from the HLO text's stack frames, adding up to ``hlo.summarize``'s totals."""

import inspect

import jax
import jax.numpy as jnp

from trace_jax.plan import attribution, hlo

ROWS, WIDTH = 8, 256


def token_matmul(x, w):  # a helper every projection shares (``attribution.HELPERS``): sources name the caller
    return x @ w


def q_proj(x, w):
    return token_matmul(x, w)


def o_proj(x, w):
    return token_matmul(x, w)


def _layer(w, x):
    return o_proj(jnp.tanh(q_proj(x, w)), w)


def _line(fn, text):
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


def test_flops_are_attributed_to_the_calling_line_and_the_pass_and_add_up_to_the_programs():
    """Two layers under ``jax.checkpoint``, differentiated in both arguments, compiled for this host: each
    projection's matmuls are found at its caller's line (through the shared helper); the backward holds two
    matmuls a layer per projection (2 x 2 layers x one matmul's FLOPs), the rematerialised forward shows as
    ``recompute``; every group adds up to ``hlo.summarize``'s FLOPs and bytes. (How much of the forward XLA
    keeps as forward and how much it merges into the recompute is its choice: not asserted.) Mutants caught: a
    frame's parent read without the HLO's +1 (the caller is another frame), remat found by ``checkpoint`` in
    the op_name (the backward of a checkpointed function counted as recompute)."""

    def loss(w, x):
        step = jax.checkpoint(_layer)
        return step(w, step(w, x)).sum()

    x, w = jnp.ones((ROWS, WIDTH)), jnp.ones((WIDTH, WIDTH)) / WIDTH
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(w, x).compile().as_text()
    result = attribution.attribute(text, project="tests/plan/")
    summary = hlo.summarize(text, devices=1)
    assert result["flops"] == summary.flops and result["bytes"] == summary.bytes_accessed
    one = 2 * ROWS * WIDTH * WIDTH  # one matmul of one layer
    passes = {}
    for caller in (q_proj, o_proj):
        where = f"< {caller.__name__} (test_attribution.py:{_line(caller, 'token_matmul')})"
        flops = {g["pass"]: g["flops"] for g in result["by_source"] if g["source"].endswith(where)}
        assert flops.get("backward") == 2 * 2 * one, (caller.__name__, flops)
        passes.update({k: passes.get(k, 0) + v for k, v in flops.items()})
    assert passes.get("recompute", 0) > 0
