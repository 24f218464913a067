"""Stage: the one traced general graph -> the contract's prefill, decode and score graphs.

Input: an ``onnx_ir.Model`` made by :func:`kvforge.compile.export.export_general` (or the same graph
after :mod:`kvforge.compile.optimize`'s passes): inputs ``input_ids [batch, seq]``,
``position_ids [batch, seq]``, ``write_indices [batch]``, ``logit_indices [batch, positions]``
(int64), the pasts; outputs ``logits [batch, positions, V]``, the presents. Output: one new model
per contract graph (a clone: the weights' tensor objects are shared, never copied), whose I/O is
exactly :mod:`kvforge.graphs.contract`'s. The model is traced once; each graph is this rewrite:

* **prefill**: ``logit_indices := Unsqueeze(input_lengths - 1, [1])`` (``input_lengths [batch]``
  takes its place among the inputs), ``logits := Squeeze(logits, [1])``: ``[batch, V]``, the
  logits of each row's last real token;
* **decode**: ``input_ids``/``position_ids`` become ``[batch, 1]``, ``logit_indices := zeros
  [batch, 1]`` (the one new token), ``logits := Squeeze(logits, [1])``;
* **score**: ``logit_indices := [0, 1, ..., seq - 1]`` per row, ``logits [batch, seq, V]``;
* **verify**: no rewrite: the general graph itself (``logit_indices [batch, positions]`` in,
  ``logits [batch, positions, V]`` out). Prefill (the last real token), decode (index 0) and
  speculative verification (every drafted position) are its cases, so the runtime's one session
  runs all three on it when speculative decoding is on (schema 2).

The replacement nodes are standard ONNX (``Sub``, ``Unsqueeze``/``Squeeze`` with constant axes,
``ConstantOfShape``, ``Range``, ``Expand``): all in TensorRT's ONNX parser table, so the ``onnx``
lowering's graphs stay TensorRT-clean. Value shapes inside the graph that named the ``positions``
dim (or ``seq``, in decode) are rewritten to the graph's own dims, or left unknown where they were
an expression of them.
"""

from __future__ import annotations

import re

import numpy as np
import onnx_ir as ir

from kvforge.compile.export import LOGIT_INDICES, POSITIONS_DIM
from kvforge.graphs import contract

GRAPHS = contract.GRAPHS


def derive(general: ir.Model, graph: str) -> ir.Model:
    """A new model: ``general`` rewritten into the contract graph ``graph`` ("prefill", "decode",
    "score", "verify"). ``general`` is left unchanged; the two share their tensors."""
    if graph not in GRAPHS:
        raise ValueError(f"unknown graph {graph!r}; choose one of {', '.join(GRAPHS)}")
    model = general.clone()
    if graph == "verify":
        return model
    g = model.graph
    inputs = {v.name: v for v in g.inputs}
    if LOGIT_INDICES not in inputs:
        raise ValueError(f"not a general graph: it has no {LOGIT_INDICES!r} input (inputs: {', '.join(inputs)})")
    indices, input_ids = inputs[LOGIT_INDICES], inputs[contract.INPUT_IDS]
    batch = input_ids.shape[0]
    at = g.inputs.index(indices)
    nodes: list[ir.Node] = []

    def add(op_type: str, inputs_: list, name: str, **attributes) -> ir.Value:
        node = ir.node(op_type, inputs_, attributes or None, name=f"/model/{graph}_logit_indices/{name}")
        node.outputs[0].name = f"/model/{graph}_logit_indices/{name}_output"
        nodes.append(node)
        return node.outputs[0]

    def constant(name: str, value: np.ndarray) -> ir.Value:
        return add("Constant", [], name, value=ir.tensor(value, name=name))

    if graph == "prefill":  # each row's last real token: input_lengths - 1
        lengths = ir.Value(name=contract.INPUT_LENGTHS, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([batch]))
        g.inputs[at] = lengths
        last = add("Sub", [lengths, constant("one", np.array([1], np.int64))], "last")  # (batch,)
        picks = add("Unsqueeze", [last, constant("axes", np.array([1], np.int64))], "picks")  # (batch, 1)
        dims = {POSITIONS_DIM: 1}
    elif graph == "decode":  # the one new token of each row: index 0
        g.inputs.pop(at)
        for name in (contract.INPUT_IDS, contract.POSITION_IDS):
            inputs[name].shape = ir.Shape([batch, 1])
        shape = add("Shape", [input_ids], "shape")  # [batch, 1]
        zero = ir.tensor(np.array([0], np.int64), name="zero")
        picks = add("ConstantOfShape", [shape], "picks", value=zero)  # (batch, 1)
        dims = {POSITIONS_DIM: 1, "seq": 1}
    else:  # score: every position
        g.inputs.pop(at)
        shape = add("Shape", [input_ids], "shape")  # [batch, seq]
        seq = add("Gather", [shape, constant("seq_axis", np.array(1, np.int64))], "seq", axis=0)  # ()
        start, step = constant("start", np.array(0, np.int64)), constant("step", np.array(1, np.int64))
        positions = add("Range", [start, seq, step], "range")  # (seq,)
        row = add("Unsqueeze", [positions, constant("axes", np.array([0], np.int64))], "row")  # (1, seq)
        picks = add("Expand", [row, shape], "picks")  # (batch, seq)
        dims = {POSITIONS_DIM: "seq"}
    picks.dtype, picks.shape = ir.DataType.INT64, ir.Shape([batch, 1 if graph != "score" else "seq"])
    g.insert_before(next(iter(g)), nodes)
    indices.replace_all_uses_with(picks)

    if graph != "score":  # [batch, 1, V] -> [batch, V]
        at = [v.name for v in g.outputs].index(contract.LOGITS)
        logits = g.outputs[at]
        logits.name = f"{contract.LOGITS}_at_picks"
        axes = ir.node("Constant", [], {"value": ir.tensor(np.array([1], np.int64), name="axes")})
        axes.name = f"/model/{graph}_logits/squeeze_axes"
        axes.outputs[0].name = f"/model/{graph}_logits/squeeze_axes_output"
        squeeze = ir.node("Squeeze", [logits, axes.outputs[0]], name=f"/model/{graph}_logits/squeeze")
        out = squeeze.outputs[0]
        out.name, out.dtype = contract.LOGITS, logits.dtype
        out.shape = ir.Shape([batch, logits.shape[-1]]) if logits.shape is not None else None
        g.extend([axes, squeeze])
        g.outputs[at] = out
    _substitute_dims(g, dims)
    return model


def _substitute_dims(graph: ir.Graph, dims: dict[str, int | str]) -> None:
    """Rename the symbolic dims ``dims`` names in every value's shape; a dim that is an expression
    of one of them (``seq + capacity``) becomes unknown."""
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, dims)) + r")\b")
    values = [*graph.inputs, *(out for node in graph for out in node.outputs)]
    for value in values:
        shape = value.shape
        named = [d.value for d in shape or () if isinstance(d, ir.SymbolicDim) and d.value]
        if not any(pattern.search(name) for name in named):
            continue
        new = []
        for d in shape:
            name = d.value if isinstance(d, ir.SymbolicDim) else None
            if name in dims:
                new.append(dims[name])
            elif name and pattern.search(name):
                new.append(None)
            else:
                new.append(d)
        value.shape = ir.Shape(new)
