"""Tokenizers: a byte-level BPE with atomic ReAct tags, saved as a directory AutoTokenizer loads."""

import pytest
from transformers import AutoTokenizer

from tests.gcs_emulator import gcs_emulator
from trace_jax import paths
from trace_jax.data import tokenizer as T
from trace_jax.data.synthetic import SyntheticWorld, WorldConfig
from trace_jax.envs.react import TAGS


@pytest.fixture(scope="module")
def world():
    return SyntheticWorld(WorldConfig(scale=2, questions_per_hop=40, ood_questions=10))


@pytest.fixture(scope="module")
def saved(world, tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    return directory, T.train_world_tokenizer(world, directory, vocab_size=600)


def test_tags_eos_and_pad_are_single_tokens(saved):
    _, tok = saved
    ids = [tok.encode(t, add_special_tokens=False) for t in TAGS]
    assert all(len(i) == 1 for i in ids)
    assert len({i[0] for i in ids}) == len(TAGS)
    assert tok.eos_token == T.EOS and tok.pad_token == T.PAD and tok.eos_token_id != tok.pad_token_id
    assert len(tok) <= 600
    # A tag glued to text is still its own token: the stop id appears in a sampled turn.
    stop = tok.convert_tokens_to_ids("</search>")
    assert stop in tok.encode("<search>Zorvak</search>", add_special_tokens=False)


def test_saved_directory_loads_with_auto_tokenizer_and_round_trips(saved, world):
    directory, tok = saved
    auto = AutoTokenizer.from_pretrained(str(directory))
    for text in list(T.world_texts(world))[:300]:
        ids = tok.encode(text, add_special_tokens=False)
        assert auto.encode(text, add_special_tokens=False) == ids
        assert tok.decode(ids) == text
    # The BPE learned the world: a passage takes far fewer tokens than it has bytes.
    passage = world.corpus[0]["text"]
    assert len(tok.encode(passage, add_special_tokens=False)) < len(passage.encode()) / 2


def test_load_tokenizer_errors_clearly_on_a_wrong_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a HF tokenizer directory"):
        T.load_tokenizer(tmp_path)


def test_a_tokenizer_in_a_bucket_loads_from_a_local_copy_of_its_files(saved):
    directory, tok = saved
    (directory / "model.safetensors").write_bytes(b"weights are never fetched")
    with gcs_emulator("bucket") as gcs:
        paths.copy_tree(directory, gcs.gs("tok"))
        remote = T.load_tokenizer(gcs.gs("tok"))
        local = T.local_tokenizer_dir(gcs.gs("tok"))
    assert local.is_dir() and not (local / "model.safetensors").exists()
    assert (local / "tokenizer.json").read_bytes() == (directory / "tokenizer.json").read_bytes()
    text = "<search>Zorvak</search>"
    assert remote.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
