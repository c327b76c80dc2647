"""The Qwen2 / Qwen2.5 / dense Qwen3 decoder in Flax nnx, with a per-slot KV cache.

One module covers both families; they differ only in config flags:

* Qwen2 / Qwen2.5: biases on the q/k/v projections, no q/k norm, ``head_dim = hidden / heads``;
* Qwen3 (dense): RMSNorm on every query and key head (before RoPE), no biases, explicit ``head_dim``.

Every parameter is an ``nnx.Param`` whose ``logical_axes`` metadata names its axes (``embed``, ``mlp``,
``heads``, ``kv_heads``, ``head_dim``, ``vocab``); ``trace_jax.parallel.mesh`` maps those names to mesh
axes. Letters in array names: b batch (slot), t new tokens, s cache positions, d hidden, h query heads,
k kv heads, g queries per kv head, e head dim, f mlp, v vocab, l layers.

Layers are scanned: ``Qwen.layers`` is one ``DecoderLayer`` whose parameters carry a leading ``layers`` axis
(logical name "layers", never sharded), and ``hidden`` runs them with ``jax.lax.scan`` over ``nnx.split``
state (``scan_layers``), so compile time does not grow with depth. A family with other layers subclasses
``Qwen`` and overrides ``init_layers`` / ``run_layers`` (``trace_jax.models.moe``: a ``DecoderLayer`` takes its
feed-forward block as an argument, so attention, norms and RoPE stay these). ``ModelConfig.remat`` picks what
each layer keeps for the backward pass (``REMAT_POLICIES``). Attention is ``trace_jax.models.attention.attention``
(float32 accumulation; reference / cuDNN / splash by backend).

Dtypes: ``param_dtype`` is the stored weights' dtype (and, through ``optax``, the optimizer state's),
``dtype`` the compute dtype. The usual large-model choice is ``param_dtype="float32", dtype="bfloat16"``:
float32 master weights and Adam moments, bf16 matmuls (weights are cast per layer inside the scan) with
float32 accumulation in attention, norms and the LM head's softmax. ``param_dtype="bfloat16"`` halves the
weights and moments but updates bf16 weights directly (small updates round away); prefer it for inference.

KV cache layout (``KVCache``): ``k`` and ``v`` are ``[layers, batch, max_len, kv_heads, head_dim]`` in the
compute dtype, ``lengths`` is int32 ``[batch]``, the number of valid positions per slot. Slots are
independent: each has its own write position, so prompts of different lengths need no left padding.
The layer scan touches the cache only through ``KVCache.write_layer`` / ``read_layer`` (via
``attention.attend_cached``), so another cache type with those two methods (a paged one) plugs in.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from trace_jax.models import attention as attention_lib
from trace_jax.models import lora as lora_lib
from trace_jax.parallel.mesh import constrain

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

# What one scanned layer keeps for the backward pass (``jax.checkpoint`` policies; None = no remat):
# "none" keeps every intermediate, "full" only the layer's input (recomputes the layer in the backward
# pass), "save_dots" keeps the outputs of the weight matmuls (no batch dimension) and recomputes the rest,
# attention scores included (as MaxText's "minimal"-style policies do).
REMAT_POLICIES: dict[str, Any] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Qwen2/Qwen3 dense decoder (field names follow our code, ``from_hf`` maps HF's)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    qkv_bias: bool = False  # Qwen2 family
    qk_norm: bool = True  # Qwen3 family
    max_position_embeddings: int = 32768
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"
    remat: str = "none"  # a key of REMAT_POLICIES: what the layer scan keeps for the backward pass
    attention: str = "auto"  # a key of attention.ATTENTION or "auto" (per backend)
    # Low-rank adapters on the projections (``trace_jax.models.lora.LoRAConfig`` documents them); rank 0: none.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: str = "q,k,v,o,gate,up,down"
    lora_base_quant: str = "none"

    def __post_init__(self):
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r}; choose one of {sorted(_DTYPES)}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"ModelConfig.remat={self.remat!r}; choose one of {sorted(REMAT_POLICIES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads} (GQA groups)"
            )

    @property
    def lora(self) -> lora_lib.LoRAConfig:
        """The adapters this architecture carries (``rank == 0``: none)."""
        return lora_lib.LoRAConfig(
            rank=self.lora_rank, alpha=self.lora_alpha, targets=self.lora_targets, base_quant=self.lora_base_quant
        )

    @property
    def without_lora(self) -> ModelConfig:
        """This architecture without adapters (nor a quantized base): the base the adapters go on."""
        return dataclasses.replace(self, lora_rank=0, lora_base_quant="none")

    @property
    def compute_dtype(self) -> jnp.dtype:
        return _DTYPES[self.dtype]

    @property
    def weight_dtype(self) -> jnp.dtype:
        return _DTYPES[self.param_dtype]

    @property
    def family(self) -> str:
        return "qwen3" if self.qk_norm else "qwen2"

    # --------------------------------------------------------------------------------------- presets
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """A named architecture (see ``PRESETS``); keyword overrides replace fields."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
        return dataclasses.replace(PRESETS[name], **overrides)

    # ------------------------------------------------------------------------------------ HF configs
    @classmethod
    def from_hf(cls, config: str | os.PathLike | dict[str, Any], **overrides: Any) -> ModelConfig:
        """Reads a Hugging Face ``config.json`` (a path, its directory, or the parsed dict).

        Supports ``Qwen2ForCausalLM`` and ``Qwen3ForCausalLM``; reads ``rope_theta`` at top level or inside
        transformers 5's ``rope_parameters``.
        """
        if not isinstance(config, dict):
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path) as f:
                config = json.load(f)
        model_type = config.get("model_type")
        if model_type not in HF_MODEL_TYPES:
            raise ValueError(f"unsupported architecture model_type={model_type!r}; supported: {sorted(HF_MODEL_TYPES)}")
        config_class, flags = HF_MODEL_TYPES[model_type]
        if not issubclass(config_class, cls):
            raise ValueError(
                f"model_type={model_type!r} is read by {config_class.__name__}.from_hf, not {cls.__name__}"
            )
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if rope.get("rope_type", "default") not in ("default", None):
            raise ValueError(f"unsupported RoPE scaling {rope.get('rope_type')!r}; only plain RoPE is supported")
        theta = config.get("rope_theta", rope.get("rope_theta"))
        if theta is None:
            raise ValueError("config.json has neither rope_theta nor rope_parameters.rope_theta")
        heads = config["num_attention_heads"]
        fields = dict(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rope_theta=float(theta),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            max_position_embeddings=config.get("max_position_embeddings", 32768),
            **flags,
        )
        if model_type == "qwen2":
            fields["qkv_bias"] = config.get("attention_bias", True)
        fields.update(config_class.hf_fields(config))
        return config_class(**{**fields, **overrides})

    @classmethod
    def hf_fields(cls, config: dict[str, Any]) -> dict[str, Any]:
        """The fields a subclass reads from an HF ``config.json`` beyond the dense decoder's (none here)."""
        return {}

    @property
    def routing_shape(self) -> tuple[int, int] | None:
        """``(sparse layers, top-k)`` of one token's expert-selection record; None: no router (dense)."""
        return None

    def layer_stacks(self) -> dict[str, tuple[int, ...]]:
        """The model's stacked layer parameters: stack name -> the decoder layer of each of its rows."""
        return {"layers": tuple(range(self.num_layers))}

    def mlp_params(self) -> int:
        """Parameters of all the layers' feed-forward blocks (a subclass with other blocks overrides it)."""
        return self.num_layers * 3 * self.hidden_size * self.intermediate_size

    @property
    def active_mlp_width(self) -> float:
        """Mean hidden width of the feed-forward work one token does per layer (a mixture of experts: its top-k
        experts' widths in sparse layers); the planner's activation estimate."""
        return float(self.intermediate_size)

    def active_params(self) -> int:
        """Parameters one token uses (all of them in a dense model)."""
        return num_params(self)

    def to_hf(self) -> dict[str, Any]:
        """The ``config.json`` dict transformers needs to rebuild this architecture."""
        family = self.family
        return {
            "architectures": [f"{family.capitalize()}ForCausalLM"],
            "model_type": family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.qkv_bias,
            "max_position_embeddings": self.max_position_embeddings,
            "torch_dtype": self.param_dtype,
            "use_cache": True,
        }


# HF ``model_type`` -> (the config class that reads it, the flags it fixes). Another family's module adds its row.
HF_MODEL_TYPES: dict[str, tuple[type[ModelConfig], dict[str, Any]]] = {
    "qwen2": (ModelConfig, {"qkv_bias": True, "qk_norm": False}),
    "qwen3": (ModelConfig, {"qkv_bias": False, "qk_norm": True}),
}


def _qwen25(hidden, inter, layers, heads, kv, vocab=151936, tied=True, eps=1e-6) -> ModelConfig:
    return ModelConfig(vocab, hidden, inter, layers, heads, kv, hidden // heads, 1e6, eps, tied, True, False)


def _qwen3(hidden, inter, layers, heads, kv, tied) -> ModelConfig:
    return ModelConfig(151936, hidden, inter, layers, heads, kv, 128, 1e6, 1e-6, tied, False, True, 40960)


# Published architectures (from the models' config.json files), plus tiny sizes for tests and CPU runs.
PRESETS: dict[str, ModelConfig] = {
    "qwen2.5-0.5b": _qwen25(896, 4864, 24, 14, 2),
    "qwen2.5-1.5b": _qwen25(1536, 8960, 28, 12, 2),
    "qwen2.5-3b": _qwen25(2048, 11008, 36, 16, 2),
    "qwen2.5-7b": _qwen25(3584, 18944, 28, 28, 4, vocab=152064, tied=False),
    "qwen2.5-14b": _qwen25(5120, 13824, 48, 40, 8, vocab=152064, tied=False, eps=1e-5),
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, 8, tied=True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, 8, tied=True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, 8, tied=True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, 8, tied=False),
    "qwen3-14b": _qwen3(5120, 17408, 40, 40, 8, tied=False),
    "qwen3-32b": _qwen3(5120, 25600, 64, 64, 8, tied=False),
    "qwen3-tiny": ModelConfig(512, 64, 128, 2, 4, 2, 16, 1e6, 1e-6, True, False, True, 2048),
    "qwen2-tiny": ModelConfig(512, 64, 128, 2, 4, 2, 16, 1e4, 1e-6, False, True, False, 2048),
    "qwen3-20m": ModelConfig(8192, 384, 1024, 6, 6, 2, 64, 1e6, 1e-6, True, False, True, 4096),
}


def num_params(config: ModelConfig) -> int:
    """Parameter count of the architecture, computed from the config alone (no weights needed)."""
    d, e = config.hidden_size, config.head_dim
    q, kv = config.num_heads * e, config.num_kv_heads * e
    attention = d * (q + 2 * kv) + q * d
    attention += (q + 2 * kv) if config.qkv_bias else 0
    attention += 2 * e if config.qk_norm else 0
    per_layer = attention + 2 * d
    embeddings = config.vocab_size * d * (1 if config.tie_word_embeddings else 2)
    return config.num_layers * per_layer + config.mlp_params() + embeddings + d


# ---------------------------------------------------------------------------------------------- cache
class KVCache(NamedTuple):
    """Per-slot key/value cache. k, v: [layers, batch, max_len, kv_heads, head_dim]; lengths: int32 [batch]."""

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @classmethod
    def init(cls, config: ModelConfig, batch: int, max_len: int, dtype: Any = None) -> KVCache:
        shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
        dtype = dtype or config.compute_dtype
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def write_layer(self, layer: jax.Array, positions_bt: jax.Array, k_btke: jax.Array, v_btke: jax.Array) -> KVCache:
        """Stores one layer's new keys / values of slot b at ``positions_bt[b]`` (int32 [B, T]; ``layer`` may
        be traced). Positions past ``max_len`` (padding) are dropped, never clipped onto the last position."""
        slots_b1 = jnp.arange(k_btke.shape[0])[:, None]
        k = self.k.at[layer, slots_b1, positions_bt].set(k_btke.astype(self.k.dtype), mode="drop")
        v = self.v.at[layer, slots_b1, positions_bt].set(v_btke.astype(self.v.dtype), mode="drop")
        return self._replace(k=k, v=v)

    def read_layer(self, layer: jax.Array) -> tuple[jax.Array, jax.Array]:
        """One layer's keys and values, [B, max_len, kv_heads, head_dim] each; position s is key s."""
        return self.k[layer], self.v[layer]


class ModelOutput(NamedTuple):
    logits_btv: jax.Array | None  # float32
    hidden_btd: jax.Array  # final hidden states (after the final norm), compute dtype
    cache: KVCache | None


# --------------------------------------------------------------------------------------------- layers
def _param(rngs: nnx.Rngs, config: ModelConfig, shape: tuple[int, ...], axes: tuple[str, ...], fan_in: int):
    init = jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)
    return nnx.Param(init.astype(config.weight_dtype), logical_axes=axes)


def _ones(config: ModelConfig, shape: tuple[int, ...], axes: tuple[str, ...]):
    return nnx.Param(jnp.ones(shape, config.weight_dtype), logical_axes=axes)


def _zeros(config: ModelConfig, shape: tuple[int, ...], axes: tuple[str, ...]):
    return nnx.Param(jnp.zeros(shape, config.weight_dtype), logical_axes=axes)


def token_matmul(x: jax.Array, w: jax.Array, contract: int = 1) -> jax.Array:
    """``x [..tokens.., *in] @ w [*in, *out]`` over the last ``contract`` axes of ``x`` (the first of ``w``).

    Tokens and features are flattened to one 2-D matmul ``[N, In] @ [In, Out]`` (free reshapes): XLA:CPU's
    backward pass then transposes 2-D operands, for which it emits fast tiled transposes, instead of
    [b, t, f] ones fused with elementwise ops (3-5x slower, ~30% of a train step's time measured here).
    """
    batch_shape, in_shape = x.shape[: x.ndim - contract], x.shape[x.ndim - contract :]
    out_shape = w.shape[contract:]
    x_ni = x.reshape(math.prod(batch_shape), math.prod(in_shape))
    out_no = x_ni @ w.reshape(math.prod(in_shape), math.prod(out_shape))
    return out_no.reshape(*batch_shape, *out_shape)


class RMSNorm(nnx.Module):
    """``x / rms(x) * scale`` over the last axis, computed in float32 like the reference."""

    def __init__(self, config: ModelConfig, size: int, axis_name: str):
        self.eps = config.rms_norm_eps
        self.scale = _ones(config, (size,), (axis_name,))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale.value.astype(x.dtype) * normed.astype(x.dtype)


def rope(x_bthe: jax.Array, positions_bt: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding in the rotate-half convention of the HF Qwen checkpoints."""
    half = x_bthe.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
    angles_bte = positions_bt[..., None].astype(jnp.float32) * inv_freq
    cos, sin = jnp.cos(angles_bte)[:, :, None, :], jnp.sin(angles_bte)[:, :, None, :]
    x1, x2 = jnp.split(x_bthe.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_bthe.dtype)


class Attention(nnx.Module):
    """Grouped-query attention with optional q/k/v bias (Qwen2) or q/k RMSNorm (Qwen3)."""

    LORA_TARGETS: ClassVar[dict[str, int]] = {
        "q_proj": 1,
        "k_proj": 1,
        "v_proj": 1,
        "o_proj": 2,
    }  # projection -> its input axes

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.config = config
        d, h, k, e = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.q_proj = _param(rngs, config, (d, h, e), ("embed", "heads", "head_dim"), d)
        self.k_proj = _param(rngs, config, (d, k, e), ("embed", "kv_heads", "head_dim"), d)
        self.v_proj = _param(rngs, config, (d, k, e), ("embed", "kv_heads", "head_dim"), d)
        self.o_proj = _param(rngs, config, (h, e, d), ("heads", "head_dim", "embed"), h * e)
        if config.qkv_bias:
            self.q_bias = _zeros(config, (h, e), ("heads", "head_dim"))
            self.k_bias = _zeros(config, (k, e), ("kv_heads", "head_dim"))
            self.v_bias = _zeros(config, (k, e), ("kv_heads", "head_dim"))
        if config.qk_norm:
            self.q_norm = RMSNorm(config, e, "head_dim")
            self.k_norm = RMSNorm(config, e, "head_dim")

    def _project(self, x_btd: jax.Array, name: str) -> jax.Array:
        dtype = x_btd.dtype
        out = token_matmul(x_btd, lora_lib.weight(self, f"{name}_proj").astype(dtype))
        if self.config.qkv_bias:
            out = out + getattr(self, f"{name}_bias").value.astype(dtype)
        if self.config.qk_norm and name in ("q", "k"):
            out = getattr(self, f"{name}_norm")(out)
        return constrain(out, ("batch", "length", "heads" if name == "q" else "kv_heads", None))

    def __call__(
        self,
        x_btd: jax.Array,
        positions_bt: jax.Array,
        layer: jax.Array,
        cache: KVCache | None,
        kv_visible_end_bt: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        cfg = self.config
        q_bthe = rope(self._project(x_btd, "q"), positions_bt, cfg.rope_theta)
        k_btke = rope(self._project(x_btd, "k"), positions_bt, cfg.rope_theta)
        v_btke = self._project(x_btd, "v")
        if cache is None:
            # Row index order is causal order; a packed tree also bounds who may see each key (see ``hidden``).
            b, t = x_btd.shape[:2]
            index_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
            attended_bthe = attention_lib.attention(
                q_bthe,
                k_btke,
                v_btke,
                index_bt,
                kv_visible_end_bt,
                in_order=True,
                implementation=cfg.attention,
            )
        else:
            attended_bthe, cache = attention_lib.attend_cached(
                cache, layer, q_bthe, k_btke, v_btke, positions_bt, cfg.attention
            )
        out_btd = token_matmul(attended_bthe, lora_lib.weight(self, "o_proj").astype(x_btd.dtype), contract=2)
        return out_btd, cache


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    LORA_TARGETS: ClassVar[dict[str, int]] = {
        "gate_proj": 1,
        "up_proj": 1,
        "down_proj": 1,
    }  # projection -> its input axes

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = _param(rngs, config, (d, f), ("embed", "mlp"), d)
        self.up_proj = _param(rngs, config, (d, f), ("embed", "mlp"), d)
        self.down_proj = _param(rngs, config, (f, d), ("mlp", "embed"), f)

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        dtype = x_btd.dtype
        gate_btf = jax.nn.silu(token_matmul(x_btd, lora_lib.weight(self, "gate_proj").astype(dtype)))
        hidden_btf = gate_btf * token_matmul(x_btd, lora_lib.weight(self, "up_proj").astype(dtype))
        hidden_btf = constrain(hidden_btf, ("batch", "length", "mlp"))
        return token_matmul(hidden_btf, lora_lib.weight(self, "down_proj").astype(dtype))


class DecoderLayer(nnx.Module):
    """A pre-norm block: ``x + attn(norm(x))``, then ``+ mlp(norm(x))``. ``mlp`` defaults to the dense SwiGLU
    ``MLP``; another feed-forward block (a mixture of experts) is passed in built, the rest of the layer shared."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, mlp: Callable[[nnx.Rngs], nnx.Module] | None = None):
        self.input_norm = RMSNorm(config, config.hidden_size, "embed")
        self.attn = Attention(config, rngs)
        self.post_attn_norm = RMSNorm(config, config.hidden_size, "embed")
        self.mlp = MLP(config, rngs) if mlp is None else mlp(rngs)

    def attend(self, x_btd, positions_bt, layer, cache, kv_visible_end_bt=None):
        """The attention half: ``(x + attn(norm(x)), cache)``."""
        attended, cache = self.attn(self.input_norm(x_btd), positions_bt, layer, cache, kv_visible_end_bt)
        return x_btd + attended, cache

    def __call__(self, x_btd, positions_bt, layer, cache, kv_visible_end_bt=None):
        x_btd, cache = self.attend(x_btd, positions_bt, layer, cache, kv_visible_end_bt)
        return x_btd + self.mlp(self.post_attn_norm(x_btd)), cache


# Activations between layers: rows split like the batch, the hidden dim whole (weights split it, not activations).
_ACTIVATION_AXES = ("batch", "length", None)


def stacked_layers(
    config: ModelConfig, rngs: nnx.Rngs, count: int | None = None, mlp: Callable[[nnx.Rngs], nnx.Module] | None = None
) -> DecoderLayer:
    """``count`` (default ``num_layers``) independently initialised layers as one module whose params have a
    leading axis (logical name "layers"); ``mlp`` builds each layer's feed-forward block (default: dense)."""
    count = config.num_layers if count is None else count

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=count)
    def build(layer_rngs: nnx.Rngs) -> DecoderLayer:
        return DecoderLayer(config, layer_rngs, mlp)

    layers = build(rngs)
    for _, variable in nnx.iter_graph(layers):
        if isinstance(variable, nnx.Variable):
            variable.set_metadata("logical_axes", ("layers", *variable.get_metadata()["logical_axes"]))
    return layers


def _layer_by_branch(layer_state: Any, position: jax.Array) -> Any:
    """Layer ``position`` of the stacked weights, each layer a static slice in a ``lax.switch`` branch (XLA:CPU
    runs a bf16 dynamic slice on a float32 copy of the whole stack, which it hoists out of every loop)."""
    count = jax.tree.leaves(layer_state)[0].shape[0]
    branches = [functools.partial(jax.tree.map, lambda w, i=i: w[i]) for i in range(count)]
    return jax.lax.switch(position, branches, layer_state)


def _layer_for_decoding(layer_state: Any, position: jax.Array) -> Any:
    """Layer ``position`` of the stacked weights in a decoding scan: by ``_layer_by_branch`` in a program
    compiled for CPU only (``lax.platform_dependent``: the platform of the compile target, not the tracing
    host), a dynamic slice elsewhere."""
    take = lambda p: jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, p, keepdims=False), layer_state)
    return jax.lax.platform_dependent(position, cpu=lambda p: _layer_by_branch(layer_state, p), default=take)


def scan_layers(
    config: ModelConfig,
    layers: nnx.Module,
    body: Callable[..., tuple[Any, ...]],
    x_btd: jax.Array,
    cache: Any,
    layer_index: jax.Array,
    *extra_carry: Any,
) -> tuple[Any, ...]:
    """Runs the stacked ``layers`` in order with ``jax.lax.scan``: ``body(layer, x_btd, cache, index,
    *extra_carry)`` returns the new ``(x_btd, cache, *extra_carry)``; ``layer_index`` (int32, one per stacked
    layer) is each layer's position in the whole decoder (its KV cache row). Remat per ``config.remat``."""
    graphdef, layer_state = nnx.split(layers)
    # Decoding: each layer's weights are taken by ``_layer_for_decoding`` (a branch of static slices on CPU).
    by_branch = cache is not None

    def one_layer(carry, xs):
        state, index = xs
        if by_branch:
            state = _layer_for_decoding(layer_state, state)
        x_btd, cache, *rest = body(nnx.merge(graphdef, state), *carry[:2], index, *carry[2:])
        return (constrain(x_btd, _ACTIVATION_AXES), cache, *rest), None

    policy = REMAT_POLICIES[config.remat]
    if cache is None and policy is not None:  # remat matters only where a backward pass may follow
        one_layer = jax.checkpoint(one_layer, policy=policy, prevent_cse=False)
    # The cache rides in the carry (updated in place layer by layer), never stacked as a scan output.
    xs = jnp.arange(layer_index.shape[0]) if by_branch else layer_state
    carry, _ = jax.lax.scan(one_layer, (x_btd, cache, *extra_carry), (xs, layer_index))
    return carry


class Qwen(nnx.Module):
    """The decoder: embeddings, ``num_layers`` pre-norm blocks (scanned, stacked params), final norm, tied or
    separate LM head."""

    config_class = ModelConfig  # what ``family.config_from_dict`` rebuilds a saved config as

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        d, v = config.hidden_size, config.vocab_size
        self.embed = _param(rngs, config, (v, d), ("vocab", "embed"), 1)
        self.init_layers(config, rngs)
        self.final_norm = RMSNorm(config, d, "embed")
        if not config.tie_word_embeddings:
            self.lm_head = _param(rngs, config, (d, v), ("embed", "vocab"), d)
        lora_lib.add_adapters(self, config.lora, rngs)  # last: the base initialises the same with or without them
        lora_lib.quantize_base(self, config.lora)  # after the adapters: they take the base's floating dtype

    def init_layers(self, config: ModelConfig, rngs: nnx.Rngs) -> None:
        """Builds the decoder layers (``layers``: one stack of dense ``DecoderLayer``s)."""
        self.layers = stacked_layers(config, rngs)

    def hidden(
        self, tokens_bt: jax.Array, cache: KVCache | None = None, num_new_b: jax.Array | None = None, **packed
    ) -> tuple[jax.Array, KVCache | None]:
        """Final hidden states [B, T, D] and the updated cache (see ``__call__`` for the contract).

        Packed rows (no cache only; keywords ``positions_bt``, ``kv_visible_end_bt`` as in ``forward_hidden``):
        ``positions_bt`` (int32 [B, T], default 0..T-1) are the RoPE positions,
        e.g. depths along each token's root-to-leaf path; ``kv_visible_end_bt`` (int32 [B, T], default T)
        bounds who sees each key: key i is visible to query j iff ``i <= j < kv_visible_end_bt[b, i]``. With
        tree nodes laid out in depth-first pre-order, ``kv_visible_end`` of a token is the end of its node's
        subtree, so every token sees exactly its ancestors on its own path (several trees per row included).
        """
        hidden_btd, cache, _ = self.forward_hidden(tokens_bt, cache, num_new_b, **packed)
        return hidden_btd, cache

    def forward_hidden(
        self,
        tokens_bt: jax.Array,
        cache: KVCache | None = None,
        num_new_b: jax.Array | None = None,
        *,
        positions_bt: jax.Array | None = None,
        kv_visible_end_bt: jax.Array | None = None,
        token_mask_bt: jax.Array | None = None,
        **routing: Any,
    ) -> tuple[jax.Array, KVCache | None, Any]:
        """``hidden`` plus what the layers report besides activations (None for the dense decoder; a
        mixture of experts returns its router statistics over the tokens where ``token_mask_bt`` is set).

        ``routing``: a mixture of experts' routing record and replay keywords (``trace_jax.models.moe``:
        ``routing_btlk``, ``record_routing``); the dense decoder has no router and refuses them."""
        b, t = tokens_bt.shape
        if cache is None:
            if positions_bt is None:
                positions_bt = jnp.broadcast_to(jnp.arange(t), (b, t))
        elif positions_bt is not None or kv_visible_end_bt is not None:
            raise ValueError("positions_bt / kv_visible_end_bt are for cache-less (training) forwards only")
        else:
            positions_bt = cache.lengths[:, None] + jnp.arange(t)[None, :]
        # Gather the rows first, then cast: the whole table is never copied in the compute dtype.
        x_btd = attention_lib.take_rows(self.embed.value, tokens_bt).astype(self.config.compute_dtype)
        x_btd = constrain(x_btd, _ACTIVATION_AXES)
        x_btd, cache, extra = self.run_layers(x_btd, positions_bt, cache, kv_visible_end_bt, token_mask_bt, **routing)
        if cache is not None:
            added_b = jnp.full((b,), t, jnp.int32) if num_new_b is None else num_new_b.astype(jnp.int32)
            cache = cache._replace(lengths=cache.lengths + added_b)
        return self.final_norm(x_btd), cache, extra

    def run_layers(
        self, x_btd, positions_bt, cache, kv_visible_end_bt, token_mask_bt, **routing
    ) -> tuple[jax.Array, Any, Any]:
        """The decoder layers on embedded tokens: ``(x_btd, cache, extra)``; a family with other layers overrides
        this (``token_mask_bt`` is unused by dense layers)."""
        if any(value is not None and value is not False for value in routing.values()):
            raise ValueError(f"the dense decoder has no router: {sorted(routing)} need a mixture-of-experts model")

        def one_layer(layer: DecoderLayer, x_btd, cache, index):
            return layer(x_btd, positions_bt, index, cache, kv_visible_end_bt)

        layer_index = jnp.arange(self.config.num_layers, dtype=jnp.int32)
        x_btd, cache = scan_layers(self.config, self.layers, one_layer, x_btd, cache, layer_index)
        return x_btd, cache, None

    def logits(self, hidden_btd: jax.Array) -> jax.Array:
        """float32 logits from final hidden states ([..., D] -> [..., V])."""
        dtype = hidden_btd.dtype
        if not self.config.tie_word_embeddings:
            return token_matmul(hidden_btd, self.lm_head.value.astype(dtype)).astype(jnp.float32)
        # Tied: contract with the [V, D] table as stored (never a transposed copy of it).
        hidden_nd = hidden_btd.reshape(-1, hidden_btd.shape[-1])
        logits_nv = jax.lax.dot_general(hidden_nd, self.embed.value.astype(dtype), (((1,), (1,)), ((), ())))
        return logits_nv.reshape(*hidden_btd.shape[:-1], -1).astype(jnp.float32)

    def __call__(
        self,
        tokens_bt: jax.Array,
        cache: KVCache | None = None,
        num_new_b: jax.Array | None = None,
        *,
        positions_bt: jax.Array | None = None,
        kv_visible_end_bt: jax.Array | None = None,
    ) -> ModelOutput:
        """Runs ``tokens_bt`` (int32 [B, T]) through the decoder.

        Without a cache: a causal forward at positions 0..T-1 (right padding is harmless to valid tokens).
        With a cache: token t of slot b sits at position ``cache.lengths[b] + t``, is written to the cache
        there and attends to every cached position up to its own. Only the first ``num_new_b[b]`` tokens
        count (default: all T): the returned cache has ``lengths + num_new_b``; the padding's cache entries
        lie past the new length, where nothing reads them before they are overwritten.
        Packed tree rows pass ``positions_bt`` and ``kv_visible_end_bt`` (see ``hidden``).
        """
        hidden_btd, cache = self.hidden(
            tokens_bt, cache, num_new_b, positions_bt=positions_bt, kv_visible_end_bt=kv_visible_end_bt
        )
        return ModelOutput(self.logits(hidden_btd), hidden_btd, cache)
