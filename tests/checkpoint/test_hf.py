"""The HF port: round trips through orbax and transformers, sharded files, and clear errors on bad input."""

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers import build_hf_checkpoint, read_safetensors
from trace_jax.checkpoint import hf
from trace_jax.checkpoint.hf import KEY_MAP, load_hf, write_safetensors
from trace_jax.job.cli import ExitCode
from trace_jax.job.commands import hf_main


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    build_hf_checkpoint(path, "qwen3", tie_word_embeddings=False)
    return path


@pytest.mark.parametrize("family,tied,shard", [("qwen3", False, 0), ("qwen2", True, 30_000)])
def test_import_export_reload_gives_identical_tensors(tmp_path, family, tied, shard):
    original = build_hf_checkpoint(tmp_path / "hf", family, tie_word_embeddings=tied)
    assert hf_main(["import", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == ExitCode.OK
    code = hf_main(
        ["export", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "back"), "--max-shard-bytes", str(shard)]
    )
    assert code == ExitCode.OK
    assert (tmp_path / "back" / "model.safetensors.index.json").exists() == bool(shard)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    want, got = original.state_dict(), reloaded.state_dict()
    assert want.keys() == got.keys()
    for name, tensor in want.items():
        assert torch.equal(tensor, got[name]), name


def test_key_map_reads_both_ways():
    for hf_template, ours_template, _ in KEY_MAP:
        fields = {"layer": "3", "expert": "5", "qkv": "k", "qk": "q", "mlp": "down"}
        hf_key, our_key = hf_template.format(**fields), ours_template.format(**fields)
        layer = 3 if "{layer}" in hf_template else None
        expert = 5 if "{expert}" in hf_template else None
        assert hf.ours_to_hf(our_key, layer, expert)[0] == hf_key
    # Per-layer HF tensors are rows of one stacked parameter of ours.
    assert hf.ours_to_hf("layers.mlp.up_proj", 11)[0] == "model.layers.11.mlp.up_proj.weight"
    assert hf.is_stacked("layers.mlp.up_proj") and not hf.is_stacked("embed")


def _rewrite_tensors(path, edit):
    tensors = {k: np.array(v) for k, v in read_safetensors(str(path / "model.safetensors")).items()}
    edit(tensors)
    write_safetensors(str(path / "model.safetensors"), tensors)


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_missing_tensor_is_named(qwen3_dir, tmp_path):
    path = _copy(qwen3_dir, tmp_path / "c")
    _rewrite_tensors(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: \['model.layers.1.mlp.up_proj.weight'\]"):
        load_hf(path)


def test_unexpected_tensor_is_named(qwen3_dir, tmp_path):
    path = _copy(qwen3_dir, tmp_path / "c")
    _rewrite_tensors(path, lambda t: t.update({"model.layers.0.self_attn.rotary.inv_freq": np.zeros(4, np.float32)}))
    with pytest.raises(ValueError, match=r"unexpected tensors.*rotary.inv_freq"):
        load_hf(path)


def test_misshaped_tensor_is_named(qwen3_dir, tmp_path):
    path = _copy(qwen3_dir, tmp_path / "c")
    _rewrite_tensors(path, lambda t: t.update({"model.norm.weight": np.ones(65, np.float32)}))
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(65,\), config.json implies \(64,\)"):
        load_hf(path)


def test_config_that_does_not_match_the_weights(qwen3_dir, tmp_path):
    path = _copy(qwen3_dir, tmp_path / "c")
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = 3
    config["intermediate_size"] = 80
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"does not match its config.json(.|\n)*layers.2(.|\n)*up_proj.weight has shape"
    ):
        load_hf(path)


def test_unsupported_architecture_says_so(qwen3_dir, tmp_path):
    path = _copy(qwen3_dir, tmp_path / "c")
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "qwen2_moe"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unsupported architecture model_type='qwen2_moe'; supported: .*qwen3_moe"):
        load_hf(path)


def test_missing_weights_and_missing_shard(qwen3_dir, tmp_path):
    path = _copy(qwen3_dir, tmp_path / "c")
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \.safetensors files"):
        load_hf(path)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00001.safetensors"}}))
    with pytest.raises(FileNotFoundError, match=r"model-00001\.safetensors, which is missing"):
        load_hf(path)


def test_export_of_an_unknown_checkpoint_dir_is_clear(tmp_path, capsys):
    code = hf_main(["export", "--ckpt", str(tmp_path), "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == ExitCode.MISSING_FILE and "Traceback" not in err
    assert err.startswith("error: ") and "not a trace_jax model checkpoint" in err


def _tiny_tokenizer(path, vocab_size):
    """A word-level tokenizer over ids 0..vocab_size-1, saved with ``save_pretrained`` (tokenizer.json and
    tokenizer_config.json): files the round trip must carry."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="w1", eos_token="w2", pad_token="w3")
    fast.save_pretrained(str(path))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_import_then_export_keeps_token_ids_generation_config_and_tokenizer_so_generate_stops_at_eos(tmp_path, family):
    """Catches a round trip that drops config.json's bos/eos/pad ids, generation_config.json or the tokenizer files
    (import -> export --ckpt wrote only weights and architecture: the exported model never stopped at EOS under
    transformers' ``generate``, it ran to ``max_new_tokens``)."""
    from transformers import GenerationConfig

    source = tmp_path / "hf"
    build_hf_checkpoint(source, family, tie_word_embeddings=False)
    prompt = torch.tensor([[5, 17, 11, 9]])  # no bos (1) or pad (3): transformers masks pad ids in a prompt
    free = GenerationConfig(do_sample=False, max_new_tokens=8, eos_token_id=None, pad_token_id=0)
    original = AutoModelForCausalLM.from_pretrained(source)
    greedy = original.generate(prompt, generation_config=free)[0, prompt.shape[1] :].tolist()
    # EOS: the latest of the first 6 greedy tokens that did not come before it: generation stops there, early.
    stop = max(i for i in range(6) if greedy[i] not in greedy[:i])
    ids = {"bos_token_id": 1, "eos_token_id": greedy[stop], "pad_token_id": 3}
    hf_config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**hf_config, **ids}, indent=2))
    GenerationConfig(do_sample=False, max_new_tokens=8, **ids).save_pretrained(str(source))
    _tiny_tokenizer(source, hf_config["vocab_size"])
    kept = ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    assert all((source / name).is_file() for name in kept)  # premise: the source has them

    assert hf_main(["import", "--hf-dir", str(source), "--out", str(tmp_path / "ckpt")]) == ExitCode.OK
    assert hf_main(["export", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "back")]) == ExitCode.OK
    back = tmp_path / "back"
    exported = json.loads((back / "config.json").read_text())
    assert {key: exported.get(key) for key in ids} == ids
    for name in kept:
        assert (back / name).read_bytes() == (source / name).read_bytes(), name

    want = AutoModelForCausalLM.from_pretrained(source).generate(prompt)[0, prompt.shape[1] :].tolist()
    got = AutoModelForCausalLM.from_pretrained(back).generate(prompt)[0, prompt.shape[1] :].tolist()
    assert want == greedy[: stop + 1] and len(want) < 8  # premise: the original stops at its EOS, before the cap
    assert got == want
