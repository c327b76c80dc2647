"""The kernels: Pallas TPU (Mosaic) calls and thin wrappers around jax's, each stating its block rules (checked
where the program is built, naming the value that breaks one) and its cost (``cost(...) -> pl.CostEstimate``).

* ``tree_attention``: our flash attention under the tree mask of packed training rows (forward, dq, dk / dv);
* ``splash``: jax's splash attention for plain causal training rows;
* ``paged_attention``: jax's paged attention for the engine's single-token decode (head_dim 64:
  ``paged_attention_narrow``, the same kernel body with lane-wide running max / sum outputs);
* ``megablox``: jax's grouped matmul, ``ragged_dot`` with ``tgmm`` for the experts' weight gradient;
* ``sharding.under_mesh``: a kernel on each shard in ``jax.shard_map`` (XLA cannot partition a Mosaic call).

Which program uses which kernel on which platform. The platform is the one the program is compiled for (the
mesh's devices; a TPU program built on a CPU host holds the kernels), never the host's: attention by
``trace_jax.models.attention.target_platform``, the experts by ``lax.platform_dependent``
(``trace_jax.models.moe.grouped_matmul``), decode by the engine mesh's devices
(``trace_jax.rollout.engine.pages.choose_decode_kernel``). Attention whose shapes break a kernel's block rule
takes the reference path (the reason logged); expert operands ``tgmm`` does not read take ``ragged_dot``.

| program                        | part    | TPU                             | GPU         | CPU               |
|--------------------------------|---------|---------------------------------|-------------|-------------------|
| training update                | attn    | splash (causal), tree_attention | cuDNN / XLA | reference         |
| training update                | experts | megablox (ragged_dot + tgmm)    | ragged_dot  | scan over experts |
| engine append / prefill        | attn    | reference over the page table   | cuDNN / XLA | reference         |
| engine decode                  | attn    | paged_attention                 | cuDNN / XLA | reference         |
| engine append, prefill, decode | experts | ragged_dot (megablox forward)   | ragged_dot  | scan over experts |

"splash (causal), tree_attention": splash for plain causal rows, ``tree_attention`` for rows with ``kv_end``
(packed and tree-packed rows). "cuDNN / XLA": ``jax.nn.dot_product_attention``, cuDNN for bf16 / fp16 inputs,
XLA's otherwise (``gpu_auto``). "reference": ``trace_jax.models.attention.reference_attention`` (blockwise XLA;
in the engine over the keys gathered through the page table).
"""

from trace_jax.kernels import megablox, paged_attention, splash, tree_attention
from trace_jax.kernels.sharding import under_mesh
from trace_jax.kernels.splash import fits as splash_fits
from trace_jax.kernels.splash import splash_causal
from trace_jax.kernels.tree_attention import BLOCK, tree_flash_attention
from trace_jax.kernels.tree_attention import fits as tree_fits

__all__ = [
    "BLOCK",
    "megablox",
    "paged_attention",
    "splash",
    "splash_causal",
    "splash_fits",
    "tree_attention",
    "tree_fits",
    "tree_flash_attention",
    "under_mesh",
]
