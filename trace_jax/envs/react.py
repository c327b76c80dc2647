"""The ReAct search environment (Search-R1 protocol): prompt rendering, turn parsing, observations, rewards.

A rollout is ``prompt, turn_1, obs_1, turn_2, obs_2, ..., turn_n``. The policy writes each turn and stops
at ``</search>`` or ``</answer>`` (or EOS). :class:`ReActEnv` judges one finished turn at a time:

* ``<search> q </search>`` at the end: a tool call; the observation is the top-k passages for ``q``
  wrapped as ``"\\n\\n<information>Doc 1 (Title: t) text\\n...</information>\\n\\n"``, with the passage
  part cut to ``max_observation_tokens``. Tags inside passages are removed so an observation never holds
  a stop token or a fake answer.
* ``<answer> a </answer>`` at the end: terminal; reward = the answer metric (EM by default) of ``a``
  against the gold answers (the last block of the turn counts; nothing in observations does).
* anything else (no closing action tag, an unclosed or empty action, a tag inside the action): terminal
  with ``info["format_error"] = True`` and ``format_error_reward`` (0 by default).
* a turn cut by the token limit (``truncated``) or a search at ``depth == max_turns``: terminal, reward 0.

Stop tags are matched on the text decoded from the turn's ids (``envs.stops``): a turn that does not end
with ``</search>`` / ``</answer>`` is read up to its first complete one, however the tokenizer split or
merged it.

Token-in/token-out: the environment decodes a turn's ids only to read it; it returns observation ids
tokenized once, and the history is never re-tokenized. :func:`render_trajectory` builds SFT examples
through the very same :meth:`ReActEnv.step` path the rollout uses.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from trace_jax.config_utils import documented
from trace_jax.envs import rewards
from trace_jax.envs.base import TurnResult
from trace_jax.envs.retrieval.retriever import Passage, RetrievalError, Retriever
from trace_jax.envs.stops import TextStops, first_stop_end, stop_id_sequences

log = logging.getLogger(__name__)

TAGS = ("<think>", "</think>", "<search>", "</search>", "<information>", "</information>", "<answer>", "</answer>")
STOP_TAGS = ("</search>", "</answer>")
_ANY_TAG = re.compile("|".join(re.escape(t) for t in TAGS))

# Prompt templates by name; a config may also pass its own format string with a ``{question}`` field.
TEMPLATES = {
    # The Search-R1 instructions, in our words: think, search, read the information, answer.
    "search_r1": (
        "Answer the question. Reason inside <think> and </think> every time you get new information. "
        "If some knowledge is missing, call the search engine with <search> query </search>; its top "
        "results come back between <information> and </information>. Search as often as you need. When "
        "nothing more is needed, give the answer inside <answer> and </answer> with no explanation, "
        "for example <answer> Paris </answer>. Question: {question}\n"
    ),
    "compact": "Use <search> to look up entities, then <answer>. Question: {question}\n",
}

OBSERVATION_OPEN = "\n\n<information>"
OBSERVATION_CLOSE = "</information>\n\n"
RETRIEVAL_FAILED_TEXT = "Search failed: the retriever did not answer. "


@dataclasses.dataclass(frozen=True)
class ReActConfig:
    """Knobs of the environment."""

    template: str = documented("search_r1", "a name in ``TEMPLATES`` or a format string with ``{question}``.")
    topk: int = documented(3, "passages per search.")
    max_turns: int = documented(5, "turns per rollout (the turn at this depth ends it).")
    max_observation_tokens: int = documented(
        128,
        "cap on the passage tokens of one observation (the wrapper tags come on top).",
    )
    metric: str = documented("em", 'answer metric name in ``rewards.METRICS`` ("em" or "f1").')
    format_error_reward: float = documented(0.0, "reward of a malformed turn (0.0; set e.g. -0.1 for a penalty).")
    chat_template: bool = documented(
        False,
        "wrap the instruction as one user message in the tokenizer's chat template (with the generation prompt), as "
        "instruction-tuned checkpoints (Qwen3, Qwen2.5-Instruct) expect. A task's own ``prompt`` messages are always "
        "rendered by the chat template, and ``template`` is not used for them; a tokenizer without one gives their raw "
        "content, joined by blank lines (with a warning, once).",
    )
    stop_variants: bool = documented(
        False,
        "stop on every id spelling of the stop tags that ``envs.stops.stop_id_sequences`` finds (tokenizers without "
        "atomic tags, e.g. Qwen's); False: only each tag's own encoding (the synthetic world's tokenizer keeps tags "
        "atomic). The engine's ``max_stop_sequences`` must hold them.",
    )
    max_stop_len: int = documented(
        8,
        "the longest stop id sequence kept with ``stop_variants`` (the engine's ``max_stop_len``).",
    )

    def __post_init__(self):
        if self.template not in TEMPLATES and "{question}" not in self.template:
            raise ValueError(
                f"ReActConfig.template={self.template!r} is neither a known template {sorted(TEMPLATES)} "
                "nor a format string with a {question} field"
            )
        rewards.get_metric(self.metric)
        if self.topk < 1 or self.max_turns < 1 or self.max_observation_tokens < 1:
            raise ValueError(f"topk, max_turns and max_observation_tokens must be >= 1 in {self}")

    @classmethod
    def preset(cls, name: str) -> ReActConfig:
        """Named settings: "search_r1" (the paper's) and "synthetic" (short prompt and observations, so a
        4-hop trajectory of the synthetic world fits in ~400 tokens)."""
        if name not in REACT_PRESETS:
            raise ValueError(f"unknown ReAct preset {name!r}; choose one of {sorted(REACT_PRESETS)}")
        return REACT_PRESETS[name]

    @property
    def template_text(self) -> str:
        return TEMPLATES.get(self.template, self.template)


REACT_PRESETS = {
    "search_r1": ReActConfig(),
    "synthetic": ReActConfig(template="compact", topk=3, max_turns=5, max_observation_tokens=64),
}


@dataclasses.dataclass(frozen=True)
class Action:
    """A parsed turn: ``kind`` is "search", "answer" or "malformed"; ``reason`` says why it is malformed."""

    kind: str
    content: str = ""
    reason: str = ""


def parse_turn(text: str) -> Action:
    """Reads the action that ends a turn's text (the turn stops right after its closing action tag)."""
    body = text.rstrip()
    for kind in ("search", "answer"):
        close = f"</{kind}>"
        if not body.endswith(close):
            continue
        start = body.rfind(f"<{kind}>")
        if start < 0:
            return Action("malformed", reason=f"{close} without <{kind}>")
        content = body[start + len(kind) + 2 : -len(close)]
        if _ANY_TAG.search(content):
            return Action("malformed", reason=f"a tag inside <{kind}>")
        if not content.strip():
            return Action("malformed", reason=f"empty <{kind}>")
        return Action(kind, content.strip())
    return Action("malformed", reason="the turn ends with no </search> or </answer>")


def format_passages(passages: Sequence[Passage]) -> str:
    """Search-R1's observation body: ``Doc i (Title: t) text`` per line, tags stripped from the passages."""
    lines = []
    for i, p in enumerate(passages, start=1):
        title, text = _ANY_TAG.sub("", p.title), _ANY_TAG.sub("", p.text)
        lines.append(f"Doc {i} (Title: {title}) {text}\n")
    return "".join(lines)


_MAX_CACHED_OBSERVATIONS = 4096  # encoded observation bodies kept (a few MB; least recently used dropped first)


def _task_field(task: Mapping[str, Any], key: str) -> Any:
    if key not in task:
        raise KeyError(f"task {dict(task)!r} has no {key!r}; tasks are rows with question and golden_answers")
    return task[key]


class ReActEnv:
    """Implements ``trace_jax.envs.base.AgentEnv`` for Search-R1-style multi-hop QA.

    Args:
      tokenizer: a HF tokenizer (``encode(text, add_special_tokens=False)``, ``decode``, ``eos_token_id``).
      retriever: anything with ``search(queries, topk) -> [[Passage]]`` (BM25Retriever, HttpRetriever).
      config: :class:`ReActConfig`.
    Tasks are mappings with ``golden_answers`` (a string or a list of strings) and ``question``; a task
    with ``prompt`` chat messages (Search-R1's parquet rows) is rendered from them instead.
    Attributes:
      retrieval_failures: searches answered with the failure observation (the run went on).
    """

    def __init__(self, tokenizer: Any, retriever: Retriever, config: ReActConfig = ReActConfig()):
        self.tokenizer = tokenizer
        self.retriever = retriever
        self.config = config
        self.max_turns = config.max_turns
        if config.stop_variants:
            self.stop_sequences = stop_id_sequences(tokenizer, STOP_TAGS, config.max_stop_len)
        else:
            self.stop_sequences = [self.encode(tag) for tag in STOP_TAGS]
        self.text_stops = TextStops(tokenizer, STOP_TAGS)  # the runner ends turns the id table missed
        if config.chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError("ReActConfig.chat_template=True but the tokenizer has no chat template; set it False")
        self._open_ids = self.encode(OBSERVATION_OPEN)
        self._close_ids = self.encode(OBSERVATION_CLOSE)
        # Text of EOS / pad, stripped before parsing (a turn may end with EOS instead of a stop tag).
        self._end_texts = [t for t in (tokenizer.eos_token, tokenizer.pad_token) if t]
        self.retrieval_failures = 0
        self._warned_raw_prompt = False  # prompt chat messages without a chat template: warned once
        # Observation body -> ids, remembered: the rollouts of a prompt repeat its searches.
        self._encode_observation = functools.lru_cache(maxsize=_MAX_CACHED_OBSERVATIONS)(self.encode)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    # ------------------------------------------------------------------------------------- AgentEnv
    def prompt_text(self, task: Mapping[str, Any]) -> str:
        """The prompt as text: a task's own ``prompt`` chat messages in the tokenizer's chat template (as
        Search-R1 renders its parquet rows), else ``question`` in ``config.template``."""
        if task.get("prompt"):
            return self._chat(task["prompt"], tokenize=False)
        text = self.config.template_text.format(question=str(_task_field(task, "question")).strip())
        if self.config.chat_template:
            messages = [{"role": "user", "content": text}]
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text

    def prompt_ids(self, task: Mapping[str, Any]) -> np.ndarray:
        """The prompt's ids: ``apply_chat_template(task["prompt"], add_generation_prompt=True)`` for a task
        with chat messages (their raw content when the tokenizer has no chat template, as :meth:`prompt_text`),
        else the ids of :meth:`prompt_text`."""
        if task.get("prompt"):
            return np.asarray(self._chat(task["prompt"], tokenize=True), np.int32)
        return np.asarray(self.encode(self.prompt_text(task)), np.int32)

    def _chat(self, messages: Sequence[Mapping[str, str]], tokenize: bool) -> Any:
        if not getattr(self.tokenizer, "chat_template", None):
            # As the question loader does for a row without a question: the messages' own text.
            if not self._warned_raw_prompt:
                self._warned_raw_prompt = True
                log.warning(
                    "tasks have prompt chat messages but the tokenizer has no chat template: each prompt is its "
                    "messages' raw content, joined by blank lines; use the checkpoint's own tokenizer "
                    "(model.tokenizer_dir) to render them as the model expects"
                )
            text = "\n\n".join(str(m["content"]) for m in messages)
            return self.encode(text) if tokenize else text
        messages = [dict(m) for m in messages]
        if not tokenize:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(
            self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        )

    def step(self, task: Mapping[str, Any], depth: int, turn_ids: np.ndarray, truncated: bool = False) -> TurnResult:
        text = self.tokenizer.decode(np.asarray(turn_ids).tolist(), skip_special_tokens=False)
        for end in self._end_texts:
            text = text.replace(end, "")
        if truncated:
            return self._finish(0.0, truncated=True, format_error=False)
        # A turn that does not end with a stop tag is read up to its first one, however the ids spelled
        # it: text merged into the tag's last token, or written after a spelling the engine missed.
        if not text.rstrip().endswith(STOP_TAGS) and (end := first_stop_end(text, STOP_TAGS)) is not None:
            text = text[:end]
        action = parse_turn(text)
        if action.kind == "malformed":
            return self._finish(self.config.format_error_reward, format_error=True, reason=action.reason)
        if action.kind == "answer":
            golds = _task_field(task, "golden_answers")
            score = rewards.get_metric(self.config.metric)(action.content, golds)
            return self._finish(score, format_error=False, action="answer", answer=action.content)
        if depth >= self.max_turns:
            return self._finish(0.0, format_error=False, action="search", query=action.content, out_of_turns=True)
        observation_ids, info = self._search(action.content)
        return TurnResult(observation_ids, done=False, reward=0.0, info=info)

    # -------------------------------------------------------------------------------------- helpers
    @staticmethod
    def _finish(reward: float, **info: Any) -> TurnResult:
        return TurnResult(np.zeros(0, np.int32), done=True, reward=float(reward), info=info)

    def _search(self, query: str) -> tuple[np.ndarray, dict[str, Any]]:
        info: dict[str, Any] = {"action": "search", "query": query, "format_error": False}
        try:
            (passages,) = self.retriever.search([query], self.config.topk)
            body = format_passages(passages)
            info["retrieval_failed"] = False
            info["passage_ids"] = [p.id for p in passages]
        except RetrievalError as e:  # a counted failure observation; the rollout goes on
            self.retrieval_failures += 1
            body = RETRIEVAL_FAILED_TEXT
            info["retrieval_failed"] = True
            info["retrieval_error"] = str(e)
        body_ids = self._encode_observation(body)  # shared with later calls: sliced below, never changed
        info["observation_truncated"] = len(body_ids) > self.config.max_observation_tokens
        body_ids = body_ids[: self.config.max_observation_tokens]
        return np.asarray(self._open_ids + body_ids + self._close_ids, np.int32), info


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """A rendered trajectory: int32 ``ids [T]``, float32 ``loss_mask [T]`` (1 on turn tokens), its reward."""

    ids: np.ndarray
    loss_mask: np.ndarray
    reward: float
    done: bool
    turns: int


def render_trajectory(env: ReActEnv, task: Mapping[str, Any], turns: Sequence[str]) -> Trajectory:
    """Token ids and loss mask of ``turns`` played in ``env`` exactly as a rollout would be.

    Prompt ids (mask 0), then per turn its ids (mask 1) and the observation the environment returns for
    it (mask 0). Stops at the first terminal turn.
    """
    ids = [env.prompt_ids(task)]
    mask = [np.zeros(ids[0].shape[0], np.float32)]
    result = TurnResult(np.zeros(0, np.int32), done=False)
    depth = 0
    for depth, turn in enumerate(turns, start=1):
        turn_ids = np.asarray(env.encode(turn), np.int32)
        result = env.step(task, depth, turn_ids)
        ids += [turn_ids, result.observation_ids]
        mask += [np.ones(turn_ids.shape[0], np.float32), np.zeros(result.observation_ids.shape[0], np.float32)]
        if result.done:
            break
    return Trajectory(np.concatenate(ids).astype(np.int32), np.concatenate(mask), result.reward, result.done, depth)
