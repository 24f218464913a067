"""Compile pass: graphs of a GGUF model -> graphs whose projections compute on the GGUF blocks themselves.

Input: the exported (and packed) ``onnx_ir.Model`` of a model converted from a GGUF file
(:func:`kvforge.compile.gguf.convert`), and that file's :class:`~kvforge.compile.gguf.GGUFBlocks`.
Output: the same graph, edited in place, where every ``MatMul(x, W)`` and lm_head
``Gemm(x, W, transB=1)`` whose constant ``W`` is, value for value, rows of Q4_0, Q8_0 or Q4_1
tensors of the file becomes ONNX Runtime's ``com.microsoft.MatMulNBits`` on those very blocks,
repacked into its layout: no dequantize-requantize, no second rounding. ``MatMulNBits`` computes
``y = x @ (scale * (q - zero_point))^T`` over blocks of 32 weights along K:

* **Q4_0** (``w = d·(q − 8)``, q in 0..15): 4 bits, scale d, no zero points (the op's default is
  8). GGUF stores a block's weights j and j+16 in byte j (low, high nibble); MatMulNBits weights
  2i and 2i+1 in byte i: the nibbles are reordered, never changed.
* **Q8_0** (``w = d·q``, q int8): 8 bits, scale d, stored as ``q + 128`` (the default zero point 128).
* **Q4_1** (``w = d·q + m``): MatMulNBits takes float zero points (``-m/d``) only on a slow
  reference kernel (20-300× slower: benchmarks/README.md, "GGUF blocks"), and its uint8 zero points
  are integers: ``m = -d·zp`` holds in 0.3% of SmolLM2's Q4_1 blocks. Here the op gets uint8 zero
  points 0, so it computes ``x @ (d·q)^T`` on its fast path, and the block minimums are added as
  ``Σ_b m[n, b] · Σ_{k∈b} x_k``. The block sums come out of the same node: ``K/32`` extra rows,
  row ``N + b`` all ones on block b and zeros elsewhere (scale 1), so the node yields ``[y, sums]``
  (+3% weight bytes on SmolLM2); a ``Split``, one small ``MatMul`` with ``M [K/32, N]`` and an
  ``Add`` finish it. The sums are of the activations the kernel multiplied (int8 per block at
  accuracy level 4, as llama.cpp's Q4_1 × Q8_1 dot product takes the Q8_1 block sums), so the
  result is the file's weights applied to those activations, up to float rounding. (An earlier
  form summed x with ``Reshape`` + ``ReduceSum``: one node more per projection group, 1.38× int4's
  decode step against this form's 1.16×, benchmarks/README.md.)

``accuracy_level`` is 4, kvforge's ``--quantize`` setting: the kernel quantizes activations to
int8 per block, as llama.cpp's own CPU kernels do (its Q4/Q8 dot products take Q8 activations).
Without it, ORT 1.32 has no fast 8-bit kernel (Q8_0 at accuracy level 0: ~300× slower).

The fp32 tensors stay where another node reads them (a tied embedding table: the ``Gather`` reads
floats, the lm_head the Q8_0 blocks). Only float32 graphs are rewritten.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from kvforge.compile.gguf import BLOCK, EXACT_TYPES, BlockRows, GGUFBlocks

ACCURACY_LEVEL = 4
MSFT = "com.microsoft"


@dataclass
class GGUFReport:
    """What :func:`keep_gguf_blocks` did, for the compile line and the manifest."""

    nodes: dict[str, list[str]] = field(default_factory=dict)  # MatMulNBits node -> GGUF tensors it reads
    kept: dict[str, str] = field(default_factory=dict)  # GGUF tensor -> its type, blocks kept
    other: dict[str, str] = field(default_factory=dict)  # GGUF tensor -> its type, read as floats
    exclude: list[str] = field(default_factory=list)  # nodes a later quantizer must leave alone

    def summary(self) -> str:
        kept = Counter(self.kept.values())
        other = Counter(self.other.values())
        text = f"{len(self.kept)} tensors kept as GGUF blocks ({_counts(kept) or 'none'})"
        return f"{text}, {len(self.other)} dequantized ({_counts(other) or 'none'})"

    def record(self, file: str) -> dict:
        return {
            "file": file,
            "op": f"{MSFT}.MatMulNBits",
            "accuracy_level": ACCURACY_LEVEL,
            "q4_1": "zero points 0, K/32 block-sum rows; + block sums @ minimums (Split, MatMul, Add)",
            "kept": dict(sorted(self.kept.items())),
            "dequantized": dict(sorted(self.other.items())),
        }


def _counts(counter: Counter) -> str:
    return ", ".join(f"{t} ×{n}" for t, n in sorted(counter.items()))


def keep_gguf_blocks(model: ir.Model, blocks: GGUFBlocks) -> GGUFReport:
    """Rewrite ``model``'s projections onto GGUF blocks in place (see the module docstring). Runs
    before :mod:`kvforge.compile.packing`: projections of one activation whose blocks share a type
    (a layer's q, k, v; its gate and up) become one ``MatMulNBits`` on their blocks stacked along N
    and a ``Split``, as packing does for float weights; the ones left as floats are packed after."""
    graph = model.graph
    report = GGUFReport()
    groups: dict[tuple, list[tuple[ir.Node, ir.Value, BlockRows]]] = defaultdict(list)
    for node in list(graph):
        weight = _float_weight(node)
        if weight is None:
            continue
        rows = weight.const_value.numpy()
        rows = np.ascontiguousarray(rows.T) if node.op_type == "MatMul" else rows  # [N, K]
        found = blocks.match(rows)
        if found is None:
            continue
        key = (node.inputs[0], found.qtype, rows.shape[1]) if node.op_type == "MatMul" else (node,)
        groups[key].append((node, weight, found))
    used: set[str] = set()
    for group in groups.values():
        _replace(graph, group, report)
        for _, weight, found in group:
            used.update(found.tensors)
            if not list(weight.uses()) and weight.name in graph.initializers:
                graph.initializers.pop(weight.name)
    if report.nodes:
        model.opset_imports.setdefault(MSFT, 1)
    for name, qtype in blocks.types.items():
        (report.kept if name in used else report.other)[name] = qtype
    return report


def _float_weight(node: ir.Node) -> ir.Value | None:
    """The constant float32 2-D weight of a ``MatMul(x, W [K, N])`` or ``Gemm(x, W [N, K],
    transB=1)`` (no bias, unit alpha), with K a multiple of 32; else None."""
    if node.domain not in ("", "ai.onnx") or node.op_type not in ("MatMul", "Gemm"):
        return None
    if node.op_type == "Gemm":
        attrs = node.attributes
        plain = (
            len([v for v in node.inputs if v is not None]) == 2
            and attrs.get_int("transB", 0) == 1
            and attrs.get_int("transA", 0) == 0
            and attrs.get_float("alpha", 1.0) == 1.0
        )
        if not plain:
            return None
    weight = node.inputs[1]
    if weight is None or weight.const_value is None or weight.const_value.dtype != ir.DataType.FLOAT:
        return None
    shape = weight.const_value.shape
    k = shape[0] if node.op_type == "MatMul" else shape[-1]
    return weight if len(shape) == 2 and k % BLOCK == 0 else None


def repack(found: BlockRows) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """GGUF blocks ``[N, K/32, bytes]`` -> MatMulNBits' ``B [N, K/32, 32·bits/8]`` uint8, ``scales
    [N, K/32]`` float32, ``zero_points`` (Q4_1: uint8 zeros ``[N, ceil(K/32 / 2)]``, else None) and
    the Q4_1 block minimums ``[K/32, N]`` float32 (else None)."""
    blocks = found.blocks
    n, nb, _ = blocks.shape
    scales = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)  # d: fp16 -> fp32, exact
    if found.qtype == "Q8_0":
        q = blocks[..., 2:] ^ np.uint8(0x80)  # int8 q -> uint8 q + 128
        return np.ascontiguousarray(q), scales, None, None
    start = 2 if found.qtype == "Q4_0" else 4
    qs = blocks[..., start:]  # [N, nb, 16]: byte j holds weights j (low nibble) and j + 16 (high)
    q = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)  # [N, nb, 32] in order
    packed = q[..., 0::2] | (q[..., 1::2] << np.uint8(4))  # byte i: weights 2i (low) and 2i + 1 (high)
    if found.qtype == "Q4_0":
        return np.ascontiguousarray(packed), scales, None, None
    mins = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, nb]
    zero_points = np.zeros((n, (nb + 1) // 2), np.uint8)
    return np.ascontiguousarray(packed), scales, zero_points, np.ascontiguousarray(mins.T)


def _const(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    value = ir.Value(name=name, const_value=ir.Tensor(array, name=name))
    value.shape, value.type = ir.Shape(array.shape), ir.TensorType(ir.DataType.from_numpy(array.dtype))
    graph.register_initializer(value)
    return value


def block_sum_rows(packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray) -> tuple[np.ndarray, ...]:
    """Q4_1's MatMulNBits arrays ``[N, ...]`` with ``K/32`` rows more: row ``N + b`` is 1 on block b and
    0 elsewhere (scale 1, zero point 0), so the node's output ``N + b`` is the sum of block b of the
    activations it multiplied (int8-quantized at accuracy level 4, as llama.cpp's Q8_1 sums are)."""
    nb = scales.shape[1]
    ones = np.zeros((nb, nb, BLOCK), np.uint8)
    ones[np.arange(nb), np.arange(nb)] = 1
    ones = ones[..., 0::2] | (ones[..., 1::2] << np.uint8(4))
    return (
        np.concatenate([packed, ones]),
        np.concatenate([scales, np.ones((nb, nb), np.float32)]),
        np.concatenate([zero_points, np.zeros((nb, zero_points.shape[1]), np.uint8)]),
    )


def _replace(graph: ir.Graph, group: list[tuple[ir.Node, ir.Value, BlockRows]], report: GGUFReport) -> None:
    """One ``MatMulNBits`` (+ the Q4_1 minimums) for the projections of ``group`` (one activation,
    one GGUF type), then a ``Split`` by their widths when there are several."""
    first, weight, _ = group[0]
    qtype = group[0][2].qtype
    stacked = BlockRows(
        qtype,
        np.concatenate([found.blocks for _, _, found in group]),
        tuple(dict.fromkeys(t for _, _, found in group for t in found.tensors)),
    )
    widths = [found.blocks.shape[0] for _, _, found in group]
    n, nb, _ = stacked.blocks.shape
    bits = EXACT_TYPES[qtype][0]
    packed, scales, zero_points, mins = repack(stacked)
    if mins is not None:
        packed, scales, zero_points = block_sum_rows(packed, scales, zero_points)
    stem = f"{weight.name}{'.packed' if len(group) > 1 else ''}.gguf_{qtype.lower()}"
    x = first.inputs[0]
    inputs = [x, _const(graph, f"{stem}.q", packed), _const(graph, f"{stem}.scales", scales)]
    if zero_points is not None:
        inputs.append(_const(graph, f"{stem}.zero_points", zero_points))
    name = f"{first.name or weight.name}/gguf_{qtype.lower()}"
    attributes = {"K": nb * BLOCK, "N": packed.shape[0], "bits": bits, "block_size": BLOCK}
    matmul = ir.node(
        "MatMulNBits", inputs, attributes={**attributes, "accuracy_level": ACCURACY_LEVEL}, domain=MSFT, name=name
    )
    dtype = first.outputs[0].type or ir.TensorType(ir.DataType.FLOAT)
    out_shape = first.outputs[0].shape
    if out_shape is not None:
        out_shape = ir.Shape([*out_shape[:-1], n])
    new_nodes = [matmul]
    if mins is not None:  # Q4_1: y[:N] + Σ_b m[n, b] · y[N + b], y[N + b] = Σ_{k∈b} x_k
        sizes = _const(graph, f"{stem}.block_sum_sizes", np.array([n, nb], np.int64))
        split = ir.node(
            "Split", [matmul.outputs[0], sizes], attributes={"axis": -1}, num_outputs=2, name=f"{name}/block_sums"
        )
        split.outputs[1].name = f"{split.name}/sums"
        minimums = _const(graph, f"{stem}.mins", mins)  # (K/32, N)
        correction = ir.node("MatMul", [split.outputs[1], minimums], name=f"{name}/block_minimums")
        add = ir.node("Add", [split.outputs[0], correction.outputs[0]], name=f"{name}/plus_minimums")
        new_nodes += [split, correction, add]
        report.exclude.append(correction.name)
    for part in new_nodes:
        part.outputs[0].name = f"{part.name}/output"
    for part in (matmul, new_nodes[-1]):
        part.outputs[0].type, part.outputs[0].shape = dtype, out_shape
    if mins is not None:
        matmul.outputs[0].shape = None if out_shape is None else ir.Shape([*out_shape[:-1], n + nb])
    result = new_nodes[-1].outputs[0]
    outputs = [result]
    if len(group) > 1:
        sizes = _const(graph, f"{name}/sizes", np.array(widths, np.int64))
        split = ir.node("Split", [result, sizes], attributes={"axis": -1}, num_outputs=len(group), name=f"{name}/split")
        new_nodes.append(split)
        outputs = list(split.outputs)
    graph.insert_before(first, new_nodes)
    for (node, _, _), output in zip(group, outputs):
        old = node.outputs[0]
        output.type, output.shape = old.type, old.shape
        old.replace_all_uses_with(output, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        output.name = old.name  # the graph keeps the projection's value name
    report.nodes[name] = list(stacked.tensors)
