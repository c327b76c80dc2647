"""Hugging Face Qwen2/Qwen3/Qwen3-MoE checkpoints <-> our parameters, in both directions, without torch.

The whole mapping is ``KEY_MAP``: one row per tensor kind, ``(HF key template, our key template,
transform)``. Loading reads it left to right, exporting right to left. HF's per-layer tensors
(``model.layers.{i}.…``) are the rows of our stacked layer parameters (leading ``layers`` axis).
The directory may be local or a ``gs://`` URL; each array is assembled on the mesh shard by shard
(``jax.make_array_from_callback``) from byte-range reads of only the rows that shard needs (``ranged``), so each
host reads about its share of the weights and a large model never sits whole on one host or device.

Command line (``trace_jax.job.commands.hf_main``)::

    python -m trace_jax.hf import --hf-dir D --out CKPT   # HF dir -> orbax checkpoint
    python -m trace_jax.hf export --ckpt CKPT --out D     # orbax checkpoint -> HF dir
    python -m trace_jax.hf export --workdir RUN --out D   # a run's newest policy + tokenizer files

What ``import`` is for: the parameters as an orbax checkpoint that ``load_orbax`` restores straight into a mesh's
shardings, for work from Python (notebooks, probes, custom loops), and ``export --ckpt`` back to HF. No training
recipe reads it: to train from a HF checkpoint, point ``--config.model.hf_dir`` at the HF directory itself. The
round trip keeps what a checkpoint needs besides its weights: config.json's bos/eos/pad token ids, the tokenizer
files and ``generation_config.json`` (kept under ``CKPT/hf_files/``), so the exported model stops at its EOS under
transformers' ``generate`` as the original does.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trace_jax.checkpoint import ranged
from trace_jax.data.tokenizer import TOKENIZER_FILES
from trace_jax.models import ModelConfig, abstract_model, config_from_dict, config_to_dict
from trace_jax.parallel import mesh as mesh_lib

# ------------------------------------------------------------------------------------------ transforms


@dataclasses.dataclass(frozen=True)
class Reshape:
    """Same element order; HF's tensor is ours flattened (biases split per head) or as is (``flatten=False``)."""

    flatten: bool = False

    def hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
        return (math.prod(ours),) if self.flatten else tuple(ours)

    def to_ours(self, hf: np.ndarray, ours: tuple[int, ...]) -> np.ndarray:
        return hf.reshape(ours)

    def to_hf(self, value: np.ndarray) -> np.ndarray:
        return value.reshape(self.hf_shape(value.shape))


@dataclasses.dataclass(frozen=True)
class Transpose:
    """A torch ``Linear`` weight ``[out, in]`` <-> our kernel ``[in..., out...]``.

    ``split`` is how many of our leading axes form the input side: ``q_proj`` ``[d, heads, head_dim]`` has
    split 1, ``o_proj`` ``[heads, head_dim, d]`` split 2.
    """

    split: int = 1

    def hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
        return (math.prod(ours[self.split :]), math.prod(ours[: self.split]))

    def to_ours(self, hf: np.ndarray, ours: tuple[int, ...]) -> np.ndarray:
        return hf.T.reshape(ours)

    def to_hf(self, value: np.ndarray) -> np.ndarray:
        shape = value.shape
        return value.reshape(math.prod(shape[: self.split]), math.prod(shape[self.split :])).T


_LAYER = "model.layers.{layer}."
# Per-layer HF tensors map to one stacked parameter of ours: HF layer i is a row of its leading "layers" axis
# (which row: ``ModelConfig.layer_stacks``). A mixture of experts' layers form the ``moe_layers`` stack (its
# other layers ``dense_layers``); their attention and norms use the ``layers.`` rows, their experts are the
# rows below, where HF's expert j of layer i is entry [row, j] of our [layers, experts, ...] parameter.
KEY_MAP: tuple[tuple[str, str, Reshape | Transpose], ...] = (
    ("model.embed_tokens.weight", "embed", Reshape()),
    (_LAYER + "self_attn.{qkv}_proj.weight", "layers.attn.{qkv}_proj", Transpose(1)),
    (_LAYER + "self_attn.{qkv}_proj.bias", "layers.attn.{qkv}_bias", Reshape(flatten=True)),
    (_LAYER + "self_attn.o_proj.weight", "layers.attn.o_proj", Transpose(2)),
    (_LAYER + "self_attn.{qk}_norm.weight", "layers.attn.{qk}_norm.scale", Reshape()),
    (_LAYER + "input_layernorm.weight", "layers.input_norm.scale", Reshape()),
    (_LAYER + "post_attention_layernorm.weight", "layers.post_attn_norm.scale", Reshape()),
    (_LAYER + "mlp.{mlp}_proj.weight", "layers.mlp.{mlp}_proj", Transpose(1)),
    (_LAYER + "mlp.gate.weight", "moe_layers.mlp.router", Transpose(1)),
    (_LAYER + "mlp.experts.{expert}.{mlp}_proj.weight", "moe_layers.mlp.{mlp}_proj", Transpose(1)),
    ("model.norm.weight", "final_norm.scale", Reshape()),
    ("lm_head.weight", "lm_head", Transpose(1)),
)
_PLACEHOLDERS = {"layer": r"\d+", "expert": r"\d+", "qkv": "q|k|v", "qk": "q|k", "mlp": "gate|up|down"}
# Our layer stacks whose attention / norm / dense-MLP parameters read the ``layers.`` rows of KEY_MAP.
_STACKS = ("layers", "dense_layers", "moe_layers")


def _template_regex(template: str) -> re.Pattern:
    pattern = re.escape(template)
    for name, alternatives in _PLACEHOLDERS.items():
        pattern = pattern.replace(re.escape("{" + name + "}"), f"(?P<{name}>{alternatives})")
    return re.compile(pattern + "$")


_ROWS = [(hf, _template_regex(ours), t) for hf, ours, t in KEY_MAP]


def _row(our_key: str) -> tuple[str, dict[str, str], Reshape | Transpose]:
    """The KEY_MAP row of one of our keys: ``(HF template, its fields, transform)``; a layer stack's key
    without a row of its own (``moe_layers.attn.q_proj``) takes the ``layers.`` row."""
    stack, _, rest = our_key.partition(".")
    for candidate in (our_key, f"layers.{rest}" if stack in _STACKS else None):
        for hf, ours_re, transform in _ROWS:
            if candidate and (match := ours_re.match(candidate)):
                return hf, match.groupdict(), transform
    raise KeyError(f"parameter {our_key!r} has no row in KEY_MAP")


def ours_to_hf(our_key: str, layer: int | None = None, expert: int | None = None) -> tuple[str, Reshape | Transpose]:
    """The HF tensor name and transform for one of our parameter keys (the table read backwards); stacked
    parameters need the HF ``layer`` (and per-expert ones the ``expert``) whose HF name is wanted."""
    hf, fields, transform = _row(our_key)
    stacked = "{layer}" in hf
    if stacked != (layer is not None):
        raise ValueError(f"{our_key!r} is {'' if stacked else 'not '}stacked over layers; layer={layer}")
    if ("{expert}" in hf) != (expert is not None):
        raise ValueError(f"{our_key!r} needs an expert index exactly when it holds experts; expert={expert}")
    return hf.format(layer=layer, expert=expert, **fields), transform


def is_stacked(our_key: str) -> bool:
    """Whether our parameter has a leading layers axis (one HF tensor per layer)."""
    return _stacked_axes(our_key) > 0


def _stacked_axes(our_key: str) -> int:
    """How many leading axes of our parameter index HF tensors: 0, 1 (layers) or 2 (layers, experts)."""
    hf = _row(our_key)[0]
    return ("{layer}" in hf) + ("{expert}" in hf)


def hf_slots(config: ModelConfig, our_key: str, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], str, Any]]:
    """Every HF tensor of one of our parameters: ``(index into our leading stacked axes, HF key, transform)``;
    the rows of a layer stack are the HF layers ``config.layer_stacks()`` lists for it."""
    axes = _stacked_axes(our_key)
    if axes == 0:
        return [((), *ours_to_hf(our_key))]
    hf_layers = config.layer_stacks()[our_key.partition(".")[0]]
    if len(hf_layers) != shape[0]:
        raise ValueError(f"{our_key!r} stacks {shape[0]} layers, the config's {len(hf_layers)}")
    slots = []
    for row, layer in enumerate(hf_layers):
        for expert in range(shape[1]) if axes == 2 else [None]:
            index = (row,) if expert is None else (row, expert)
            slots.append((index, *ours_to_hf(our_key, layer, expert)))
    return slots


# ------------------------------------------------------------------------------ safetensors, no torch
_ST_NAMES = {v: k for k, v in ranged.ST_DTYPES.items()}


def write_safetensors(path: str, tensors: Mapping[str, np.ndarray]) -> None:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, value in tensors.items():
        header[name] = {"dtype": _ST_NAMES[value.dtype], "shape": list(value.shape), "data_offsets": [offset, 0]}
        offset += value.nbytes
        header[name]["data_offsets"][1] = offset
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for value in tensors.values():
            f.write(np.ascontiguousarray(value).tobytes())


# ------------------------------------------------------------------------------------------ loading
def _flat(state: nnx.State) -> Iterator[tuple[str, nnx.Variable]]:
    for path, variable in nnx.to_flat_state(state):
        yield ".".join(str(p) for p in path), variable


def load_hf(
    hf_dir: str | os.PathLike,
    mesh: Mesh | None = None,
    files: ranged.CheckpointFiles | None = None,
    **config_overrides: Any,
) -> tuple[ModelConfig, nnx.State]:
    """Reads a Qwen2/Qwen3/Qwen3-MoE HF checkpoint directory (config.json + safetensors, one file or sharded).

    Returns ``(config, params)`` where ``params`` is the ``nnx.Param`` state of ``create_model(config)``
    (``nnx.merge(graphdef, params)`` rebuilds the model). ``hf_dir`` may be local or a ``gs://`` URL. With a mesh,
    each array is placed shard by shard, each process reading only the rows of its own devices' shards.
    ``files``: ``hf_dir``'s ``ranged.CheckpointFiles`` when the caller holds one (its ``bytes_read`` then counts
    this load's reads). ``config_overrides`` (e.g. ``dtype="bfloat16"``) replace fields;
    parameters are cast to ``config.param_dtype``.
    """
    hf_dir = os.fspath(hf_dir)
    config = ModelConfig.from_hf(_hf_config(hf_dir), **config_overrides)
    files = files or ranged.CheckpointFiles(hf_dir)
    tensors = dict(files.entries)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # tied: transformers ignores a stored head too
    target = abstract_model(config)[1]
    expected = dict(_flat(target))
    # Every HF tensor the config implies: HF key -> (our key, index into its stacked axes, transform, HF shape).
    wanted: dict[str, tuple[str, tuple[int, ...], Reshape | Transpose, tuple[int, ...]]] = {}
    for key, variable in expected.items():
        shape = tuple(variable.value.shape)
        for index, hf_key, transform in hf_slots(config, key, shape):
            wanted[hf_key] = (key, index, transform, transform.hf_shape(shape[len(index) :]))
    unexpected = sorted(k for k in tensors if k not in wanted)
    missing = [k for k in wanted if k not in tensors]
    problems = []
    if unexpected:
        problems.append(f"unexpected tensors (not in a {config.family} model of this config): {unexpected[:8]}")
    if missing:
        problems.append(f"missing tensors: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    for hf_key, (_, _, _, want) in wanted.items():
        if hf_key in tensors and tuple(tensors[hf_key].shape) != want:
            problems.append(f"tensor {hf_key} has shape {tuple(tensors[hf_key].shape)}, config.json implies {want}")
    if problems:
        raise ValueError(f"checkpoint {hf_dir} does not match its config.json:\n  " + "\n  ".join(problems))
    by_our_key: dict[str, dict[tuple[int, ...], str]] = {}
    for hf_key, (key, index, _, _) in wanted.items():
        by_our_key.setdefault(key, {})[index] = hf_key

    shardings = dict(_flat(mesh_lib.state_shardings(target, mesh))) if mesh is not None else {}
    dtype = config.weight_dtype

    def place(key: str, variable: nnx.Variable) -> jax.Array:
        full = tuple(variable.value.shape)
        slots = sorted(by_our_key[key])  # row-major over our stacked axes (layers, experts)
        inner = full[len(slots[0]) :]
        transforms = [wanted[by_our_key[key][slot]][2] for slot in slots]
        hf_keys = [by_our_key[key][slot] for slot in slots]
        if key not in shardings:
            parts = [
                t.to_ours(files.rows(h, 0, files.shape(h)[0]), inner) for t, h in zip(transforms, hf_keys, strict=True)
            ]
            return jax.numpy.asarray(np.stack(parts).reshape(full).astype(dtype))

        def assemble(*hf_arrays: jax.Array) -> jax.Array:
            parts = [t.to_ours(x, inner).astype(dtype) for t, x in zip(transforms, hf_arrays, strict=True)]
            return jax.numpy.stack(parts).reshape(full)

        # Read in HF's layout, rows spread over every device (each process reads its own rows), then transposed
        # and stacked on the devices: the mesh moves the pieces, no host holds a whole tensor.
        hf_arrays = [_spread_rows(files, h, mesh) for h in hf_keys]
        placed = jax.jit(assemble, out_shardings=shardings[key].value)(*hf_arrays)
        files.forget()
        return placed

    flat = [
        (path, variable.replace(place(key, variable)))
        for (key, variable), (path, _) in zip(_flat(target), nnx.to_flat_state(target), strict=True)
    ]
    return config, nnx.from_flat_state(flat)


def _spread_rows(files: ranged.CheckpointFiles, hf_key: str, mesh: Mesh) -> jax.Array:
    """One HF tensor as stored, its rows split over all of the mesh's devices (replicated when they do not divide)
    and each shard read by the process that holds it."""
    shape = files.shape(hf_key)
    spread = shape[0] % mesh.size == 0
    sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)) if spread else P())

    def read(index: tuple) -> np.ndarray:
        rows = range(shape[0])[index[0]]
        return files.rows(hf_key, rows.start, rows.stop)

    return jax.make_array_from_callback(shape, sharding, read)


def save_hf(
    config: ModelConfig,
    params: nnx.State,
    out_dir: str | os.PathLike,
    max_shard_bytes: int = 0,
    token_ids: Mapping[str, Any] | None = None,
) -> None:
    """Writes ``config.json`` and safetensors that ``transformers.AutoModelForCausalLM`` loads.

    With ``max_shard_bytes > 0`` the weights are split into several files with an index, as HF does.
    ``token_ids``: ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` entries for config.json (the model
    config holds only the architecture; generation stops at ``eos_token_id``).
    """
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    tensors = {}
    for key, variable in _flat(params):
        value = np.asarray(jax.device_get(variable.value))
        for index, hf_key, transform in hf_slots(config, key, value.shape):
            tensors[hf_key] = transform.to_hf(value[index])
    shards: list[dict[str, np.ndarray]] = [{}]
    for name, value in tensors.items():
        if (
            max_shard_bytes
            and shards[-1]
            and sum(v.nbytes for v in shards[-1].values()) + value.nbytes > max_shard_bytes
        ):
            shards.append({})
        shards[-1][name] = value
    if len(shards) == 1:
        write_safetensors(os.path.join(out_dir, "model.safetensors"), shards[0])
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(os.path.join(out_dir, filename), shard)
            weight_map.update(dict.fromkeys(shard, filename))
        total = sum(v.nbytes for v in tensors.values())
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    hf_config = config.to_hf()
    for key, value in (token_ids or {}).items():
        if not key.endswith("_token_id"):
            raise ValueError(f"save_hf token_ids takes *_token_id entries, got {key!r}")
        hf_config[key] = value
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)


# ------------------------------------------------------------------------------- orbax and the CLI
_CONFIG_FILE = "model_config.json"
# What of a HF directory besides its weights and architecture an imported checkpoint keeps (under HF_FILES_DIR)
# and its export writes back: the tokenizer, the generation defaults, and config.json's token ids.
HF_FILES_DIR = "hf_files"
HF_SIDE_FILES = (*TOKENIZER_FILES, "generation_config.json")
_TOKEN_IDS_FILE = "token_ids.json"
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _hf_config(hf_dir: str | os.PathLike) -> dict[str, Any]:
    """A HF directory's parsed config.json (local or ``gs://``)."""
    return json.loads(ranged.read_bytes(f"{os.fspath(hf_dir).rstrip('/')}/config.json"))


def hf_token_ids(hf_dir: str | os.PathLike) -> dict[str, Any]:
    """The bos/eos/pad token ids a HF directory's config.json names (an id or a list of ids each; unset ones left
    out)."""
    hf_config = _hf_config(hf_dir)
    return {key: hf_config[key] for key in TOKEN_ID_KEYS if hf_config.get(key) is not None}


def save_orbax(
    config: ModelConfig, params: nnx.State, ckpt_dir: str | os.PathLike, hf_dir: str | os.PathLike | None = None
) -> None:
    """Writes params as an orbax checkpoint plus ``model_config.json`` beside it; with ``hf_dir`` (the HF directory
    the params came from), also its token ids and the files of ``HF_SIDE_FILES`` it has, under ``hf_files/``."""

    ckpt_dir = os.path.abspath(os.fspath(ckpt_dir))
    os.makedirs(ckpt_dir, exist_ok=True)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.join(ckpt_dir, "params"), nnx.to_pure_dict(params), force=True)
    with open(os.path.join(ckpt_dir, _CONFIG_FILE), "w") as f:
        json.dump(config_to_dict(config), f, indent=2)
    if hf_dir is None:
        return
    side = os.path.join(ckpt_dir, HF_FILES_DIR)
    os.makedirs(side, exist_ok=True)
    with open(os.path.join(side, _TOKEN_IDS_FILE), "w") as f:
        json.dump(hf_token_ids(hf_dir), f, indent=2)
    for name in HF_SIDE_FILES:
        if os.path.isfile(os.path.join(hf_dir, name)):
            shutil.copyfile(os.path.join(hf_dir, name), os.path.join(side, name))


def import_hf(hf_dir: str | os.PathLike, ckpt_dir: str | os.PathLike) -> None:
    """``python -m trace_jax.hf import``: a HF directory -> an orbax checkpoint that keeps its token ids, tokenizer
    files and generation config (``save_orbax`` with ``hf_dir``)."""
    config, params = load_hf(hf_dir)
    save_orbax(config, params, ckpt_dir, hf_dir=hf_dir)


def export_orbax(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, max_shard_bytes: int = 0) -> None:
    """``python -m trace_jax.hf export --ckpt``: the checkpoint as a HF directory, with the token ids in config.json
    and the tokenizer / generation files that ``import`` kept (a checkpoint ``save_orbax`` wrote without a HF
    directory has none: only weights and architecture)."""
    config, params = load_orbax(ckpt_dir)
    side = os.path.join(os.path.abspath(os.fspath(ckpt_dir)), HF_FILES_DIR)
    token_ids = {}
    if os.path.isfile(os.path.join(side, _TOKEN_IDS_FILE)):
        with open(os.path.join(side, _TOKEN_IDS_FILE)) as f:
            token_ids = json.load(f)
    save_hf(config, params, out_dir, max_shard_bytes, token_ids=token_ids)
    for name in HF_SIDE_FILES:
        if os.path.isfile(os.path.join(side, name)):
            shutil.copyfile(os.path.join(side, name), os.path.join(os.fspath(out_dir), name))


def load_orbax(ckpt_dir: str | os.PathLike, mesh: Mesh | None = None) -> tuple[ModelConfig, nnx.State]:
    """Reads what ``save_orbax`` wrote, restoring straight into the mesh shardings when one is given."""

    ckpt_dir = os.path.abspath(os.fspath(ckpt_dir))
    config_path = os.path.join(ckpt_dir, _CONFIG_FILE)
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{ckpt_dir} is not a trace_jax model checkpoint ({_CONFIG_FILE} missing)")
    with open(config_path) as f:
        config = config_from_dict(json.load(f))
    target = abstract_model(config)[1]
    if mesh is not None:
        shardings = mesh_lib.state_shardings(target, mesh)
        target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), target, shardings)
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(os.path.join(ckpt_dir, "params"), nnx.to_pure_dict(target))
    nnx.replace_by_pure_dict(target, restored)
    return config, target
