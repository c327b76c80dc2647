"""Where a compiled program's FLOPs and HBM bytes come from: each instruction's cost (``hlo.costs``, the counts
``hlo.summarize`` totals) grouped by the source line that made it and the pass it runs in.

    python -m trace_jax.plan.attribution HLO.txt.gz --devices 64 [--json OUT] [--top 25]

(the HLO text a plan writes with ``python -m trace_jax.plan ... --hlo-dir DIR``).

* source: the compiled text's stack frames (``FileNames`` / ``FunctionNames`` / ``FileLocations`` /
  ``StackFrames``, referenced by each instruction's ``stack_frame_id``): the innermost frame in this project,
  with its caller when the innermost is a helper many call sites share (``HELPERS``: ``token_matmul`` is every
  projection's); a Mosaic kernel by its name; a collective by its kind (its bytes are the exchange's, wherever
  the value is used). An instruction with no project frame is ``(no source)`` and its op_name's last part
  (or its op).
* pass: ``backward`` where jax's transpose made it (``transpose(`` in its op_name), ``recompute`` where it
  is a forward rematerialised inside the backward (``rematted_computation`` under a ``transpose(``, the
  name ``jax.checkpoint`` gives it), else ``forward``.
* part: a coarse name for the source, from ``PARTS`` (the first pattern that matches the source), so the
  table of a whole program fits on a page.

Per group: FLOPs and bytes per run, and their shares of the program's; the totals equal ``hlo.summarize``'s.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import json
import re
from typing import Any

from trace_jax.plan import hlo

PROJECT = "trace_jax/"
# Functions that many call sites share: the source names their caller too.
HELPERS = ("token_matmul", "as_bits", "under_mesh", "wrapped", "take_rows", "_take_rows_jvp", "<lambda>")
# (pattern on "source", part): the first match names the part.
PARTS: tuple[tuple[str, str], ...] = (
    (r"^kernel:tree_attention", "tree attention kernel"),
    (r"^kernel:", "other Mosaic kernels"),
    (r"^collective:", "collectives"),
    (r"logprobs\.py|losses\.py|Qwen\.logits", "LM head, log-probs, loss"),
    (r"Attention\._project|Attention\.__call__", "attention projections (q, k, v, o)"),
    (r"rope|RMSNorm", "norms and RoPE"),
    (r"MLP\.|moe\.py|expert_dispatch\.py", "MLP / experts"),
    (r"attention\.py", "attention (outside the kernel)"),
    (r"embed|Embed|take_rows", "embedding"),
    (r"trainer\.py|optim", "trainer"),
)

_FRAME_SECTIONS = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def stack_frames(text: str) -> dict[int, list[tuple[str, str, int]]]:
    """stack_frame_id -> its frames ``(file, function, line)``, innermost first, as the HLO text lists them
    (a frame's ``parent_frame_id`` is 1 + its caller's id; 0: none)."""
    sections: dict[str, dict[int, str]] = {}
    current = None
    for line in text.split("\n", 20000)[:20000]:
        stripped = line.strip()
        if stripped in _FRAME_SECTIONS:
            current = sections.setdefault(stripped, {})
            continue
        row = re.match(r"^(\d+)\s+(.*)$", stripped) if current is not None else None
        if row:
            current[int(row.group(1))] = row.group(2)
        elif stripped and current is not None:
            current = None
            if len(sections) == len(_FRAME_SECTIONS):
                break
    files = {k: v.strip('"') for k, v in sections.get("FileNames", {}).items()}
    functions = {k: v.strip('"') for k, v in sections.get("FunctionNames", {}).items()}
    number = lambda key, text: int(re.search(key + r"=(\d+)", text).group(1))
    locations = {
        k: (files.get(number("file_name_id", v), "?"), functions.get(number("function_name_id", v), "?"),
            number(r"\bline", v))
        for k, v in sections.get("FileLocations", {}).items()
    }  # fmt: skip
    raw = {
        k: (number("file_location_id", v), number("parent_frame_id", v))
        for k, v in sections.get("StackFrames", {}).items()
    }
    chains: dict[int, list[tuple[str, str, int]]] = {}
    for frame in raw:
        chain, seen, at = [], set(), frame
        while at in raw and at not in seen:
            seen.add(at)
            location, parent = raw[at]
            chain.append(locations.get(location, ("?", "?", 0)))
            at = parent - 1
        chains[frame] = chain
    return chains


def _source_of_frames(chain: list[tuple[str, str, int]], project: str) -> str:
    ours = [(f.split(project)[-1], fn, line) for f, fn, line in chain if project in f]
    if not ours:
        return "(no source)"
    named = [f"{fn} ({file}:{line})" for file, fn, line in ours]
    inner = ours[0][1].split(".<locals>.")[-1]
    return " < ".join(named[:2]) if inner in HELPERS and len(named) > 1 else named[0]


def source(ins: hlo.Instruction, chains: dict[int, list[tuple[str, str, int]]], project: str = PROJECT) -> str:
    """What made ``ins``: a Mosaic kernel's name, a collective's kind, else its stack frames' line in the files
    whose path holds ``project``."""
    if ins.op == "custom-call" and "tpu_custom_call" in ins.attrs:
        return "kernel:" + next(iter(hlo.kernel_names(ins.attrs)), "tpu_custom_call")
    kind = ins.op.removesuffix("-start")
    if kind in hlo.COLLECTIVES:
        return "collective:" + kind
    frame = re.search(r"stack_frame_id=(\d+)", ins.attrs)
    found = _source_of_frames(chains.get(int(frame.group(1)), []), project) if frame else "(no source)"
    if found != "(no source)":
        return found
    name = re.search(r'op_name="([^"]*)"', ins.attrs)
    return f"(no source) {name.group(1).split('/')[-1] if name else ins.op}"


def phase(ins: hlo.Instruction) -> str:
    """``forward``, ``backward`` or ``recompute`` (see the module docstring) from the op_name metadata."""
    found = re.search(r'op_name="([^"]*)"', ins.attrs)
    name = found.group(1) if found else ""
    if "transpose(" not in name:
        return "forward"
    after = name[name.index("transpose(") :]
    return "recompute" if "rematted_computation" in after else "backward"


def part(source_name: str) -> str:
    """The coarse part of a source (``PARTS``), or ``other``."""
    return next((name for pattern, name in PARTS if re.search(pattern, source_name)), "other")


@dataclasses.dataclass
class Group:
    part: str
    source: str
    phase: str
    flops: float = 0.0
    bytes: float = 0.0


def attribute(text: str, project: str = PROJECT) -> dict[str, Any]:
    """The program's FLOPs and bytes per run by (source, pass) and by (part, pass), largest first, with the
    totals (equal to ``hlo.summarize``'s) and each group's shares; sources are lines of the files whose path
    holds ``project``."""
    found, _, _, _, _ = hlo.costs(text)
    chains = stack_frames(text)
    groups: dict[tuple[str, str], Group] = {}
    for cost in found:
        where = source(cost.instruction, chains, project)
        key = (where, phase(cost.instruction))
        group = groups.setdefault(key, Group(part(where), where, key[1]))
        group.flops += cost.flops
        group.bytes += cost.bytes
    flops = sum(g.flops for g in groups.values())
    size = sum(g.bytes for g in groups.values())
    parts: dict[tuple[str, str], Group] = collections.OrderedDict()
    for g in groups.values():
        coarse = parts.setdefault((g.part, g.phase), Group(g.part, "", g.phase))
        coarse.flops += g.flops
        coarse.bytes += g.bytes
    row = lambda g: {
        "part": g.part, "source": g.source, "pass": g.phase, "flops": g.flops, "bytes": g.bytes,
        "flops_share": g.flops / flops if flops else 0.0, "bytes_share": g.bytes / size if size else 0.0,
    }  # fmt: skip
    order = lambda rows: sorted(rows, key=lambda g: -(g.flops / (flops or 1) + g.bytes / (size or 1)))
    by_part = [{k: v for k, v in row(g).items() if k != "source"} for g in order(parts.values())]
    return {"flops": flops, "bytes": size, "by_part": by_part, "by_source": [row(g) for g in order(groups.values())]}


def table(result: dict[str, Any], key: str = "by_part", top: int = 25) -> str:
    """A markdown table of ``result[key]`` (``attribute``'s), the ``top`` largest groups."""
    lines = ["| part | source | pass | TFLOP | FLOPs % | GB | bytes % |", "|---|---|---|---|---|---|---|"]
    for g in result[key][:top]:
        lines.append(f"| {g['part']} | {g.get('source', '')} | {g['pass']} | {g['flops'] / 1e12:.2f} | "
                     f"{g['flops_share']:.1%} | {g['bytes'] / 1e9:.2f} | {g['bytes_share']:.1%} |")  # fmt: skip
    lines.append(f"| total | | | {result['flops'] / 1e12:.2f} | 100% | {result['bytes'] / 1e9:.2f} | 100% |")
    return "\n".join(lines)


def _read(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return f.read()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("hlo", help="a compiled program's HLO text (.gz or plain), as --hlo-dir writes it")
    parser.add_argument("--json", help="write the attribution here")
    parser.add_argument("--top", type=int, default=25, help="sources printed and written (largest first)")
    args = parser.parse_args(argv)
    result = attribute(_read(args.hlo))
    print(table(result, "by_part", args.top))
    print()
    print(table(result, "by_source", args.top))
    if args.json:  # every part; the --top largest sources
        with open(args.json, "w") as f:
            json.dump({**result, "by_source": result["by_source"][: args.top]}, f, indent=1)
    return result


if __name__ == "__main__":
    main()
