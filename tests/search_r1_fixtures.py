"""Offline stand-ins for the real recipe's inputs: a tokenizer trained here, a tiny Qwen3 checkpoint saved by
transformers with that tokenizer beside it, Search-R1-format question files (``train.parquet`` with the chat
``prompt`` each row is trained on, ``test.jsonl`` with questions only, as Search-R1 ships ``train`` / ``test``)
and a corpus.

The tokenizer is a byte-level BPE like Qwen's: the ReAct tags are *not* atomic tokens (``</search>`` is
several ids, and merges with its neighbours), and it has Qwen's special tokens and a ChatML chat template.
"""

from __future__ import annotations

import itertools
import json
import pathlib
import random
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from trace_jax.envs.react import TEMPLATES

PLANTED_TURN = "<search> Quilon</search>\n"  # the turn the tiny checkpoint writes (a merged "</search>\n")
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CITIES = ("Quilon", "Marrow", "Tessaly", "Brink", "Oduna", "Pellam", "Varsk", "Holloway", "Zent", "Caldor")
COUNTRIES = ("Norvia", "Estmark", "Palora", "Quend", "Ruthen")
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SYLLABLES = ("ka", "lo", "mir", "tes", "vo", "ran", "del", "shu", "bri", "nox", "pa", "ell")
# The chat messages of the train rows: a system line and an instruction worded unlike envs.react.TEMPLATES.
SYSTEM_PROMPT = "You are a careful researcher."
USER_PROMPT = (
    "Find the answer. Think in <think> </think>, look things up with <search> query </search>, read what "
    "comes back in <information> </information>, then reply <answer> answer </answer>.\nQuestion: {question}"
)


def prompt_messages(question: str) -> list[dict[str, str]]:
    """A train row's ``prompt`` column: the chat messages Search-R1's parquet holds."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": USER_PROMPT.format(question=question)},
    ]


def _people(n: int, rng: random.Random) -> list[tuple[str, str]]:
    names = []
    while len(names) < n:
        name = "".join(rng.choice(SYLLABLES) for _ in range(3)).capitalize()
        if name not in names:
            names.append(name)
    return [(name, rng.choice(CITIES)) for name in names]


def world(num_people: int = 110, seed: int = 0) -> tuple[list[dict], list[dict], list[dict]]:
    """(train rows, test rows, corpus rows): one- and two-hop questions about people, their birthplaces and
    the cities' countries; questions in Search-R1's row formats (train: parquet-style ``prompt`` messages and
    ``reward_model`` golds; test: ``question`` and ``golden_answers``), corpus in Search-R1's ``contents``
    format."""
    rng = random.Random(seed)
    people = _people(num_people, rng)
    country = {city: COUNTRIES[i % len(COUNTRIES)] for i, city in enumerate(CITIES)}
    corpus = [{"id": str(i), "contents": f'"{n}"\n{n} was born in {c}.'} for i, (n, c) in enumerate(people)]
    corpus += [
        {"id": str(len(people) + i), "contents": f'"{c}"\n{c} is a city in {country[c]}.'} for i, c in enumerate(CITIES)
    ]
    questions = []
    for i, (name, city) in enumerate(people):
        questions.append((f"q{i}a", f"Where was {name} born?", [city], "nq"))
        questions.append((f"q{i}b", f"In which country was {name} born?", [country[city]], "hotpotqa"))
    test_ids = {f"q{i}{x}" for i in range(0, 12) for x in "ab"}
    train = [
        {
            "id": qid,
            "question": q,
            "prompt": prompt_messages(q),
            "data_source": src,
            "reward_model": {"ground_truth": {"target": golds}, "style": "rule"},
        }
        for qid, q, golds, src in questions
        if qid not in test_ids
    ]
    test = [
        {"id": qid, "question": q, "golden_answers": golds, "data_source": src}
        for qid, q, golds, src in questions
        if qid in test_ids
    ]
    return train, test, corpus


def train_tokenizer(texts: list[str], vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """A byte-level BPE with Qwen's special tokens (EOS ``<|im_end|>``, pad ``<|endoftext|>``) and a
    ChatML template; tags stay ordinary text."""
    tokenizer = Tokenizer(models.BPE())
    # Qwen2/Qwen3's pre-tokenizer: punctuation runs keep their trailing newlines (">\n\n" is one piece).
    split = pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated")
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )


def _tokenizer_texts(train: list[dict], corpus: list[dict]) -> list[str]:
    texts = [TEMPLATES["search_r1"].format(question=row["question"]) for row in train]
    texts += [row["contents"] for row in corpus]
    # Turns as a policy would write them, so BPE learns merges across tag boundaries (e.g. "h>\n").
    texts += [
        f"<think> who is {row['question'][:12]}</think>\n<search> {row['question']}</search>\n\n" for row in train
    ]
    texts += [f"<answer> {c}</answer>.\n" for c in CITIES + COUNTRIES]
    return texts


def plant_search_turn(model, tokenizer, turn: str = PLANTED_TURN, strength: float = 3.0):
    """Makes a random checkpoint write ``turn`` after the chat generation prompt (and after observations
    ending the same way), the way an instruction-tuned model calls the search tool, without training.

    Untied embedding / head surgery: each token on the chain (the prompt's last token, then ``turn``'s ids)
    gets its own basis direction in the embedding, and its successor's head row reads that direction, so
    the final hidden state (the embedding dominates the random blocks' small outputs) predicts the next
    chain token by a ~``strength * sqrt(hidden)`` logit margin. Attention and MLP keep their random
    weights and still shape every logit.
    """
    import torch

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "?"}], tokenize=False, add_generation_prompt=True
    )
    chain = [tokenizer.encode(prompt, add_special_tokens=False)[-1], *tokenizer.encode(turn, add_special_tokens=False)]
    assert len(set(chain)) == len(chain) <= model.config.hidden_size, chain
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    with torch.no_grad():
        for i, (token, successor) in enumerate(itertools.pairwise(chain)):
            embed[token, i] += 1.0
            head[successor, i] += strength
    return model


def write_all(
    root: str | pathlib.Path, seed: int = 0, family: str = "qwen3", **hf_fields: Any
) -> dict[str, pathlib.Path]:
    """Writes ``hf/`` (a tiny random Qwen3 that searches, :func:`plant_search_turn`, and the tokenizer),
    ``data/train.parquet`` + ``data/test.jsonl`` and
    ``corpus.jsonl`` under ``root``; returns their paths by name (``hf``, ``data``, ``corpus``).
    ``family`` and ``hf_fields`` go to :func:`write_checkpoint` (e.g. ``"qwen3_moe"`` for a mixture of experts)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = pathlib.Path(root)
    train, test, corpus = world(seed=seed)
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(train), data / "train.parquet")
    (data / "test.jsonl").write_text("".join(json.dumps(row) + "\n" for row in test))
    corpus_path = root / "corpus.jsonl"
    corpus_path.write_text("".join(json.dumps(row) + "\n" for row in corpus))
    tokenizer = train_tokenizer(_tokenizer_texts(train, corpus))
    hf = write_checkpoint(root / "hf", tokenizer, seed=seed, family=family, **hf_fields)
    return {"hf": hf, "data": data, "corpus": corpus_path, "tokenizer": hf}


def write_checkpoint(
    hf: str | pathlib.Path,
    tokenizer: PreTrainedTokenizerFast,
    turn: str = PLANTED_TURN,
    seed: int = 0,
    family: str = "qwen3",
    **hf_fields: Any,
) -> pathlib.Path:
    """Saves a tiny random Qwen3 (``family``: ``tests.helpers.build_hf_checkpoint``'s, with ``hf_fields``
    over the sizes here) that writes ``turn`` (:func:`plant_search_turn`) and ``tokenizer`` to ``hf``."""
    from tests.helpers import build_hf_checkpoint

    hf = pathlib.Path(hf)
    model = build_hf_checkpoint(
        hf,
        family,
        seed=seed,
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.pad_token_id,  # Qwen's config.json: bos and pad <|endoftext|>, eos <|im_end|>
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **hf_fields,
    )
    plant_search_turn(model, tokenizer, turn).save_pretrained(str(hf))
    tokenizer.save_pretrained(str(hf))
    return hf
