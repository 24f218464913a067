"""Weight-only quantization: exported graphs -> graphs whose MatMul weights are int4 or int8.

Input: the ``onnx_ir.Model`` graphs from :mod:`kvforge.compile.export`. Output: the same graphs
with every MatMul against a constant weight replaced by ONNX Runtime's ``MatMulNBits``, made by
ONNX Runtime's own ``MatMulNBitsQuantizer`` (blocked, symmetric, ``accuracy_level=4``: int8
activations inside the kernel, ORT's fast CPU path). Activations, norms, the KV cache and the
embedding table stay in the model's dtype:

* the **lm_head** is a MatMul like the others and is quantized, to 8 bits by default, also under
  int4 (``lm_head``: "int4", "int8" or "float", kept a Gemm in the model's dtype): on a small model
  it is the largest matrix read per decode step (SmolLM-135M: 28M of 135M parameters), and the one
  whose rounding costs the most perplexity (:data:`DEFAULT_LM_HEAD` says what chose int8);
* the **embedding table** is not: a decode step reads one row of it, so quantizing it saves
  memory but no time, and a tied lm_head is a separate (transposed) tensor in the graph anyway.

ORT's quantizer runs on one MatMul at a time (a model of that node alone, spliced back), so only
one float weight is in memory at a time; it quantizes each node on its own, so the bytes are the
ones a run over the whole graph gives. The quantizer is deterministic, so the same weight
quantizes to the same bytes in every graph and the shared weights file still stores it once.
``MatMulNBits`` is an ORT contrib op: quantized artifacts run on ONNX Runtime, not TensorRT.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

QUANTIZE_BITS = {"int4": 4, "int8": 8}
DEFAULT_BLOCK_SIZE = 32
LM_HEADS = ("int4", "int8", "float")  # "float": a Gemm in the model's dtype
# --quantize scheme -> its lm_head unless --lm-head says. int4's lm_head is int8 (OpenVINO's int4
# layout too): on SmolLM2, Genesis, perplexity 10.19 against 10.99 with an int4 lm_head (an fp32 one:
# 10.18), for +14 MiB read per step (80 -> 94) and ~0.8 ms (benchmarks/README.md, the lm_head table).
DEFAULT_LM_HEAD = {"int4": "int8", "int8": "int8"}
# A quantized lm_head's blocks where its input width is a multiple (else --block-size's). ORT's x86
# kernel keeps an fp32 scale and an fp32 block sum beside each block: 10 bits a weight at 8-bit
# blocks of 32, 8.5 at 128, and the lm_head of a large vocabulary is the largest matrix a step reads
# (Qwen3.5-0.8B: 254M of 752M weights). Int4 step ×0.91 on Qwen3.5-0.8B's shape, ×0.97 on LFM2-350M's
# and Granite-4.0-H-350M's; perplexity +0.09% (SmolLM2, 16k tokens of Genesis), +0.00% (kvforge-tiny):
# docs/performance.md, "The lm_head's blocks".
LM_HEAD_BLOCK_SIZE = 128


def check_lm_head(lm_head: str, scheme: str | None, quantize_lm_head: bool = True) -> None:
    """Refuse a ``lm_head`` choice that is not one, or that the other options contradict."""
    if lm_head not in LM_HEADS:
        raise ValueError(f"unknown lm_head precision {lm_head!r}; choose one of {', '.join(LM_HEADS)}")
    if scheme is None:
        raise ValueError(
            f"--lm-head {lm_head} sets the lm_head's precision under --quantize, and there is none; "
            "add --quantize int4 (or int8), or drop --lm-head"
        )
    if not quantize_lm_head and lm_head != "float":
        raise ValueError(f"--no-quantize-lm-head keeps the lm_head float, but --lm-head is {lm_head}; drop one of them")


def check_block_size(block_size: int, what: str = "") -> int:
    """``block_size``, or ValueError if ``MatMulNBits`` cannot take it (a power of two >= 16)."""
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"{what}block size must be a power of two >= 16, got {block_size}")
    return block_size


def check_lm_head_block_size(block_size: int, scheme: str | None, precision: str | None) -> None:
    """Refuse a lm_head block size that is not one, or that has no quantized lm_head to apply to."""
    if scheme is None:
        raise ValueError(
            "--lm-head-block-size sets the lm_head's blocks under --quantize, and there is none; "
            "add --quantize int4 (or int8), or drop it"
        )
    if precision == "float":
        raise ValueError(
            "--lm-head-block-size sets a quantized lm_head's blocks, and the lm_head stays float; drop one of them"
        )
    check_block_size(block_size, "lm_head ")


def lm_head_blocks(block_size: int, lm_head_block_size: int | None, width: int | None) -> int:
    """The block size of a quantized lm_head whose input is ``width`` wide: ``lm_head_block_size``
    when given, else :data:`LM_HEAD_BLOCK_SIZE` where it divides ``width`` and is larger than
    ``block_size`` (the other projections'), else ``block_size`` (no padded block)."""
    if lm_head_block_size is not None:
        return lm_head_block_size
    if width and width % LM_HEAD_BLOCK_SIZE == 0:
        return max(block_size, LM_HEAD_BLOCK_SIZE)
    return block_size


def lm_head_width(model: ir.Model) -> int | None:
    """The input width of ``model``'s lm_head (the Gemm kvforge exports it as), None without one."""
    widths = {weight.const_value.shape[1] for _, weight in _lm_head_gemms(model)}
    return widths.pop() if len(widths) == 1 else None


def lm_head_precision(scheme: str, lm_head: str | None) -> str:
    """The lm_head's precision under ``scheme``: ``lm_head`` when given, else the scheme's default."""
    return lm_head or DEFAULT_LM_HEAD[scheme]


def quantize(
    models: dict[str, ir.Model],
    scheme: str,
    block_size: int = DEFAULT_BLOCK_SIZE,
    exclude: list[str] | None = None,
    *,
    symmetric: bool = True,
    lm_head: str | None = None,
    lm_head_block_size: int | None = None,
) -> dict[str, ir.Model]:
    """Quantize the MatMul weights of every graph to ``scheme`` ("int4" or "int8"), except the
    nodes named in ``exclude`` (a GGUF Q4_1 projection's block-minimum MatMul: already exact):
    symmetric blocks (``symmetric=False``: a zero point per block, ORT's asymmetric MatMulNBits).
    The lm_head (the Gemm kvforge exports it as) to ``lm_head``: "int4" or "int8" (a MatMulNBits
    of those bits), "float" (it stays a Gemm in the model's dtype), None: the scheme's own
    (:data:`DEFAULT_LM_HEAD`); in blocks of ``lm_head_block_size`` (None: :func:`lm_head_blocks`'s).
    In place: returns the same models, each MatMul node replaced as it is quantized (one node at a
    time, each at its own bits and blocks)."""
    if scheme not in QUANTIZE_BITS:
        raise ValueError(f"unknown quantization {scheme!r}; choose one of {', '.join(QUANTIZE_BITS)}")
    if lm_head is not None:
        check_lm_head(lm_head, scheme)
    check_block_size(block_size)
    if lm_head_block_size is not None:
        check_block_size(lm_head_block_size, "lm_head ")
    head = lm_head_precision(scheme, lm_head)
    MatMulNBitsQuantizer = _import_quantizer()
    skipped = set(exclude or [])
    for model in models.values():
        heads = set() if head == "float" else set(_lm_head_as_matmul(model))
        done: dict = {}  # (weight, bits, block) -> the quantized node made for it: a shared weight is quantized once
        for node in list(model.graph):
            if node.name in skipped or not _constant_matmul(node):
                continue
            is_head = node.name in heads
            bits = QUANTIZE_BITS[head if is_head else scheme]
            block = lm_head_blocks(block_size, lm_head_block_size, node.inputs[1].shape[0]) if is_head else block_size
            settings = dict(bits=bits, block_size=block, is_symmetric=symmetric, accuracy_level=4)
            key = (node.inputs[1], bits, block)
            if key in done:
                _reuse(model, node, done[key])
            else:
                done[key] = _quantize_node(model, node, MatMulNBitsQuantizer, settings)
    return dict(models)


def _reuse(model: ir.Model, node: ir.Node, quantized: ir.Node | None) -> None:
    """Replace ``node`` (a MatMul of a weight another node already read) by a copy of ``quantized``,
    the MatMulNBits made for that node, reading the same quantized initializers (Zamba2's shared
    attention block: one weight, a MatMul at each layer that runs it); None: it stayed a MatMul."""
    if quantized is None:
        return
    name = f"{node.name}_Q{quantized.attributes['bits'].value}"
    _splice(model, node, quantized, [node.inputs[0], *quantized.inputs[1:]], name)


def _splice(model: ir.Model, node: ir.Node, like: ir.Node, inputs: list, name: str) -> ir.Node:
    """Put a node of ``like``'s op and attributes, reading ``inputs``, in place of the MatMul
    ``node`` (its output keeps its name); drop the float weight once nothing reads it."""
    weight, y = node.inputs[1], node.outputs[0]
    attributes = [ir.Attr(a.name, a.type, a.value) for a in like.attributes.values()]
    replacement = ir.Node(like.domain, like.op_type, inputs, attributes, name=name, num_outputs=1)
    replacement.outputs[0].name, replacement.outputs[0].type = y.name + "_q", y.type
    replacement.outputs[0].shape = y.shape
    model.graph.insert_before(node, replacement)
    y.replace_all_uses_with(replacement.outputs[0], replace_graph_outputs=True)
    model.graph.remove(node, safe=True)
    replacement.outputs[0].name = y.name
    if not weight.uses() and not weight.is_graph_output():
        model.graph.initializers.pop(weight.name, None)
    return replacement


def _constant_matmul(node: ir.Node) -> bool:
    weight = node.inputs[1] if node.op_type == "MatMul" and node.domain in ("", "ai.onnx") else None
    return weight is not None and weight.const_value is not None and len(weight.const_value.shape) == 2


def _quantize_node(model: ir.Model, node: ir.Node, quantizer_class, settings: dict) -> ir.Node | None:
    """ORT's quantizer on a model of this one MatMul, spliced back in place of the node: one
    float weight in memory at a time (a lazy weight is read here, its quantized bytes kept), never
    the whole float model serialized. The same bytes as the quantizer run on the whole graph: it
    quantizes each MatMul on its own. Returns the node made (None: the quantizer left it)."""
    x, weight = node.inputs[0], node.inputs[1]
    y = node.outputs[0]
    x_in = ir.Value(name=x.name, type=x.type, shape=x.shape)
    w_init = ir.Value(name=weight.name, type=weight.type, shape=weight.shape, const_value=weight.const_value)
    single = ir.Node("", "MatMul", [x_in, w_init], name=node.name, num_outputs=1)
    y_out = single.outputs[0]
    y_out.name, y_out.type, y_out.shape = y.name, y.type, y.shape
    graph = ir.Graph([x_in], [y_out], nodes=[single], initializers=[w_init], opset_imports=model.opset_imports)
    proto = ir.serde.serialize_model(ir.Model(graph, ir_version=model.ir_version))
    del graph, single, w_init
    quantizer = quantizer_class(proto, **settings)
    quantizer.process()
    quantized = ir.serde.deserialize_model(quantizer.model.model)
    del proto, quantizer
    [new] = list(quantized.graph)
    if new.op_type == "MatMul":
        return None  # the quantizer left it (a shape it does not quantize)
    inputs = []
    for value in new.inputs:
        if value is None:
            inputs.append(None)
        elif value.name == x.name:
            inputs.append(x)
        else:
            # a copy of its own: the deserialized tensor would keep the quantizer's whole proto alive
            data = ir.Tensor(np.array(value.const_value.numpy()), dtype=value.const_value.dtype, name=value.name)
            own = ir.Value(name=value.name, type=value.type, shape=value.shape, const_value=data)
            model.graph.register_initializer(own)
            inputs.append(own)
    for domain, version in quantized.opset_imports.items():
        model.opset_imports.setdefault(domain, version)
    return _splice(model, node, new, inputs, new.name)


def _import_quantizer():
    """ORT's quantizer module calls ``logging.basicConfig(level=INFO)`` on import, which would make
    every library log at INFO in the user's process; undo exactly that."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    for handler in root.handlers[len(handlers) :]:
        root.removeHandler(handler)
    root.setLevel(level)
    return MatMulNBitsQuantizer


def _lm_head_gemms(model: ir.Model):
    """``(node, weight)`` of each ``Gemm(x, W, transB=1)`` with a constant ``W`` (the lm_head)."""
    for node in list(model.graph):
        if node.op_type != "Gemm" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        attrs = {k: a.value for k, a in node.attributes.items()}
        weight = node.inputs[1]
        if attrs.get("transB", 0) != 1 or attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0:
            continue
        if weight is not None and weight.const_value is not None:
            yield node, weight


def _lm_head_as_matmul(model: ir.Model) -> list[str]:
    """Rewrite ``Gemm(x, W, transB=1)`` with a constant ``W [V, H]`` (how kvforge exports the
    lm_head, to avoid a transposed copy) into ``MatMul(x, W^T)``, which ORT's quantizer turns into
    ``MatMulNBits``. The fp32 ``W`` stays only where another node (a tied embedding) reads it.
    Returns the names of the MatMul nodes made."""
    import numpy as np

    made = []
    for node, weight in _lm_head_gemms(model):
        source, name = weight.const_value, f"{weight.name}.T"
        lazy = ir.LazyTensor(
            lambda source=source, name=name: ir.Tensor(np.ascontiguousarray(source.numpy().T), name=name),
            dtype=source.dtype,
            shape=ir.Shape([source.shape[1], source.shape[0]]),
            name=name,
        )
        transposed = ir.Value(name=name, shape=lazy.shape, type=weight.type, const_value=lazy)
        model.graph.register_initializer(transposed)
        matmul = ir.node("MatMul", inputs=[node.inputs[0], transposed], name=f"{node.name}/as_matmul")
        model.graph.insert_before(node, matmul)
        node.outputs[0].replace_all_uses_with(matmul.outputs[0], replace_graph_outputs=True)
        model.graph.remove(node, safe=True)
        made.append(matmul.name)
    return made


def never_one_row(model: ir.Model) -> int:
    """Give every ``MatMulNBits`` of ``model`` at least two rows (the ``exact`` lowering's int4):
    its input ``[..., K]`` is viewed as ``[M, K]``, padded with a row of zeros when ``M = 1``, and
    the product's first ``M`` rows are viewed back as ``[..., N]``. MLAS computes a row the same way
    at any ``M >= 2`` (whatever the other rows hold) but takes another kernel at ``M = 1`` on some
    CPUs (an AVX2-only AMD EPYC: 3e-5 apart at accuracy level 4), so without this a one-token step
    and a verify call of the same tokens would differ in the last bits. A prefill pads nothing
    (``M`` is its token count) and copies its activations once. Returns how many were wrapped."""
    nodes = [n for n in model.graph if n.op_type == "MatMulNBits" and n.domain == "com.microsoft"]
    for node in nodes:
        _two_rows(model.graph, node)
    return len(nodes)


def _two_rows(graph: ir.Graph, node: ir.Node) -> None:
    """:func:`never_one_row` for one ``MatMulNBits`` node, replaced in ``graph``."""
    x, out = node.inputs[0], node.outputs[0]
    k, n = node.attributes["K"].value, node.attributes["N"].value
    made: list[ir.Node] = []

    def add(op: str, inputs: list[ir.Value], attributes: dict | None = None, **kwargs) -> ir.Value:
        made.append(ir.node(op, inputs, attributes, **kwargs))
        return made[-1].outputs[0]

    def ints(*values: int) -> ir.Value:
        return add("Constant", [], {"value": ir.tensor(list(values), dtype=ir.DataType.INT64)})

    shape = add("Shape", [x])  # [..., K]
    rows = add("Reshape", [x, ints(-1, k)])  # (M, K)
    m = add("Shape", [rows], {"start": 0, "end": 1})  # [1]: M
    extra = add("Max", [add("Sub", [ints(2), m]), ints(0)])  # [1]: 1 when M = 1, else 0
    padded = add("Pad", [rows, add("Concat", [ints(0, 0), extra, ints(0)], {"axis": 0})])  # (max(M, 2), K)
    attrs = {name: attr.value for name, attr in node.attributes.items()}
    product = add("MatMulNBits", [padded, *node.inputs[1:]], attrs, domain="com.microsoft")  # (max(M, 2), N)
    first = add("Slice", [product, ints(0), m, ints(0)])  # (M, N)
    outer = add("Slice", [shape, ints(0), ints(-1), ints(0)])  # [...]
    result = add("Reshape", [first, add("Concat", [outer, ints(n)], {"axis": 0})])  # [..., N]
    for i, new in enumerate(made):
        new.name = f"{node.name}/two_rows/{new.op_type}_{i}"
        new.outputs[0].name = f"{new.name}/out"
    result.shape, result.type = out.shape, out.type
    graph.insert_before(node, made)
    out.replace_all_uses_with(result, replace_graph_outputs=True)
    graph.remove(node, safe=True)
