"""What a compiled program's HLO says: the Mosaic kernels it calls, its collectives, and its FLOPs and bytes
counted once per execution (loops included).

``compiled.cost_analysis()`` counts a ``while`` body once whatever its trip count (measured on the TPU
compiler: a 7-step scan of a matmul reports one step's FLOPs), and a model's layers are a scan, so this module
reads ``compiled.as_text()`` instead: every computation's executions per program run are the product of the
trip counts of the loops around it (a loop's count is the constant its condition compares the counter
with, the form ``lax.scan`` / ``fori_loop`` lower to; a loop whose count cannot be read is counted once and
listed in ``unknown_loops``; each branch of a conditional counts as 1/branches of a run, the mean of a
``lax.switch`` over equal branches). Per execution:

* FLOPs: 2 x output elements x contracted elements of every ``dot`` / ``convolution`` (fusions included),
  plus what each Mosaic kernel states in its cost estimate (``pl.CostEstimate``; a kernel that states none,
  such as jax's splash and paged attention, adds none);
* bytes: operands + output of every instruction that runs as its own kernel (a fusion, a copy, a
  collective, a custom call; not the tuple plumbing), as XLA's cost analysis counts HBM traffic, except what
  it does not touch: an array the compiler placed in VMEM or another on-chip memory (``S(1)`` ... in its
  layout: ``hbm_bytes``; an async ``slice-start`` / ``copy-start`` into VMEM costs the bytes it reads from
  HBM), an operand only sliced (in the fusion or in fusions nested in it: a layer of a scanned
  weight stack) costs its slices, a buffer updated in place its update, the paged-attention kernel the pages
  its table names, a Mosaic kernel that states its bytes those (``_hbm_bytes``); ``byte_consumers`` lists
  them per instruction, largest first;
* collectives: all-gather, all-reduce, reduce-scatter, all-to-all, collective-permute (and their async
  ``-start`` forms) with their bytes and the number of devices in each group.

``kernels``: the ``custom_call_target="tpu_custom_call"`` calls (Pallas / Mosaic kernels), by kernel name.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Any

_DTYPE_BYTES = {
    "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1,
    "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8,
    "c64": 8, "c128": 16,
}  # fmt: skip
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\((.*)\)\s*->\s*(.*)\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\((.*)$")
_CALLEES = re.compile(r"\b(calls|body|condition|to_apply|branch_computations|true_computation|false_computation)=")
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
# Instructions that move no HBM bytes of their own.
_FREE = {
    "parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "conditional", "call",
    "after-all", "partition-id", "replica-id", "copy-done", "all-gather-done", "all-reduce-done",
    "collective-permute-done", "send-done", "recv-done", "opt-barrier", "iota", "add-dependency",
    "get-dimension-size", "async-done", "async-update",
}  # fmt: skip


def type_bytes(text: str) -> int:
    """Bytes of an HLO type (an array or a tuple of arrays; layouts ignored)."""
    return sum(_DTYPE_BYTES[d] * math.prod(int(x) for x in dims.split(",") if x) for d, dims in _ARRAY.findall(text))


# An array and its layout: ``bf16[4,128]{1,0:T(8,128)(2,1)S(1)}``. ``S(n)`` names the memory space the
# compiler assigned it (openxla.org/xla/shapes, "memory space identifiers"): none or S(0) is HBM; on a TPU
# S(1) is VMEM and the others other on-chip or host memories, none of them HBM traffic.
_ARRAY_LAYOUT = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\](\{[^{}]*\})?")
_SPACE = re.compile(r"S\((\d+)\)")


def hbm_bytes(text: str) -> int:
    """Bytes of the arrays of an HLO type that live in HBM (memory space 0: no ``S(n)``, or ``S(0)``, in the
    layout); an array the compiler placed in VMEM (``S(1)`` on a TPU) or another memory costs no HBM bytes."""
    total = 0
    for dtype, dims, layout in _ARRAY_LAYOUT.findall(text):
        space = _SPACE.search(layout or "")
        if space is None or space.group(1) == "0":
            total += _DTYPE_BYTES[dtype] * math.prod(int(x) for x in dims.split(",") if x)
    return total


def _async_destination(ins_type: str) -> str:
    """The destination of an async copy / slice (``copy-start``: ``(source, destination, context)``)."""
    parts = _top_level_split(ins_type.strip()[1:-1]) if ins_type.strip().startswith("(") else [ins_type]
    return parts[1] if len(parts) > 1 else ins_type


def _dims(text: str) -> list[int]:
    found = _ARRAY.search(text)
    return [int(x) for x in found.group(2).split(",") if x] if found else []


@dataclasses.dataclass
class Instruction:
    name: str
    type: str
    op: str
    operands: list[str]
    attrs: str
    args: str = ""


@dataclasses.dataclass
class Computation:
    name: str
    params: dict[str, str]
    instructions: list[Instruction]
    root: str = ""


def _top_level_split(text: str) -> list[str]:
    """``text`` split at the commas outside brackets, braces and parentheses."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]]


def parse(text: str) -> tuple[dict[str, Computation], str]:
    """``(computations by name, the entry computation's name)`` of an HLO module's text."""
    comps: dict[str, Computation] = {}
    entry, current = "", None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            params = dict(p.split(":", 1) for p in _top_level_split(header.group(2)) if ":" in p)
            params = {k.strip(): v.strip() for k, v in params.items()}
            current = Computation(header.group(1), params, [])
            comps[current.name] = current
            if line.startswith("ENTRY"):
                entry = current.name
            continue
        instr = _INSTR.match(line)
        if instr and current is not None:
            if line.lstrip().startswith("ROOT "):
                current.root = instr.group(1)
            rest = instr.group(4)
            depth, cut = 1, len(rest)
            for i, ch in enumerate(rest):  # the operand list ends at the matching parenthesis
                depth += ch == "("
                depth -= ch == ")"
                if depth == 0:
                    cut = i
                    break
            operands = re.findall(r"%([\w.\-]+)", rest[:cut])
            current.instructions.append(
                Instruction(instr.group(1), instr.group(2), instr.group(3), operands, rest[cut:], rest[:cut])
            )
    return comps, entry


def _callees(attrs: str) -> list[tuple[str, str]]:
    out = []
    for m in _CALLEES.finditer(attrs):
        tail = attrs[m.end() :]
        names = re.match(r"\{([^}]*)\}", tail)
        targets = re.findall(r"%([\w.\-]+)", names.group(1)) if names else re.findall(r"^%([\w.\-]+)", tail)
        out += [(m.group(1), t) for t in targets]
    return out


def _constants(comp: Computation) -> dict[str, int]:
    return {
        i.name: int(i.args) for i in comp.instructions if i.op == "constant" and re.fullmatch(r"\s*-?\d+\s*", i.args)
    }


def _tuple_index(comp: Computation, name: str) -> int | None:
    """The tuple index ``name`` reads from ``comp``'s parameter (a ``get-tuple-element`` of it, through copies
    and bitcasts), or None."""
    by_name = {i.name: i for i in comp.instructions}
    found = by_name.get(name)
    while found is not None and found.op in ("copy", "bitcast") and len(found.operands) == 1:
        found = by_name.get(found.operands[0])
    if found is None or found.op != "get-tuple-element":
        return None
    index = re.search(r"index=(\d+)", found.attrs)
    return int(index.group(1)) if index else None


def _step(body: Computation | None, index: int | None) -> int:
    """How much ``body`` adds to its loop state's element ``index`` an iteration: the constant of an ``add`` of
    that element and a constant at that position of the root tuple (1 where it cannot be read)."""
    if body is None or index is None:
        return 1
    by_name = {i.name: i for i in body.instructions}
    root = by_name.get(_root_name(body))
    if root is None or root.op != "tuple" or index >= len(root.operands):
        return 1
    update = by_name.get(root.operands[index])
    constants = _constants(body)
    if update is None or update.op != "add" or len(update.operands) != 2:
        return 1
    counter, step = update.operands if update.operands[1] in constants else update.operands[::-1]
    if step not in constants or _tuple_index(body, counter) != index or constants[step] <= 0:
        return 1
    return constants[step]


def _trip_count(condition: Computation | None, body: Computation | None = None) -> int | None:
    """Iterations of a ``while`` whose counter runs from 0 while below a constant: the constant over the step
    the body adds to the counter (1 for ``lax.scan`` / ``fori_loop``; 2 in the TPU compiler's bidirectional
    windowed-einsum loops, which compute two chunks an iteration)."""
    if condition is None:
        return None
    constants = _constants(condition)
    for ins in condition.instructions:
        if ins.op == "compare" and "direction=LT" in ins.attrs:
            for operand in ins.operands:
                if operand in constants:
                    other = next((o for o in ins.operands if o != operand), "")
                    return -(-constants[operand] // _step(body, _tuple_index(condition, other)))
    return None
    constants = {}
    for ins in condition.instructions:
        if ins.op == "constant" and re.fullmatch(r"\s*-?\d+\s*", ins.args):
            constants[ins.name] = int(ins.args)
    for ins in condition.instructions:
        if ins.op == "compare" and "direction=LT" in ins.attrs:
            for operand in ins.operands:
                if operand in constants:
                    return constants[operand]
    return None


def _group_size(attrs: str, devices: int) -> int:
    """Devices in each group of a collective: ``mesh['a'=4,'b'=2] {'a'}`` -> 4; ``{{0,1},{2,3}}`` -> 2;
    iota ``[2,4]<=[8]`` -> 4; none given -> all devices."""
    named = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if named:
        sizes = {k: int(v) for k, v in re.findall(r"'(\w+)'=(\d+)", named.group(1))}
        return math.prod(sizes[a] for a in re.findall(r"'(\w+)'", named.group(2)))
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=", attrs)
    if iota:
        return int(iota.group(1).split(",")[-1])
    listed = re.search(r"replica_groups=\{\{([\d,]*)\}", attrs)
    if listed:
        return len([x for x in listed.group(1).split(",") if x])
    pairs = re.search(r"source_target_pairs=\{(.*?)\}\s*(,|$)", attrs)
    if pairs:
        return 2
    return devices


def _dot_flops(ins: Instruction, shapes: dict[str, str]) -> float:
    out = math.prod(_dims(ins.type)) if _ARRAY.search(ins.type) else 0
    if ins.op == "dot":
        lhs = _dims(shapes.get(ins.operands[0], "")) if ins.operands else []
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
        k = math.prod(lhs[int(i)] for i in contracting.group(1).split(",") if i) if contracting and lhs else 1
        return 2.0 * out * k
    # convolution: every output element takes (input features) x (window taps over real input) multiply-adds.
    # The TPU compiler writes batched matmuls as convolutions whose window slides over a padded or dilated
    # spatial dimension; only the taps that land on real input positions count (at most ceil(window /
    # lhs_dilate) of them, and never more than the input's positions).
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attrs)
    if not labels or len(ins.operands) < 2:
        return 0.0
    lhs_labels, rhs_labels = labels.group(1), labels.group(2)
    lhs, rhs = _dims(shapes.get(ins.operands[0], "")), _dims(shapes.get(ins.operands[1], ""))
    if len(lhs) != len(lhs_labels) or len(rhs) != len(rhs_labels):
        return 0.0
    dilation = re.search(r"lhs_dilate=([\dx]+)", ins.attrs)
    dilate = [int(x) for x in dilation.group(1).split("x")] if dilation else []
    taps = 1
    for label, window in zip(rhs_labels, rhs, strict=True):
        if label.isdigit():
            d = int(label)
            k = dilate[d] if d < len(dilate) else 1
            taps *= min(-(-window // k), lhs[lhs_labels.index(label)])
    return 2.0 * out * rhs[rhs_labels.index("i")] * taps


@dataclasses.dataclass
class HloSummary:
    """One program's counts per run (see the module docstring)."""

    flops: float
    bytes_accessed: float
    collectives: dict[str, dict[str, float]]  # kind -> {"count", "bytes", "wire_bytes"}
    kernels: dict[str, int]
    loops: list[int]
    unknown_loops: int

    @property
    def wire_bytes(self) -> float:
        """Bytes each device sends over the interconnect (ring algorithms), all collectives together."""
        return sum(c["wire_bytes"] for c in self.collectives.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "flops": self.flops,
            "bytes_accessed": self.bytes_accessed,
            "collectives": self.collectives,
            "wire_bytes": self.wire_bytes,
            "kernels": self.kernels,
            "loop_trip_counts": sorted(set(self.loops)),
            "unknown_loops": self.unknown_loops,
        }


_SLICING = ("dynamic-slice", "gather", "slice")
# Mosaic kernels that read pages of a pool through a page table (jax's Pallas TPU paged attention): such a
# call reads the pages its table names, not its whole page operands.
_PAGED_KERNELS = ("paged_attention",)


def _sliced_bytes(comp: Computation, name: str, comps: dict[str, Computation], depth: int = 0) -> float | None:
    """Bytes of ``name`` (a value of ``comp``) that ``comp`` reads where every use of it only slices it (directly,
    through bitcasts, or as the operand of a nested fusion that only slices it); None where a use reads it all."""
    uses = [i for i in comp.instructions if name in i.operands]
    if not uses or depth > 8:
        return None
    total = 0.0
    for use in uses:
        if use.op in _SLICING and use.operands[0] == name and name not in use.operands[1:]:
            total += type_bytes(use.type)  # a slice of a value in HBM reads its bytes there
            continue
        if use.op == "bitcast":
            inner = _sliced_bytes(comp, use.name, comps, depth + 1)
        elif use.op == "fusion":
            callee = comps.get(next((t for k, t in _callees(use.attrs) if k == "calls"), ""))
            params = _parameters(callee) if callee else {}
            names = [params.get(i) for i, o in enumerate(use.operands) if o == name]
            parts = [_sliced_bytes(callee, n, comps, depth + 1) if n else None for n in names]
            inner = None if any(p is None for p in parts) else sum(parts)
        else:
            inner = None
        if inner is None:
            return None
        total += inner
    return total


def _parameters(comp: Computation) -> dict[int, str]:
    """Parameter number -> instruction name of ``comp``."""
    out = {}
    for i in comp.instructions:
        number = re.match(r"\s*(\d+)", i.args) if i.op == "parameter" else None
        if number:
            out[int(number.group(1))] = i.name
    return out


def _paged_kernel_bytes(ins: Instruction, shapes: dict[str, str], out_bytes: int) -> float:
    """HBM bytes of a paged-attention kernel call: its output and operands, its page operands (rank 4, ``[kv
    heads, pages, page_size, head_dim]``) counted as the pages its page table (the int32 operand with the most
    entries) names, every entry once (every slot reading its whole table: the widest window)."""
    types = [shapes.get(o, "") for o in ins.operands]
    tables = [math.prod(_dims(t)) for t in types if t.lstrip().startswith("s32[")]
    entries = max(tables, default=0)
    total = float(out_bytes)
    for t in types:
        dims = _dims(t)
        if len(dims) == 4 and entries and dims[1] > entries:
            total += hbm_bytes(t) * entries / dims[1]
        else:
            total += hbm_bytes(t)
    return total


def _hbm_bytes(ins: Instruction, comps: dict[str, Computation], shapes: dict[str, str], out_bytes: int) -> float:
    """HBM bytes one kernel moves: its operands and output, except what it does not touch. An operand read only
    by slices / gathers (in the fusion or in fusions nested in it) costs the slices' bytes; a buffer updated in
    place (``dynamic-update-slice`` / ``scatter`` on it) costs its update's bytes, read and written, not the
    whole buffer (a KV pool updated one token at a time, a layer's slice of a stack); a paged-attention kernel
    costs the pages its table names (``_paged_kernel_bytes``)."""
    if ins.op == "custom-call" and any(k in n for n in kernel_ops(ins.attrs) for k in _PAGED_KERNELS):
        return _paged_kernel_bytes(ins, shapes, out_bytes)
    if ins.op in ("dynamic-update-slice", "scatter") and len(ins.operands) >= 2:
        others = [o for o in ins.operands[1:] if o != _update_operand(ins)]
        return 2.0 * hbm_bytes(shapes.get(_update_operand(ins), "")) + sum(hbm_bytes(shapes.get(o, "")) for o in others)
    if ins.op in _SLICING or ins.op == "slice-start":  # reads its slice where the source lives, writes it
        out_type = _async_destination(ins.type) if ins.op == "slice-start" else ins.type
        source_in_hbm = bool(ins.operands) and hbm_bytes(shapes.get(ins.operands[0], "")) > 0
        return source_in_hbm * type_bytes(out_type) + hbm_bytes(out_type)
    if ins.op == "copy-start":  # an async copy between memories (HBM <-> VMEM): its source and destination
        return hbm_bytes(shapes.get(ins.operands[0], "")) + hbm_bytes(_async_destination(ins.type))
    stated = _kernel_cost(ins).get("bytes_accessed")
    if stated is not None:
        return stated
    callee = next((t for k, t in _callees(ins.attrs) if k == "calls"), None) if ins.op == "fusion" else None
    if callee is None or callee not in comps:
        return out_bytes + sum(hbm_bytes(shapes.get(o, "")) for o in ins.operands)
    body = comps[callee]
    users = _users(body)
    total = 0.0
    in_place = False
    for position, name in _parameters(body).items():
        if position >= len(ins.operands):
            continue
        full = hbm_bytes(shapes.get(ins.operands[position], ""))
        uses = users.get(name, [])
        sliced = _sliced_bytes(body, name, comps)
        if sliced is not None:
            total += min(sliced, full)
        elif uses and all(u.op in ("dynamic-update-slice", "scatter") and u.operands[0] == name for u in uses):
            in_place = True  # the buffer is written in place: its update is counted below
        else:
            total += full
    root = body.instructions[-1] if body.instructions else None
    for r in body.instructions:
        if r.name == _root_name(body):
            root = r
    if in_place and root is not None and root.op in ("dynamic-update-slice", "scatter"):
        return total + 2.0 * hbm_bytes(shapes.get(_update_operand(root), ""))
    if in_place and root is not None and root.op == "tuple":  # several outputs, some of them updated in place
        by_name = {i.name: i for i in body.instructions}
        types = _top_level_split(ins.type.strip()[1:-1]) if ins.type.strip().startswith("(") else []
        if len(types) == len(root.operands):
            for element, out_type in zip(root.operands, types, strict=True):
                made = by_name.get(element)
                if made is not None and made.op in ("dynamic-update-slice", "scatter") and hbm_bytes(out_type):
                    total += 2.0 * hbm_bytes(shapes.get(_update_operand(made), ""))
                else:
                    total += hbm_bytes(out_type)
            return total
    return total + out_bytes


def _update_operand(ins: Instruction) -> str:
    """The operand an in-place update writes: a ``dynamic-update-slice``'s second (then its indices), a
    ``scatter``'s last (its updates)."""
    return ins.operands[1] if ins.op == "dynamic-update-slice" else ins.operands[-1]


def _users(body: Computation) -> dict[str, list[Instruction]]:
    users: dict[str, list[Instruction]] = collections.defaultdict(list)
    for i in body.instructions:
        for o in i.operands:
            users[o].append(i)
    return users


_COST = re.compile(r'"cost_estimate":\{([^}]*)\}')


def _kernel_cost(ins: Instruction) -> dict[str, float]:
    """The FLOPs / bytes a Mosaic kernel states for itself (``pl.CostEstimate``), or {} where it states none."""
    if ins.op != "custom-call" or "tpu_custom_call" not in ins.attrs:
        return {}
    found = _COST.search(ins.attrs)
    pairs = re.findall(r'"(\w+)":"?([\d.e+]+)"?', found.group(1)) if found else []
    return {key: float(value) for key, value in pairs}


def _root_name(comp: Computation) -> str:
    return comp.root or (comp.instructions[-1].name if comp.instructions else "")


# Scopes jax's transformations add around a call: they say nothing of which kernel it is.
_TRANSFORM_SCOPES = re.compile(r"shard_map|checkpoint|rematted_computation|closed_call|body|while|cond|branch_\w*")


def _kernel_name(op_name: str) -> str:
    """A Mosaic call's name from its op_name: a Pallas kernel (``.../pallas_call``) is named by the scope
    around it, ``jax.named_scope(NAME)`` or ``jax.jit``'s ``jit(NAME)``; an XLA-emitted one by its op."""
    parts = op_name.split("/")
    if parts[-1] != "pallas_call" or len(parts) < 2:
        return parts[-1]
    scope = re.fullmatch(r"jit\((\w+)\)", parts[-2])
    if scope:
        return scope.group(1)
    return "pallas_call" if _TRANSFORM_SCOPES.fullmatch(parts[-2]) or "(" in parts[-2] else parts[-2]


def kernel_ops(text: str) -> list[str]:
    """The full op names (``op_name`` metadata) of the Mosaic kernel calls in an HLO text."""
    out = []
    for line in text.splitlines():
        if 'custom_call_target="tpu_custom_call"' in line:
            name = re.search(r'op_name="([^"]*)"', line)
            out.append(name.group(1) if name else "tpu_custom_call")
    return out


def kernel_names(text: str) -> dict[str, int]:
    """Mosaic (Pallas TPU) kernel calls in an HLO text, by kernel name (op_name metadata), counted once each."""
    out: collections.Counter[str] = collections.Counter()
    for line in text.splitlines():
        if 'custom_call_target="tpu_custom_call"' in line:
            name = re.search(r'op_name="([^"]*)"', line)
            out[_kernel_name(name.group(1)) if name else "tpu_custom_call"] += 1
    return dict(out)


@dataclasses.dataclass
class ByteConsumer:
    """One instruction that runs as its own kernel: its HBM bytes per execution and executions per run."""

    computation: str
    name: str
    op: str
    type: str
    executions: float
    bytes: float  # per execution
    kernel: str = ""  # a fusion's called computation, a custom call's target / Mosaic kernel name

    @property
    def total(self) -> float:
        return self.executions * self.bytes


def _runs(comps: dict[str, Computation], entry: str) -> tuple[dict[str, float], set[str], list[int], int]:
    """Executions per program run of every computation reached from ``entry``, the computations that run
    inside a fusion (or as a reducer), the trip counts of the loops met and the number whose count is unknown."""
    runs: dict[str, float] = collections.defaultdict(float)
    fused: set[str] = set()
    loops: list[int] = []
    unknown = 0

    def visit(name: str, times: float, inside_fusion: bool, depth: int = 0) -> None:
        nonlocal unknown
        if name not in comps or depth > 64:
            return
        runs[name] += times
        if inside_fusion:
            fused.add(name)
        for ins in comps[name].instructions:
            callees = _callees(ins.attrs)
            if ins.op == "while":
                body = next((t for k, t in callees if k == "body"), None)
                cond = next((t for k, t in callees if k == "condition"), None)
                trips = _trip_count(comps.get(cond), comps.get(body))
                if trips is None:
                    unknown += 1
                    trips = 1
                loops.append(trips)
                if body:
                    visit(body, times * trips, inside_fusion, depth + 1)
                if cond:
                    visit(cond, times * (trips + 1), inside_fusion, depth + 1)
                continue
            branches = [t for k, t in callees if k in ("branch_computations", "true_computation", "false_computation")]
            for kind, target in callees:
                # fusion bodies and reducers run inside their caller's kernel: no HBM traffic of their own
                inner = inside_fusion or ins.op == "fusion" or kind == "to_apply"
                share = 1 / len(branches) if target in branches else 1  # one branch of a conditional runs
                visit(target, times * share, inner, depth + 1)

    visit(entry, 1.0, False)
    return runs, fused, loops, unknown


def byte_consumers(text: str) -> list[ByteConsumer]:
    """Every instruction of a compiled program that moves HBM bytes of its own (as ``summarize`` counts them),
    largest total per run first: where a program's ``bytes_accessed`` goes."""
    comps, entry = parse(text)
    shapes = _shapes(comps)
    runs, fused, _, _ = _runs(comps, entry)
    out = []
    for name, times in runs.items():
        if name in fused:
            continue
        for ins in comps[name].instructions:
            if ins.op in _FREE or ins.op.endswith("-done"):
                continue
            kernel = next((t for k, t in _callees(ins.attrs) if k == "calls"), "")
            if ins.op == "custom-call":
                kernel = next(iter(kernel_names(ins.attrs)), "") or _custom_call_target(ins.attrs)
            size = _hbm_bytes(ins, comps, shapes, hbm_bytes(ins.type))
            out.append(ByteConsumer(name, ins.name, ins.op, ins.type.strip(), times, size, kernel))
    return sorted(out, key=lambda c: -c.total)


def _custom_call_target(attrs: str) -> str:
    found = re.search(r'custom_call_target="([^"]*)"', attrs)
    return found.group(1) if found else ""


def _shapes(comps: dict[str, Computation]) -> dict[str, str]:
    shapes: dict[str, str] = {}
    for comp in comps.values():
        shapes.update(comp.params)
        shapes.update({ins.name: ins.type for ins in comp.instructions})
    return shapes


@dataclasses.dataclass(frozen=True)
class Cost:
    """What one instruction of a program costs per run: FLOPs (a dot / convolution, fused or not, or what a
    Mosaic kernel states) and HBM bytes (an instruction that runs as its own kernel)."""

    computation: str
    instruction: Instruction
    executions: float
    flops: float  # per run (executions included)
    bytes: float  # per run
    fused: bool  # inside a fusion / reducer: its bytes are its kernel's


def costs(text: str) -> tuple[list[Cost], dict[str, Computation], dict[str, str], list[int], int]:
    """Every instruction of a compiled program that costs FLOPs or HBM bytes, as ``summarize`` counts them, with
    the parsed computations, the value types, the loops' trip counts and the number of unknown loops."""
    comps, entry = parse(text)
    shapes = _shapes(comps)
    runs, fused, loops, unknown = _runs(comps, entry)
    out = []
    for name, times in runs.items():
        inside = name in fused
        for ins in comps[name].instructions:
            flops = _dot_flops(ins, shapes) if ins.op in ("dot", "convolution") else 0.0
            flops += _kernel_cost(ins).get("flops", 0.0)
            moves = not (inside or ins.op in _FREE or ins.op.endswith("-done"))
            size = _hbm_bytes(ins, comps, shapes, hbm_bytes(ins.type)) if moves else 0.0
            if flops or size or (moves and ins.op.removesuffix("-start") in COLLECTIVES):  # ICI even in VMEM
                out.append(Cost(name, ins, times, times * flops, times * size, inside))
    return out, comps, shapes, loops, unknown


def summarize(text: str, devices: int) -> HloSummary:
    """Counts of one compiled program's HLO text, per device and per run (``devices``: the mesh size)."""
    found, _, shapes, loops, unknown = costs(text)
    flops = bytes_accessed = 0.0
    coll: dict[str, dict[str, float]] = {}
    for cost in found:
        flops += cost.flops
        bytes_accessed += cost.bytes
        ins, times = cost.instruction, cost.executions
        kind = ins.op.removesuffix("-start")
        if kind in COLLECTIVES and not cost.fused:
            out_bytes = type_bytes(ins.type)
            in_bytes = sum(type_bytes(shapes.get(o, "")) for o in ins.operands)
            n = _group_size(ins.attrs, devices)
            size = max(in_bytes, out_bytes) if ins.op.endswith("-start") else out_bytes
            if kind == "reduce-scatter":
                size = in_bytes
            share = (n - 1) / n if n > 1 else 0.0
            wire = {"all-reduce": 2 * share, "collective-permute": 1.0}.get(kind, share) * size
            entry_ = coll.setdefault(kind, {"count": 0, "bytes": 0.0, "wire_bytes": 0.0})
            entry_["count"] += times
            entry_["bytes"] += times * size
            entry_["wire_bytes"] += times * wire
    return HloSummary(flops, bytes_accessed, coll, kernel_names(text), loops, unknown)
