"""Qwen3-MoE: the Qwen3 decoder whose feed-forward blocks are (in some or all layers) a mixture of experts.

Everything but the feed-forward block is the dense decoder's (``trace_jax.models.qwen``: attention, RMSNorm,
RoPE, embeddings, LM head, KV cache); a sparse layer is a ``DecoderLayer`` built with ``MoeBlock`` as its MLP.

Routing (as transformers' ``Qwen3MoeSparseMoeBlock``): router logits ``x @ router`` in float32, a softmax
over all ``num_experts``, the ``num_experts_per_tok`` largest probabilities pick the experts, renormalised to
sum to one when ``norm_topk_prob``; the block's output is the gate-weighted sum of the chosen experts' SwiGLU
outputs. Dropless: every chosen (token, expert) pair is computed, no capacity factor.

Expert compute (``MoeConfig.expert_compute``):

* ``grouped``: the (token, expert) pairs sorted by expert, then one grouped matmul per projection over the
  contiguous groups (``grouped_matmul``: ``jax.lax.ragged_dot`` on GPU, work proportional to tokens x top-k,
  not x experts; on TPU ``ragged_dot`` with its weight gradient from megablox's ``tgmm`` kernel; on CPU a
  scan over the experts with the same values and [m, f] live buffers);
* ``dense``: every expert on every token, weighted by the gates (zero for unchosen experts). The reference
  the grouped path is tested against (values and gradients); costs ``num_experts / top-k`` times the FLOPs.

Under a mesh the dispatch runs per batch shard (``MoeConfig.expert_dispatch``, ``models.expert_dispatch``):
``gather`` (the default) computes each device's own tokens against one layer's experts gathered over
``expert`` and ``embed``; ``all_to_all`` keeps the experts split over ``expert`` and sends each (token,
expert) row to the shard holding its expert and back. Either way the experts' weights, gradients and
optimizer state stay split over ``expert`` between layers.

Mixed dense and sparse layers (``decoder_sparse_step``, ``mlp_only_layers``): layers of one kind cannot
share a scan body, so the parameters are two stacks, ``dense_layers`` (dense ``DecoderLayer``s, exactly the
dense decoder's layer) and ``moe_layers``, each with a leading ``layers`` axis in depth order within its
kind. ``run_layers`` walks the decoder in maximal runs of consecutive same-kind layers and scans each run over
its rows of its stack, passing each layer its global index (its KV-cache row). The published Qwen3-MoE
models are all sparse (one run: one scan, as in the dense model); "first k dense" is two runs; an
alternating pattern (``decoder_sparse_step=2``) compiles one body per run, so its compile time grows with
depth (fine for the small checkpoints that use it).

The load-balancing loss (``router_aux_loss``; Switch Transformer eq. 4-6, as transformers'
``load_balancing_loss_func`` computes it over all sparse layers' tokens): ``E * sum_e f_e * P_e`` with
``f_e`` the share of top-k choices that went to expert e and ``P_e`` its mean router probability. The model
returns the statistics from ``forward_hidden``; the RL loss adds ``LossConfig.router_aux_loss_coef`` times the
loss pooled over an optimizer step (``trace_jax.rl.trainer``); ``MoeConfig.hf_router_aux_loss_coef`` is only
the checkpoint's config.json value, carried for export.

Letters: n tokens (flattened batch x time), m (token, expert) assignments (n x top-k), k top-k, e experts,
d hidden, f expert mlp width (``e`` is the expert here; head dims never appear in this module).
Parameters: ``router`` [d, e] (logical ("embed", None)), ``gate_proj`` / ``up_proj`` [e, d, f] and
``down_proj`` [e, f, d], with an ``expert`` logical axis that ``trace_jax.parallel.mesh`` maps to the
``expert`` mesh axis (expert parallelism); ``embed`` and ``mlp`` inside an expert shard as in the dense MLP.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax.kernels import megablox
from trace_jax.models.expert_dispatch import EXPERT_DISPATCH
from trace_jax.models.qwen import (
    HF_MODEL_TYPES,
    PRESETS,
    DecoderLayer,
    ModelConfig,
    Qwen,
    _param,
    num_params,
    scan_layers,
    stacked_layers,
)
from trace_jax.parallel.mesh import constrain

EXPERT_COMPUTE = ("grouped", "dense")


@dataclasses.dataclass(frozen=True)
class MoeConfig(ModelConfig):
    """A Qwen3-MoE architecture: the dense Qwen3 fields plus the experts' (HF ``Qwen3MoeConfig`` names).

    ``intermediate_size`` is the width of the dense layers' MLP (those in ``mlp_only_layers`` or off the
    ``decoder_sparse_step`` grid); layer i is sparse iff ``i not in mlp_only_layers and (i + 1) %
    decoder_sparse_step == 0``.
    """

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # The checkpoint's config.json ``router_aux_loss_coef``, kept for export; RL training does not read it (its
    # load-balancing weight is ``LossConfig.router_aux_loss_coef``, the main job's ``loss.router_aux_loss_coef``).
    hf_router_aux_loss_coef: float = 0.001
    expert_compute: str = "grouped"  # one of EXPERT_COMPUTE
    expert_dispatch: str = "gather"  # a key of EXPERT_DISPATCH (models.expert_dispatch); not an HF field

    def __post_init__(self):
        super().__post_init__()
        # model_config.json stores the tuple as a list; keep the config hashable and comparable.
        object.__setattr__(self, "mlp_only_layers", tuple(sorted(int(i) for i in self.mlp_only_layers)))
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts={self.num_experts}]"
            )
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step={self.decoder_sparse_step} must be >= 1")
        if any(not 0 <= i < self.num_layers for i in self.mlp_only_layers):
            raise ValueError(f"mlp_only_layers={self.mlp_only_layers} name layers outside 0..{self.num_layers - 1}")
        if self.expert_compute not in EXPERT_COMPUTE:
            raise ValueError(f"expert_compute={self.expert_compute!r}; choose one of {EXPERT_COMPUTE}")
        if self.expert_dispatch not in EXPERT_DISPATCH:
            raise ValueError(f"expert_dispatch={self.expert_dispatch!r}; choose one of {tuple(EXPERT_DISPATCH)}")

    @property
    def family(self) -> str:
        return "qwen3_moe"

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has a mixture of experts (else the dense MLP), as transformers decides."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_sparse(i))

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if not self.is_sparse(i))

    @property
    def routing_shape(self) -> tuple[int, int]:
        return len(self.sparse_layers), self.num_experts_per_tok

    def layer_stacks(self) -> dict[str, tuple[int, ...]]:
        stacks = {"dense_layers": self.dense_layers, "moe_layers": self.sparse_layers}
        return {name: layers for name, layers in stacks.items() if layers}

    def mlp_params(self) -> int:
        d = self.hidden_size
        expert = 3 * d * self.moe_intermediate_size
        sparse = len(self.sparse_layers) * (self.num_experts * expert + d * self.num_experts)
        return sparse + len(self.dense_layers) * 3 * d * self.intermediate_size

    @property
    def active_mlp_width(self) -> float:
        sparse = len(self.sparse_layers) * self.num_experts_per_tok * self.moe_intermediate_size
        return (sparse + len(self.dense_layers) * self.intermediate_size) / self.num_layers

    def active_params(self) -> int:
        """Parameters one token uses (only its top-k experts count): the "A3B" of Qwen3-30B-A3B."""
        unused = len(self.sparse_layers) * (self.num_experts - self.num_experts_per_tok)
        return num_params(self) - unused * 3 * self.hidden_size * self.moe_intermediate_size

    @classmethod
    def hf_fields(cls, config: dict[str, Any]) -> dict[str, Any]:
        # transformers writes ``num_experts`` as ``num_local_experts`` (its attribute map) in config.json.
        experts = config.get("num_experts", config.get("num_local_experts"))
        if experts is None:
            raise ValueError("a qwen3_moe config.json needs num_experts (or num_local_experts)")
        return dict(
            num_experts=experts,
            num_experts_per_tok=config["num_experts_per_tok"],
            moe_intermediate_size=config["moe_intermediate_size"],
            norm_topk_prob=config.get("norm_topk_prob", False),
            decoder_sparse_step=config.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(config.get("mlp_only_layers") or ()),
            hf_router_aux_loss_coef=config.get("router_aux_loss_coef", 0.001),
        )

    def to_hf(self) -> dict[str, Any]:
        return {
            **super().to_hf(),
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": self.decoder_sparse_step,
            "mlp_only_layers": list(self.mlp_only_layers),
            "router_aux_loss_coef": self.hf_router_aux_loss_coef,
        }


HF_MODEL_TYPES["qwen3_moe"] = (MoeConfig, {"qkv_bias": False, "qk_norm": True})


def _qwen3_moe(hidden, inter, moe_inter, layers, heads, kv, experts, top_k) -> MoeConfig:
    dense = ModelConfig(151936, hidden, inter, layers, heads, kv, 128, 1e6, 1e-6, False, False, True, 40960)
    return MoeConfig(
        **dataclasses.asdict(dense),
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=moe_inter,
        norm_topk_prob=True,
    )


# Published architectures (the models' config.json) and a tiny one for tests and CPU runs.
MOE_PRESETS: dict[str, MoeConfig] = {
    "qwen3-30b-a3b": _qwen3_moe(2048, 6144, 768, 48, 32, 4, 128, 8),
    "qwen3-235b-a22b": _qwen3_moe(4096, 12288, 1536, 94, 64, 4, 128, 8),
    "qwen3-moe-tiny": MoeConfig(
        **dataclasses.asdict(PRESETS["qwen3-tiny"]), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
    ),
}
PRESETS.update(MOE_PRESETS)


# ------------------------------------------------------------------------------------------- routing
class RouterStats(NamedTuple):
    """Sums over sparse layers and (masked) tokens, enough for the load-balancing loss.

    chosen_e: float32 [E], how many top-k choices picked expert e; prob_e: float32 [E], the sum of its router
    probabilities; tokens: float32 [], the number of (token, layer) rows summed.
    """

    chosen_e: jax.Array
    prob_e: jax.Array
    tokens: jax.Array

    @classmethod
    def zeros(cls, num_experts: int) -> RouterStats:
        return cls(jnp.zeros((num_experts,), jnp.float32), jnp.zeros((num_experts,), jnp.float32), jnp.zeros(()))


def router_aux_loss(stats: RouterStats) -> jax.Array:
    """The load-balancing loss ``E * sum_e (chosen_e / rows) * (prob_e / rows)`` (transformers' value)."""
    rows = jnp.maximum(stats.tokens, 1.0)
    return stats.chosen_e.shape[0] * jnp.sum((stats.chosen_e / rows) * (stats.prob_e / rows))


def _rows_by_expert(sizes_e: jax.Array, rows: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(first row of each expert's group, one past its last row, the row indices 0..rows-1)."""
    ends_e = jnp.cumsum(sizes_e)
    return ends_e - sizes_e, ends_e, jnp.arange(rows, dtype=sizes_e.dtype)


def _scan_experts(x_md: jax.Array, w_edf: jax.Array, sizes_e: jax.Array) -> jax.Array:
    """Step e of a scan over the experts sets the rows of group e to ``x @ w[e]`` (a select, so each row is
    exactly its own expert's product); the live buffers are [m, f]."""
    starts_e, ends_e, row_m = _rows_by_expert(sizes_e, x_md.shape[0])

    def one_expert(out_mf, expert):
        w_df, start, end = expert
        # A unit batch axis: remat's save_dots (weight matmuls without batch axes) leaves these products
        # unsaved, as it leaves ragged_dot's; saved, they would stack to [e, m, f] a layer.
        out_1mf = jnp.einsum("gmd,gdf->gmf", x_md[None], w_df[None])
        return jnp.where(((row_m >= start) & (row_m < end))[:, None], out_1mf[0], out_mf), None

    out_mf = jnp.zeros((x_md.shape[0], w_edf.shape[2]), jnp.result_type(x_md, w_edf))
    return jax.lax.scan(one_expert, out_mf, (w_edf, starts_e, ends_e))[0]


@jax.custom_vjp
def _grouped_matmul_by_expert(x_md: jax.Array, w_edf: jax.Array, sizes_e: jax.Array) -> jax.Array:
    """``ragged_dot``'s value on CPU without its [e, m, d] masked copy of the rows (JAX's generic lowering,
    e times the activations). A custom VJP keeps the residuals to the inputs: differentiated directly, the
    scan would save each expert's row mask ([e, m, f] a layer).
    Work is e times the grouped matmul's: for CPU runs and plans only."""
    return _scan_experts(x_md, w_edf, sizes_e)


def _grouped_matmul_fwd(x_md, w_edf, sizes_e):
    return _scan_experts(x_md, w_edf, sizes_e), (x_md, w_edf, sizes_e)


def _grouped_matmul_bwd(residuals, d_out_mf):
    x_md, w_edf, sizes_e = residuals
    d_x_md = _scan_experts(d_out_mf, jnp.swapaxes(w_edf, 1, 2), sizes_e)
    starts_e, ends_e, row_m = _rows_by_expert(sizes_e, x_md.shape[0])

    def one_expert(_, bounds):  # d w[e] = x[group e]^T @ d_out[group e]
        rows_m = ((row_m >= bounds[0]) & (row_m < bounds[1]))[:, None]
        return None, jnp.where(rows_m, x_md, jnp.zeros((), x_md.dtype)).T @ d_out_mf

    d_w_edf = jax.lax.scan(one_expert, None, (starts_e, ends_e))[1]
    no_sizes = np.zeros(sizes_e.shape, jax.dtypes.float0)  # integer group sizes have no cotangent
    return d_x_md.astype(x_md.dtype), d_w_edf.astype(w_edf.dtype), no_sizes


_grouped_matmul_by_expert.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


def grouped_matmul(x_md: jax.Array, w_edf: jax.Array, sizes_e: jax.Array) -> jax.Array:
    """Rows of ``x_md`` sorted by expert (``sizes_e`` rows each; rows after the last group are padding, their
    output zero) times their expert's ``w_edf[e]`` ([m, f]), chosen by the platform the program is compiled
    for: ``megablox.grouped_matmul_tpu`` (``trace_jax.kernels``) on TPU (``jax.lax.ragged_dot`` where the
    operands are not bfloat16 / float32, which ``tgmm`` refuses), ``jax.lax.ragged_dot`` on GPU, a scan over
    experts on CPU."""
    tpu = megablox.grouped_matmul_tpu if megablox.takes(x_md, w_edf) else jax.lax.ragged_dot
    return jax.lax.platform_dependent(
        x_md, w_edf, sizes_e, cpu=_grouped_matmul_by_expert, tpu=tpu, default=jax.lax.ragged_dot
    )


def grouped_experts(x_nd, top_i_nk, top_w_nk, gate_edf, up_edf, down_efd) -> jax.Array:
    """Dropless grouped matmul: each token through its top-k experts, gate-weighted and summed ([n, d])."""
    n, k = top_i_nk.shape
    expert_m = top_i_nk.reshape(-1)
    order_m = jnp.argsort(expert_m, stable=True)  # (token, choice) pairs grouped by expert
    token_m = order_m // k
    sizes_e = jnp.bincount(expert_m, length=gate_edf.shape[0]).astype(jnp.int32)
    x_md = jnp.take(x_nd, token_m, axis=0)
    gate_mf = grouped_matmul(x_md, gate_edf, sizes_e)
    hidden_mf = jax.nn.silu(gate_mf) * grouped_matmul(x_md, up_edf, sizes_e)
    out_md = grouped_matmul(hidden_mf, down_efd, sizes_e)
    out_md = out_md * jnp.take(top_w_nk.reshape(-1), order_m)[:, None].astype(out_md.dtype)
    return jnp.zeros((n, x_nd.shape[1]), out_md.dtype).at[token_m].add(out_md)


def dense_experts(x_nd, top_i_nk, top_w_nk, gate_edf, up_edf, down_efd) -> jax.Array:
    """Reference: every expert on every token, weighted by the gates (zero off the top-k) ([n, d])."""
    n = x_nd.shape[0]
    weight_ne = jnp.zeros((n, gate_edf.shape[0]), jnp.float32).at[jnp.arange(n)[:, None], top_i_nk].add(top_w_nk)
    gate_nef = jnp.einsum("nd,edf->nef", x_nd, gate_edf)
    hidden_nef = jax.nn.silu(gate_nef) * jnp.einsum("nd,edf->nef", x_nd, up_edf)
    out_ned = jnp.einsum("nef,efd->ned", hidden_nef, down_efd)
    return jnp.einsum("ned,ne->nd", out_ned, weight_ne.astype(out_ned.dtype))


_EXPERT_COMPUTE = {"grouped": grouped_experts, "dense": dense_experts}


class MoeBlock(nnx.Module):
    """Top-k softmax router over ``num_experts`` SwiGLU experts (see the module docstring)."""

    def __init__(self, config: MoeConfig, rngs: nnx.Rngs):
        self.config = config
        d, f, e = config.hidden_size, config.moe_intermediate_size, config.num_experts
        self.router = _param(rngs, config, (d, e), ("embed", None), d)
        self.gate_proj = _param(rngs, config, (e, d, f), ("expert", "embed", "mlp"), d)
        self.up_proj = _param(rngs, config, (e, d, f), ("expert", "embed", "mlp"), d)
        self.down_proj = _param(rngs, config, (e, f, d), ("expert", "mlp", "embed"), f)

    def route(self, x_nd: jax.Array, replay_nk: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(probs_ne, top_w_nk, top_i_nk)``: float32 router probabilities, the top-k gate weights
        (renormalised when ``norm_topk_prob``) and the chosen experts (int32).

        ``replay_nk`` (int32, -1 on tokens without a record): routing replay. A recorded token takes the
        recorded experts instead of its own top-k; its gate weights are still this router's probabilities of
        those experts (renormalised likewise), so the router keeps its gradient.

        The engine records every token it computes (``EngineConfig.routing_replay``): sampled tokens as it
        decodes them, prompt and observation tokens as its prefill appends them, so the context feeding a
        sampled token is routed as in the sampler too. Tokens without a record (trees recorded before the
        engine kept the context, a dense sampler's trees) are routed here. Measured (``docs/benchmarks.md``,
        routing replay over the context): context flips are rare (0.2-0.6% of context decisions, bf16 sampler
        vs fp32 trainer) but carry the largest log-prob gaps that sampled-token replay alone leaves."""
        logits_ne = x_nd.astype(jnp.float32) @ self.router.value.astype(jnp.float32)
        probs_ne = jax.nn.softmax(logits_ne, axis=-1)
        top_w_nk, top_i_nk = jax.lax.top_k(probs_ne, self.config.num_experts_per_tok)
        top_i_nk = top_i_nk.astype(jnp.int32)
        if replay_nk is not None:
            top_i_nk = jnp.where(replay_nk[:, :1] >= 0, replay_nk.astype(jnp.int32), top_i_nk)
            top_w_nk = jnp.take_along_axis(probs_ne, top_i_nk, axis=-1)
        if self.config.norm_topk_prob:
            top_w_nk = top_w_nk / jnp.sum(top_w_nk, axis=-1, keepdims=True)
        return probs_ne, top_w_nk, top_i_nk

    def __call__(
        self, x_btd: jax.Array, token_mask_bt: jax.Array | None = None, replay_btk: jax.Array | None = None
    ) -> tuple[jax.Array, RouterStats, jax.Array]:
        """The block's output [B, T, D] (x's dtype), its router statistics over tokens where the mask is set
        and the experts each token went to (int32 [B, T, k]; ``replay_btk`` where it is set, see ``route``)."""
        b, t, d = x_btd.shape
        dtype = x_btd.dtype
        x_nd = x_btd.reshape(b * t, d)
        replay_nk = None if replay_btk is None else replay_btk.reshape(b * t, -1)
        probs_ne, top_w_nk, top_i_nk = self.route(x_nd, replay_nk)
        weights = (self.gate_proj.value, self.up_proj.value, self.down_proj.value)
        compute = _EXPERT_COMPUTE[self.config.expert_compute]
        dispatch = EXPERT_DISPATCH[self.config.expert_dispatch]
        out_nd = dispatch(compute, x_nd, top_i_nk, top_w_nk, *(w.astype(dtype) for w in weights))
        mask_n = jnp.ones((b * t,), jnp.float32) if token_mask_bt is None else token_mask_bt.reshape(-1)
        mask_n = mask_n.astype(jnp.float32)
        chosen_e = jnp.zeros_like(probs_ne[0]).at[top_i_nk].add(jnp.broadcast_to(mask_n[:, None], top_i_nk.shape))
        stats = RouterStats(chosen_e, jnp.sum(probs_ne * mask_n[:, None], axis=0), jnp.sum(mask_n))
        out_btd = constrain(out_nd.reshape(b, t, d).astype(dtype), ("batch", "length", None))
        return out_btd, stats, top_i_nk.reshape(b, t, -1)


class MoeOutput(NamedTuple):
    """What ``QwenMoe.forward_hidden`` reports besides activations.

    stats: the sparse layers' ``RouterStats``.
    experts_btlk: int32 [B, T, sparse layers, top-k], the experts each token went to in each sparse layer
      (depth order), when asked for (``record_routing=True``); None otherwise.
    """

    stats: RouterStats
    experts_btlk: jax.Array | None = None


# --------------------------------------------------------------------------------------------- model
class QwenMoe(Qwen):
    """The Qwen3-MoE decoder: ``Qwen`` with two layer stacks (``dense_layers``, ``moe_layers``; either may be
    absent) run in depth order; ``forward_hidden`` also returns the ``RouterStats`` of the sparse layers."""

    config_class = MoeConfig

    def init_layers(self, config: MoeConfig, rngs: nnx.Rngs) -> None:
        if config.dense_layers:
            self.dense_layers = stacked_layers(config, rngs, len(config.dense_layers))
        if config.sparse_layers:
            moe = lambda layer_rngs: MoeBlock(config, layer_rngs)
            self.moe_layers = stacked_layers(config, rngs, len(config.sparse_layers), mlp=moe)

    def run_layers(
        self,
        x_btd,
        positions_bt,
        cache,
        kv_visible_end_bt,
        token_mask_bt,
        routing_btlk: jax.Array | None = None,
        record_routing: bool = False,
    ):
        """As ``Qwen.run_layers``; the extra output is a ``MoeOutput``. ``routing_btlk`` (int32 [B, T, sparse
        layers, top-k], -1 on tokens without a record) replays a recorded expert selection (``MoeBlock.route``);
        ``record_routing`` returns each token's selection (``MoeOutput.experts_btlk``)."""
        config = self.config
        sparse_rows = {layer: row for row, layer in enumerate(config.sparse_layers)}
        row_of_layer = jnp.asarray([sparse_rows.get(i, 0) for i in range(config.num_layers)], jnp.int32)
        b, t = x_btd.shape[:2]
        record = None
        if record_routing:
            record = jnp.full((b, t, *config.routing_shape), -1, jnp.int32)

        def dense_body(layer: DecoderLayer, x_btd, cache, index, stats, record):
            return (*layer(x_btd, positions_bt, index, cache, kv_visible_end_bt), stats, record)

        def sparse_body(layer: DecoderLayer, x_btd, cache, index, stats, record):
            row = row_of_layer[index]
            replay_btk = None
            if routing_btlk is not None:
                replay_btk = jax.lax.dynamic_index_in_dim(routing_btlk, row, axis=2, keepdims=False)
            x_btd, cache = layer.attend(x_btd, positions_bt, index, cache, kv_visible_end_bt)
            out_btd, layer_stats, experts_btk = layer.mlp(layer.post_attn_norm(x_btd), token_mask_bt, replay_btk)
            if record is not None:
                record = jax.lax.dynamic_update_index_in_dim(record, experts_btk, row, axis=2)
            return x_btd + out_btd, cache, jax.tree.map(jnp.add, stats, layer_stats), record

        stats = RouterStats.zeros(config.num_experts)
        rows = {False: 0, True: 0}  # next unused row of each stack
        for sparse, run in itertools.groupby(range(config.num_layers), key=config.is_sparse):
            layers = list(run)
            stack = self.moe_layers if sparse else self.dense_layers
            start, stop = rows[sparse], rows[sparse] + len(layers)
            rows[sparse] = stop
            graphdef, state = nnx.split(stack)
            if (start, stop) != (0, jax.tree.leaves(state)[0].shape[0]):
                stack = nnx.merge(graphdef, jax.tree.map(lambda a, s=start, e=stop: a[s:e], state))
            index = jnp.asarray(layers, jnp.int32)
            x_btd, cache, stats, record = scan_layers(
                config, stack, sparse_body if sparse else dense_body, x_btd, cache, index, stats, record
            )
        return x_btd, cache, MoeOutput(stats, record)
