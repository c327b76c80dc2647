"""Each kernel wrapper checks its block rules where the program is built and names the value that breaks one."""

import jax.numpy as jnp
import pytest

from trace_jax import kernels
from trace_jax.kernels import megablox, paged_attention


def test_attention_kernels_refuse_rows_that_are_not_whole_tiles_naming_the_length():
    """T = 96 is not a whole 128-row tile: both training kernels raise naming it (before any kernel is traced).
    Mutant caught: ``splash_causal``'s check removed (the kernel would be built on a partial tile)."""
    q = jnp.zeros((1, 96, 2, 128), jnp.float32)
    kv = jnp.zeros((1, 96, 1, 128), jnp.float32)
    assert not kernels.splash_fits(96, 96) and kernels.splash_fits(128, 256)
    with pytest.raises(ValueError, match="splash attention needs rows in whole tiles of 128, got T=96, S=96"):
        kernels.splash_causal(q, kv, kv, interpret=True)
    with pytest.raises(ValueError, match="tree_flash_attention needs rows in whole tiles of 128, got T=96"):
        kernels.tree_flash_attention(q, kv, kv, jnp.full((1, 96), 96, jnp.int32), interpret=True)


def test_the_paged_kernel_names_each_broken_rule_and_its_value():
    """head_dim 32, an int8 cache and 12-position pages break three rules, each named with its value; a legal
    engine breaks none. Mutant caught: a rule dropped from ``problems`` (that value would pass silently)."""
    assert paged_attention.problems(128, "bfloat16", 16) == []
    found = paged_attention.problems(32, "int8", 12)
    assert len(found) == 3
    for value in ("head_dim=32", "int8", "page_size=12"):
        assert any(value in problem for problem in found), value
    assert paged_attention.pages_per_compute_block(12) == 4 and paged_attention.pages_per_compute_block(7) == 1


def test_tgmm_refuses_operands_it_cannot_read_naming_the_dtype():
    """float16 operands are not ``tgmm``'s: ``takes`` says so (the model then uses ``ragged_dot``) and the weight
    gradient raises naming the kernel and the dtype before jax's kernel is called. Mutant caught:
    ``check_dtypes`` removed from ``grouped_weight_grad`` (jax's own message names neither the kernel nor the
    dtypes it reads)."""
    x = jnp.zeros((128, 128), jnp.float16)
    assert not megablox.takes(x) and megablox.takes(x.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match=r"megablox tgmm reads .*bfloat16.*float32.* operands, got float16"):
        megablox.grouped_weight_grad(x, x, jnp.asarray([128], jnp.int32), jnp.float32, interpret=True)
