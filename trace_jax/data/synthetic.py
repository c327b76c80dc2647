"""A synthetic multi-hop world: made-up entities, relations, passages and k-hop questions with gold traces.

Small enough for a tiny policy to learn on CPU, structured like the multi-hop QA of the TRACE paper:

* typed entities (film, person, company, city, country) with made-up names and functional relations
  (a film has one director, a person one birthplace...);
* one short passage per entity stating its facts, plus *distractor* passages that mention an entity
  next to a wrong candidate of the answer's type (an entity may have 0, 1 or 2 of them: harder lookups);
* questions made by composing relations ("What is the birthplace of the director of Zorvak?"), with 1 to
  ``max_hops`` hops for ``train`` / ``test`` (disjoint questions) and ``ood_hops`` hops for ``ood``;
* gold ReAct turns: one search per hop for the entity the chain has reached, then the answer.

A realistic-difficulty pool (the U-shaped success distribution of real RLVR pools) is built from options
that are all off by default: ``hop_weights`` (a 1..``max_hops`` mixture), ``distractor_style="lookalike"``
with a longer ``distractor_probs`` (distractor-dense passages), ``buried_questions`` (questions whose first
lookup the retriever cannot answer: the start entity's passage is out-ranked by ``bury_passages``
look-alikes stating a wrong fact) and ``trivial_questions`` (the question ends with its answer). Every
row carries its ``kind`` (:data:`KINDS`), and ``questions("train:chain,trivial")`` reads a split's rows of some
kinds only (a warm start that must not learn buried questions' answers: ``config.sft.split``).

Everything is a pure function of :class:`WorldConfig` (seeded ``numpy`` generator, no set iteration),
so the same seed gives a byte-identical world. Questions are Search-R1-style rows (``question``,
``golden_answers``, ``data_source``) with extra fields ``id``, ``hops``, ``chain`` and ``gold_turns``.

Write a world's corpus as jsonl (``{"id", "title", "text"}`` rows, e.g. for
``python -m trace_jax.envs.retrieval serve --corpus``)::

    python -m trace_jax.data.synthetic corpus --out world.jsonl                                  # the defaults
    python -m trace_jax.data.synthetic corpus --world '{"scale": 10}' --out world.jsonl          # WorldConfig fields
    python -m trace_jax.data.synthetic corpus --world runs/x/config.json --out world.jsonl       # a run's world
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from trace_jax.config_utils import documented, from_config

DATA_SOURCE = "synthetic"
SPLITS = ("train", "test", "ood")
KINDS = ("chain", "buried", "trivial")  # a question row's ``kind``

# entity type -> how many of them per unit of ``WorldConfig.scale``.
ENTITY_COUNTS = {"film": 6, "person": 10, "company": 4, "city": 6, "country": 2}

# relation -> (subject type, object type, phrase used in passages, questions and thoughts).
RELATIONS = {
    "director": ("film", "person", "director"),
    "studio": ("film", "company", "studio"),
    "birthplace": ("person", "city", "birthplace"),
    "employer": ("person", "company", "employer"),
    "headquarters": ("company", "city", "headquarters"),
    "founder": ("company", "person", "founder"),
    "country": ("city", "country", "country"),
    "capital": ("country", "city", "capital"),
}


def _rumour(title: str, entity: str, phrase: str, decoy: str) -> str:
    return f"{title} is a rumour: {entity} met {decoy}."


def _lookalike(title: str, entity: str, phrase: str, decoy: str) -> str:
    return f"{title}: rumour about {entity}: its {phrase} is {decoy}."


# distractor_style -> text(title, entity name, relation phrase, decoy name) of a distractor passage.
DISTRACTOR_STYLES = {"rumour": _rumour, "lookalike": _lookalike}

_CONSONANTS = list("bdfgklmnprstvz")
_VOWELS = list("aeiou")


def split_kinds(split: str) -> tuple[str, tuple[str, ...]]:
    """``"test:chain,trivial"`` -> ``("test", ("chain", "trivial"))``; ``"test"`` -> ``("test", ())``. Raises
    ``ValueError`` for a kind not in :data:`KINDS`."""
    name, colon, kinds = split.partition(":")
    wanted = tuple(kinds.split(",")) if colon else ()
    if set(wanted) - set(KINDS):
        raise ValueError(f"unknown question kind in {split!r}; kinds are {list(KINDS)}")
    return name, wanted


@dataclasses.dataclass(frozen=True)
class WorldConfig:
    """Everything that defines a world. The defaults give ~280 entities and ~1.2k questions."""

    seed: int = documented(
        0,
        "seeds every random draw of the world: its entities' names, facts, distractors and questions.",
    )
    scale: int = documented(10, "entity counts are ``ENTITY_COUNTS[type] * scale``.")
    distractor_probs: tuple[float, float, float] = documented(
        (0.5, 0.3, 0.2),
        "probability that an entity gets 0, 1, 2, ... distractor passages (any length >= 1).",
    )
    max_hops: int = documented(3, "train / test questions have 1..max_hops hops; ``ood`` has ``ood_hops`` hops.")
    ood_hops: int = documented(4, "train / test questions have 1..max_hops hops; ``ood`` has ``ood_hops`` hops.")
    questions_per_hop: int = documented(
        400,
        "at most this many questions per hop count (1-hop takes every fact up to this).",
    )
    ood_questions: int = documented(200, "at most this many ``ood`` (out-of-distribution, ``ood_hops``-hop) questions.")
    test_fraction: float = documented(0.15, "share of each hop count's questions held out for ``test``.")
    relabel_seed: int | None = documented(
        None,
        "when set, the names are shuffled among the entities of each type (same structure, same questions by position, "
        'different facts by name): a "practice world" whose facts cannot be recalled from the original, only read from '
        "its passages.",
    )
    distractor_style: str = documented(
        "rumour",
        'how a distractor reads (:data:`DISTRACTOR_STYLES`): ``rumour`` ("X is a rumour: E met D") or ``lookalike`` '
        '("Rumour about E: its <relation> is D", the relation phrase of a real fact with a wrong object, so it '
        "competes with E's passage for a query and misleads a reader).",
    )
    hop_weights: tuple[float, ...] = documented(
        (),
        "when set (length ``max_hops``), chain questions are ``questions_per_hop * max_hops`` in all, hop count h "
        "getting the share ``hop_weights[h-1] / sum(hop_weights)`` (at most; duplicates are dropped).",
    )
    buried_questions: int = documented(
        0,
        "at most this many extra train / test questions (1..max_hops hops, same mixture) whose start entity is "
        "*buried*: ``bury_passages`` look-alike passages (its name twice, one wrong fact) out-rank its own passage, so "
        "the first lookup is nearly impossible. Chain questions never touch a buried entity.",
    )
    buried_entity_fraction: float = documented(
        0.0,
        "share of entities that are buried (needed when ``buried_questions`` > 0).",
    )
    bury_passages: int = documented(
        4,
        "look-alike passages per buried entity (> the retriever's top-k to push the real one out).",
    )
    trivial_questions: int = documented(
        0,
        'at most this many extra train / test 0-search questions that end with their answer ("What is the studio of '
        "Zorvak? Hint: Kelmo.\"); the gold trace is the bare answer turn. The name is the prompt's last word, after a "
        'marker seen nowhere else, so the copy is one a tiny sampled policy makes reliably (stated first, "Zorvak has '
        'the studio Kelmo. What is ...?", it miscopied 6% of the time).',
    )

    def __post_init__(self):
        if self.scale < 1 or not 1 <= self.max_hops < self.ood_hops:
            raise ValueError(f"need scale >= 1 and 1 <= max_hops < ood_hops, got {self}")
        probs = self.distractor_probs
        if not probs or min(probs) < 0 or abs(sum(probs) - 1) > 1e-6:
            raise ValueError(f"distractor_probs must be probabilities summing to 1, got {probs}")
        if self.distractor_style not in DISTRACTOR_STYLES:
            raise ValueError(
                f"unknown distractor_style {self.distractor_style!r}; choose from {list(DISTRACTOR_STYLES)}"
            )
        if self.hop_weights and (
            len(self.hop_weights) != self.max_hops or min(self.hop_weights) < 0 or not sum(self.hop_weights)
        ):
            raise ValueError(
                f"hop_weights needs {self.max_hops} non-negative weights (not all 0), got {self.hop_weights}"
            )
        if min(self.buried_questions, self.trivial_questions, self.bury_passages) < 0:
            raise ValueError("buried_questions, trivial_questions and bury_passages must be >= 0")
        if self.buried_questions and not 0 < self.buried_entity_fraction < 1:
            raise ValueError(
                f"buried_questions needs 0 < buried_entity_fraction < 1, got {self.buried_entity_fraction}"
            )


@dataclasses.dataclass(frozen=True)
class Entity:
    name: str
    type: str
    facts: dict[str, str]  # relation -> object entity name


def question_text(start: str, relations: list[str]) -> str:
    """ "What is the <r_k> of the <r_k-1> of ... of <start>?" for the relation chain r_1..r_k."""
    phrases = [RELATIONS[r][2] for r in reversed(relations)]
    return "What is the " + " of the ".join(phrases) + f" of {start}?"


def gold_turns(chain: list[str], relations: list[str]) -> list[str]:
    """The gold ReAct turns for ``chain`` = [start, e_1, ..., e_k] reached by ``relations`` = [r_1..r_k].

    Turn t (1..k) thinks about the fact it needs and searches the entity the chain has reached; the last
    turn states the fact read in the final observation and answers. Each turn ends with its stop tag.
    """
    turns = []
    for hop, relation in enumerate(relations):
        thought = f"{RELATIONS[relation][2]} of {chain[hop]}"
        turns.append(f"<think> {thought}</think>\n<search> {chain[hop]}</search>")
    last = f"{RELATIONS[relations[-1]][2]} of {chain[-2]} is {chain[-1]}"
    turns.append(f"<think> {last}</think>\n<answer> {chain[-1]}</answer>")
    return turns


class SyntheticWorld:
    """The world built from a :class:`WorldConfig`.

    Attributes:
      entities: name -> Entity, in creation order.
      corpus: passages as dicts ``{"id", "title", "text"}`` (entity passages first, then distractors, then
        look-alikes of buried entities).
      buried: names of the buried entities, in creation order (empty unless ``buried_questions``).
      splits: split name -> list of question rows.
    """

    def __init__(self, config: WorldConfig = WorldConfig()):
        self.config = config
        rng = np.random.default_rng(config.seed)
        self.entities = _make_entities(config, rng)
        if config.relabel_seed is not None:
            # Its own generator, so the main stream (corpus, questions) is exactly the original world's.
            self.entities = _relabel(self.entities, np.random.default_rng(config.relabel_seed))
        self.corpus = _make_corpus(self.entities, config, rng)
        self.buried = _bury(self.entities, self.corpus, config, rng)
        self.splits = _make_questions(self.entities, config, rng, self.buried)

    # --------------------------------------------------------------------------------------- access
    def questions(self, split: str) -> list[dict[str, Any]]:
        """The rows of ``split``; ``"<split>:<kind>,<kind>..."`` keeps only rows of those kinds (in order), e.g.
        ``"train:chain,trivial"``: a warm start on it never sees a buried question's answer, which SFT would
        teach by heart (no lookup can find it)."""
        name, wanted = split_kinds(split)
        if name not in self.splits:
            raise ValueError(f"unknown split {name!r}; the synthetic world has {list(self.splits)}")
        if not wanted:
            return self.splits[name]
        return [q for q in self.splits[name] if q["kind"] in wanted]

    def texts(self) -> Iterator[str]:
        """Every text a tokenizer for this world should cover: passages, questions, gold turns."""
        for doc in self.corpus:
            yield f"{doc['title']} {doc['text']}"
        for rows in self.splits.values():
            for row in rows:
                yield row["question"]
                yield from row["gold_turns"]

    # --------------------------------------------------------------------------------- serialisation
    def save(self, directory: str | pathlib.Path) -> pathlib.Path:
        """Writes ``corpus.jsonl`` and ``<split>.jsonl`` (Search-R1 rows + extra fields) and ``config.json``."""
        out = pathlib.Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        _write_jsonl(out / "corpus.jsonl", self.corpus)
        for split, rows in self.splits.items():
            _write_jsonl(out / f"{split}.jsonl", rows)
        (out / "config.json").write_text(json.dumps(dataclasses.asdict(self.config), sort_keys=True) + "\n")
        return out


def _write_jsonl(path: pathlib.Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True, ensure_ascii=False) + "\n")


# ------------------------------------------------------------------------------------------- building
def _make_word(rng: np.random.Generator, syllables: int) -> str:
    parts = [str(rng.choice(_CONSONANTS)) + str(rng.choice(_VOWELS)) for _ in range(syllables)]
    if rng.random() < 0.5:
        parts.append(str(rng.choice(_CONSONANTS)))
    return "".join(parts).capitalize()


def _unique_names(rng: np.random.Generator, count: int, taken: set[str], make) -> list[str]:
    names = []
    while len(names) < count:
        name = make()
        if name not in taken:
            taken.add(name)
            names.append(name)
    return names


def _make_entities(config: WorldConfig, rng: np.random.Generator) -> dict[str, Entity]:
    taken: set[str] = set()
    # Persons share a small pool of family names: "Belmo Trask" and "Pim Trask" are natural near-misses.
    families = _unique_names(
        rng, max(2, ENTITY_COUNTS["person"] * config.scale // 3), taken, lambda: _make_word(rng, 2)
    )
    names_by_type: dict[str, list[str]] = {}
    for type_, per_scale in ENTITY_COUNTS.items():
        count = per_scale * config.scale
        if type_ == "person":
            make = lambda: f"{_make_word(rng, 2)} {families[rng.integers(len(families))]}"
        else:
            make = lambda: _make_word(rng, int(rng.integers(2, 4)))
        names_by_type[type_] = _unique_names(rng, count, taken, make)

    facts: dict[str, dict[str, str]] = {n: {} for names in names_by_type.values() for n in names}
    # Cities belong to countries and each country's capital is one of its own cities (a consistent world).
    countries = names_by_type["country"]
    for i, city in enumerate(names_by_type["city"]):
        facts[city]["country"] = countries[i % len(countries)]
    for j, country in enumerate(countries):
        facts[country]["capital"] = names_by_type["city"][j]
    for relation, (subject, obj, _) in RELATIONS.items():
        if relation in ("country", "capital"):
            continue
        for name in names_by_type[subject]:
            facts[name][relation] = names_by_type[obj][rng.integers(len(names_by_type[obj]))]
    return {n: Entity(n, t, facts[n]) for t, names in names_by_type.items() for n in names}


def _relabel(entities: dict[str, Entity], rng: np.random.Generator) -> dict[str, Entity]:
    """The same entities in the same order, names permuted within each type (facts follow the names)."""
    rename: dict[str, str] = {}
    for type_ in ENTITY_COUNTS:
        names = [n for n, e in entities.items() if e.type == type_]
        rename.update(zip(names, [names[i] for i in rng.permutation(len(names))], strict=True))
    return {
        rename[n]: Entity(rename[n], e.type, {r: rename[obj] for r, obj in e.facts.items()})
        for n, e in entities.items()
    }


def _entity_passage(entity: Entity) -> str:
    facts = "; ".join(f"{RELATIONS[r][2]} {obj}" for r, obj in entity.facts.items())
    return f"{entity.name} is a {entity.type}: {facts}."


def _make_corpus(entities: dict[str, Entity], config: WorldConfig, rng: np.random.Generator) -> list[dict[str, str]]:
    corpus = [{"id": f"e{i}", "title": e.name, "text": _entity_passage(e)} for i, e in enumerate(entities.values())]
    by_type: dict[str, list[str]] = {}
    for e in entities.values():
        by_type.setdefault(e.type, []).append(e.name)
    taken = set(entities)
    style = DISTRACTOR_STYLES[config.distractor_style]
    for e in entities.values():
        for _ in range(int(rng.choice(len(config.distractor_probs), p=config.distractor_probs))):
            # A wrong candidate of the type a question about ``e`` would ask for, next to e's name.
            relation = list(e.facts)[rng.integers(len(e.facts))]
            pool = by_type[RELATIONS[relation][1]]
            decoy = pool[rng.integers(len(pool))]
            title = _unique_names(rng, 1, taken, lambda: _make_word(rng, 3))[0]
            text = style(title, e.name, RELATIONS[relation][2], decoy)
            corpus.append({"id": f"d{len(corpus)}", "title": title, "text": text})
    return corpus


def _bury(
    entities: dict[str, Entity], corpus: list[dict[str, str]], config: WorldConfig, rng: np.random.Generator
) -> list[str]:
    """Picks the buried entities and appends their look-alike passages to ``corpus`` (nothing drawn when off).

    A look-alike has the entity's name as title and twice in a shorter text stating one wrong fact, so BM25
    ranks ``bury_passages`` of them above the entity's own passage.
    """
    if not config.buried_questions:
        return []
    names = list(entities)
    count = max(1, round(config.buried_entity_fraction * len(names)))
    buried = [names[i] for i in sorted(rng.choice(len(names), count, replace=False))]
    by_type: dict[str, list[str]] = {}
    for e in entities.values():
        by_type.setdefault(e.type, []).append(e.name)
    for name in buried:
        entity = entities[name]
        for _ in range(config.bury_passages):
            relation = list(entity.facts)[rng.integers(len(entity.facts))]
            wrong = [n for n in by_type[RELATIONS[relation][1]] if n != entity.facts[relation]]
            decoy = wrong[rng.integers(len(wrong))]
            text = f"{name} is a {entity.type}. {name}: {RELATIONS[relation][2]} {decoy}."
            corpus.append({"id": f"b{len(corpus)}", "title": name, "text": text})
    return buried


def _chains(
    entities: dict[str, Entity],
    hops: int,
    rng: np.random.Generator,
    limit: int,
    starts: list[str] | None = None,
    avoid: frozenset[str] = frozenset(),
) -> list[tuple]:
    """Up to ``limit`` distinct (start, relations, chain) of ``hops`` hops whose answer is not the start.

    Starts are drawn from ``starts`` (default: every entity); a chain that searches an entity of ``avoid``
    (any but its answer) is dropped.
    """
    names = list(entities) if starts is None else starts
    seen, out = set(), []
    attempts = 0
    while len(out) < limit and attempts < 50 * limit:
        attempts += 1
        start = names[rng.integers(len(names))]
        chain, relations = [start], []
        for _ in range(hops):
            options = list(entities[chain[-1]].facts)
            relation = options[rng.integers(len(options))]
            relations.append(relation)
            chain.append(entities[chain[-1]].facts[relation])
        key = (start, tuple(relations))
        if key in seen or chain[-1] in chain[:-1]:  # a loop back makes the question trivial
            continue
        if avoid and avoid.intersection(chain[:-1]):
            continue
        seen.add(key)
        out.append((start, relations, chain))
    return out


def _row(
    split: str, index: int, start: str, relations: list[str], chain: list[str], kind: str = "chain"
) -> dict[str, Any]:
    row = {
        "id": f"{split}-{index}",
        "question": question_text(start, relations),
        "golden_answers": [chain[-1]],
        "data_source": DATA_SOURCE,
        "hops": len(relations),
        "chain": chain,
        "relations": list(relations),
        "gold_turns": gold_turns(chain, relations),
        "kind": kind,
    }
    if kind == "trivial":  # the answer ends the question: no search, no thought, one copy of the last name
        question = f"{row['question']} Hint: {chain[-1]}."
        row.update(question=question, hops=0, gold_turns=[f"<answer> {chain[-1]}</answer>"])
    return row


def _hop_counts(config: WorldConfig, total: int) -> list[int]:
    """Questions per hop count 1..max_hops: ``total`` split by ``hop_weights`` (even split when unset)."""
    weights = np.asarray(config.hop_weights or (1.0,) * config.max_hops, float)
    return [round(float(total * w)) for w in weights / weights.sum()]


def _make_questions(
    entities: dict[str, Entity], config: WorldConfig, rng: np.random.Generator, buried: list[str]
) -> dict[str, list]:
    """Train / test rows (chain questions by hop count, then buried, then trivial ones) and ``ood`` rows."""
    train, test = [], []

    def split(chains: list[tuple], kind: str) -> None:
        held_out = rng.random(len(chains)) < config.test_fraction
        for chain, is_test in zip(chains, held_out, strict=True):
            (test if is_test else train).append((*chain, kind))

    avoid = frozenset(buried)
    per_hop = (
        _hop_counts(config, config.questions_per_hop * config.max_hops)
        if config.hop_weights
        else [config.questions_per_hop] * config.max_hops
    )
    for hops, limit in enumerate(per_hop, start=1):
        split(_chains(entities, hops, rng, limit, avoid=avoid), "chain")
    if config.buried_questions:
        for hops, limit in enumerate(_hop_counts(config, config.buried_questions), start=1):
            split(_chains(entities, hops, rng, limit, starts=buried), "buried")
    if config.trivial_questions:
        split(_chains(entities, 1, rng, config.trivial_questions, avoid=avoid), "trivial")
    ood = [(*c, "chain") for c in _chains(entities, config.ood_hops, rng, config.ood_questions, avoid=avoid)]
    return {
        name: [_row(name, i, *c) for i, c in enumerate(chains)]
        for name, chains in (("train", train), ("test", test), ("ood", ood))
    }


# ------------------------------------------------------------------------------------------ command line
def world_from_spec(spec: str) -> SyntheticWorld:
    """The world ``spec`` names: "" (the defaults), a JSON object of ``WorldConfig`` fields, or a JSON file
    holding such an object or a run's ``config.json`` (its ``world`` section)."""
    if spec and pathlib.Path(spec).is_file():
        spec = pathlib.Path(spec).read_text()
    try:
        fields = json.loads(spec) if spec.strip() else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"--world takes a JSON object of WorldConfig fields or a JSON file: {e}") from None
    if not isinstance(fields, dict):
        raise ValueError("--world takes a JSON object of WorldConfig fields or a JSON file")
    return SyntheticWorld(from_config(WorldConfig, fields.get("world", fields)))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trace_jax.data.synthetic")
    commands = parser.add_subparsers(dest="command", required=True)
    corpus = commands.add_parser("corpus", help="write a synthetic world's passages as jsonl")
    corpus.add_argument("--world", default="", help="WorldConfig fields as JSON, or a JSON file (a run's config.json)")
    corpus.add_argument("--out", required=True, help="the jsonl file to write")
    args = parser.parse_args(argv)
    try:
        world = world_from_spec(args.world)
    except (OSError, ValueError, TypeError) as e:
        corpus.error(str(e))
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(row) + "\n" for row in world.corpus))
    print(f"wrote {len(world.corpus)} passages to {out}")


if __name__ == "__main__":
    main()
