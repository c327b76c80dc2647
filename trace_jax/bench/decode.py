"""Decode benchmark: our engine against transformers ``generate`` and a bare jit loop on the same weights, plus
tree-vs-flat cost.

``python -m trace_jax.bench.decode [--quick] [--out bench_results/decode.json]`` prints JSON (also written to
``--out``) and a markdown table.

Part 1, throughput. For each model (``qwen3-tiny``: 2 layers, hidden 64, vocab 512; ``qwen3-20m``), batch and
number of new tokens, both sides decode the same random prompts (lengths 8..32) greedily with the same weights
(ours saved with ``save_hf`` and loaded by ``transformers``), end to end from host token ids to host token
ids: ours = one ``insert`` of all prompts + one ``generate``; transformers = batched left-padded
``generate``; the bare loop = one jit'd prefill + ``fori_loop`` of argmax steps (no slots, stops or
log-probs: the floor to beat on a CPU). Each side runs once to warm up (our first call, compile included, is
reported separately), then ``--repeats`` times (at most 3 for the 20M model), alternating the sides so that
load from other processes hits all alike; the best time gives tokens/s (batch x new tokens / time), and
``speedup_of_medians`` is reported too. ``greedy_match`` is the share of rows whose tokens agree exactly.
``compilations`` counts the programs our engine traced for the whole row. transformers runs with
``--torch-threads`` (default 1: on a loaded 2-core machine, 2 OpenMP threads ran 10-30x slower).

Part 2, tree rollouts. The runner samples trees on the toy environment with the tiny model (stage 1: m
rollouts per prompt; stage 2: k continuations from a few turn prefixes per tree) and reports the forward
tokens it pushed through the model against regenerating every leaf flat from its prompt (each leaf's whole
history prefilled and decoded on its own).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax.bench.report import machine
from trace_jax.checkpoint.hf import save_hf
from trace_jax.models import KVCache, ModelConfig, abstract_model, create_model, num_params
from trace_jax.rollout.backend import ContinuationRequest, RolloutStats
from trace_jax.rollout.engine.engine import Engine, EngineConfig
from trace_jax.rollout.engine.mock import ToyEnv
from trace_jax.rollout.engine.sampling import SamplingConfig
from trace_jax.rollout.runner import RolloutRunner, RunnerConfig
from trace_jax.rollout.tree import ROOT, RolloutTree


def _prompts(rng: np.random.Generator, batch: int, vocab: int) -> list[list[int]]:
    return [rng.integers(1, vocab, rng.integers(8, 33)).tolist() for _ in range(batch)]


def _interleaved(fns: dict[str, Any], repeats: int) -> dict[str, tuple[list[float], Any]]:
    """Runs each callable ``repeats`` times, alternating between them so load changes hit both alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    results: dict[str, Any] = {}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            results[name] = fn()
            times[name].append(time.perf_counter() - start)
    return {name: (times[name], results[name]) for name in fns}


class Ours:
    """Our engine, sized for one (batch, new tokens) setting: one ``insert`` of all prompts + one ``generate``."""

    def __init__(self, config: ModelConfig, params: nnx.State, batch: int, new_tokens: int):
        self.engine = Engine.for_model(
            config,
            EngineConfig(
                max_slots=batch,
                max_len=32 + new_tokens,
                steps_per_call=new_tokens,
                max_turn_tokens=new_tokens,
                length_buckets=(32, 32 + new_tokens),
                row_buckets=(batch,),
                sampling=SamplingConfig.make_greedy(),
                weight_dtype=None,  # the same fp32 weights transformers runs
            ),
        )
        self.engine.set_params(params)
        self.state = self.engine.init_decode_state()  # slots persist across calls, as in a serving loop

    def __call__(self, prompts: list[list[int]]) -> np.ndarray:
        engine, n = self.engine, len(prompts)
        self.state, _ = engine.insert(None, self.state, prompts, list(range(n)), [0] * n)
        self.state, out = engine.generate(None, self.state)
        self.state = engine.free_resource(self.state, range(n))
        return out.tokens[:n]


class BareLoop:
    """The floor: one jit'd function, prefill then a ``fori_loop`` of greedy steps on a contiguous cache, no
    slots, stops, log-probs or host bookkeeping. Same model code, same weights."""

    def __init__(self, config: ModelConfig, params: nnx.State, batch: int, new_tokens: int, width: int = 32):
        graphdef = abstract_model(config)[0]
        self.params, self.width = params, width

        def run(params, tokens_bt, lengths_b):
            model = nnx.merge(graphdef, params)
            cache = KVCache.init(config, batch=batch, max_len=width + new_tokens)
            hidden_btd, cache = model.hidden(tokens_bt, cache, lengths_b)
            first_b = jnp.argmax(model.logits(hidden_btd[jnp.arange(batch), lengths_b - 1]), -1).astype(jnp.int32)

            def step(i, carry):
                cache, token_b, out_bn = carry
                out_bn = out_bn.at[:, i].set(token_b)
                hidden_b1d, cache = model.hidden(token_b[:, None], cache)
                return cache, jnp.argmax(model.logits(hidden_b1d[:, 0]), -1).astype(jnp.int32), out_bn

            out = jnp.zeros((batch, new_tokens), jnp.int32)
            return jax.lax.fori_loop(0, new_tokens, step, (cache, first_b, out))[2]

        self._run = jax.jit(run)

    def __call__(self, prompts: list[list[int]]) -> np.ndarray:
        tokens = np.zeros((len(prompts), self.width), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
        lengths = np.asarray([len(p) for p in prompts], np.int32)
        return np.asarray(self._run(self.params, tokens, lengths))


class Transformers:
    """transformers ``generate`` (torch, CPU), greedy, left padding."""

    def __init__(self, hf_dir: str):
        # The transformers reference only: torch is not a dependency of the package.
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()

    def __call__(self, prompts: list[list[int]], new_tokens: int) -> np.ndarray:
        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
        return out[:, width:].numpy()


def throughput_rows(preset: str, batches, lengths, repeats: int, seed: int = 0) -> list[dict[str, Any]]:

    config = ModelConfig.preset(preset)
    params = nnx.split(create_model(config, nnx.Rngs(seed)), nnx.Param)[1]
    rows = []
    with tempfile.TemporaryDirectory() as hf_dir:
        save_hf(config, params, hf_dir)
        reference = Transformers(hf_dir)
        rng = np.random.default_rng(seed)
        for batch in batches:
            for new_tokens in lengths:
                prompts = _prompts(rng, batch, config.vocab_size)
                ours = Ours(config, params, batch, new_tokens)
                bare = BareLoop(config, params, batch, new_tokens)
                start = time.perf_counter()
                ours(prompts)
                compile_s = time.perf_counter() - start
                reference(prompts, new_tokens)  # warm-up
                bare(prompts)
                timed = _interleaved(
                    {
                        "ours": lambda o=ours, p=prompts: o(p),
                        "hf": lambda p=prompts, n=new_tokens: reference(p, n),
                        "bare": lambda b=bare, p=prompts: b(p),
                    },
                    repeats,
                )
                (ours_times, our_tokens), (hf_times, hf_tokens) = timed["ours"], timed["hf"]
                bare_times, bare_tokens = timed["bare"]
                tokens = batch * new_tokens
                rows.append(
                    {
                        "model": preset,
                        "params_m": round(num_params(config) / 1e6, 2),
                        "batch": batch,
                        "new_tokens": new_tokens,
                        "ours_tokens_per_s": round(tokens / min(ours_times)),
                        "transformers_tokens_per_s": round(tokens / min(hf_times)),
                        "bare_loop_tokens_per_s": round(tokens / min(bare_times)),
                        "speedup": round(min(hf_times) / min(ours_times), 2),
                        "vs_bare_loop": round(min(bare_times) / min(ours_times), 2),
                        "speedup_of_medians": round(statistics.median(hf_times) / statistics.median(ours_times), 2),
                        "ours_s": [round(t, 4) for t in ours_times],
                        "transformers_s": [round(t, 4) for t in hf_times],
                        "ours_first_call_s": round(compile_s, 2),
                        "greedy_match": float(
                            np.mean([(a == b).all() for a, b in zip(our_tokens, hf_tokens, strict=True)])
                        ),
                        "bare_loop_greedy_match": float(
                            np.mean([(a == b).all() for a, b in zip(our_tokens, bare_tokens, strict=True)])
                        ),
                        "compilations": dict(ours.engine.compilations),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    return rows


def tree_vs_flat(prompts: int, roots_k: int, anchors_per_tree: int, fork_k: int, seed: int = 0) -> dict[str, Any]:
    """Forward tokens of a two-stage tree rollout against regenerating each of its leaves flat."""
    config = ModelConfig.preset("qwen3-tiny")
    params = nnx.split(create_model(config, nnx.Rngs(seed)), nnx.Param)[1]
    engine_config = EngineConfig(
        max_slots=16, max_len=256, steps_per_call=32, max_turn_tokens=24, length_buckets=(64, 256), row_buckets=(16,)
    )
    engine = Engine.for_model(config, engine_config)
    env = ToyEnv(max_turns=3, truncation_ends=False)
    runner = RolloutRunner(engine, params, env, RunnerConfig(seed=seed))
    rng = np.random.default_rng(seed)
    trees = [
        RolloutTree(env.prompt_ids(t).tolist() + rng.integers(8, 512, 40).tolist(), task=t) for t in range(prompts)
    ]
    start = time.perf_counter()
    stats = runner.continue_anchors([ContinuationRequest(t, ROOT, roots_k) for t in trees])
    requests = []
    for tree in trees:
        inner = [n.node_id for n in tree if not n.is_leaf and n.parent is not None]
        for node_id in rng.choice(inner, size=min(anchors_per_tree, len(inner)), replace=False):
            requests.append(ContinuationRequest(tree, int(node_id), fork_k))
    stats += runner.continue_anchors(requests) if requests else RolloutStats()
    wall_s = time.perf_counter() - start
    flat = sum(tree.prefix_length(leaf) for tree in trees for leaf in tree.leaves())
    return {
        "prompts": prompts,
        "stage1_rollouts_per_prompt": roots_k,
        "stage2_anchors_per_tree": anchors_per_tree,
        "stage2_continuations_per_anchor": fork_k,
        "leaves": sum(len(t.leaves()) for t in trees),
        "generated_tokens": stats.generated_tokens,
        "tree_forward_tokens": stats.forward_tokens,
        "flat_forward_tokens": int(flat),
        "flat_over_tree": round(flat / stats.forward_tokens, 2),
        "runner_wall_s_incl_compile": round(wall_s, 2),
        "compilations": dict(engine.compilations),
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    head = (
        "| model | params | batch | new tokens | ours tok/s | transformers tok/s | bare loop tok/s | vs transformers "
        "| vs bare loop | greedy match |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['params_m']}M | {r['batch']} | {r['new_tokens']} | {r['ours_tokens_per_s']:,} | "
            f"{r['transformers_tokens_per_s']:,} | {r['bare_loop_tokens_per_s']:,} | {r['speedup']}x | "
            f"{r['vs_bare_loop']}x | {r['greedy_match']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, batch 16 x 64 tokens only")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench_results/decode.json")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads for transformers (on a loaded 2-core machine 2 threads ran 10-30x slower)",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("--repeats must be positive")
    import torch  # the transformers reference only: not a dependency of the package

    torch.set_num_threads(args.torch_threads)
    start = time.perf_counter()
    rows = throughput_rows(
        "qwen3-tiny", [16] if args.quick else [16, 64], [64] if args.quick else [64, 128], args.repeats
    )
    if not args.quick:
        rows += throughput_rows("qwen3-20m", [16, 64], [64, 128], min(args.repeats, 3))
    tree = tree_vs_flat(prompts=8, roots_k=4, anchors_per_tree=2, fork_k=4)
    result = {
        "throughput": rows,
        "tree_vs_flat": tree,
        "machine": machine(torch_threads=torch.get_num_threads()),
        "bench_wall_s": round(time.perf_counter() - start, 1),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    print(markdown(rows))


if __name__ == "__main__":
    main()
