"""Prefill on ONNX Runtime's integer GEMM, decode on its int4 kernel: ``Engine.load(prefill="int8")``.

Why. ORT's int4 kernel (``MatMulNBits``, int8 activations a block of 32) reads few bytes a weight,
which makes decode fast, but over many tokens it is slower than ORT's own fp32 GEMM on these CPUs,
while ORT's 8-bit integer GEMM (``MatMulInteger``'s kernel, u8 x s8 on VNNI / AMX) is 2-5x faster
than either: SmolLM2-135M's gate|up projection at 128 tokens, 2 threads, 2.94 ms int4, 1.44 fp32,
0.58 int8 (``python -m benchmarks int8-prefill``). Through the engine an int4 SmolLM2 prefills 128
tokens in 0.34x the time and 1024 in 0.40x (attention, untouched, is a larger share of the longer
prompt), a 1.39B Llama in 0.27x / 0.28x: under OpenVINO GenAI's time to first token but for SmolLM2
at 1024 tokens, x1.14 (docs/performance.md, "An int8 prefill for int4 artifacts").

What runs. At load, the artifact's prefill graph is rewritten in memory into a second graph with
each symmetric 4-bit ``MatMulNBits`` projection replaced by: the activations quantized to int8 per
token (a step per row: ``max|x| / 127``, offset by 128 to the u8 ORT's kernel takes; one blocked
``QuantizeLinear``), ``MatMulIntegerToFloat`` against int8 weights with a step per output channel
(applied in the GEMM's pass), and the tokens' steps (one ``Mul``). The int8 weights are the int4
weights themselves (each block dequantized, then rounded per output channel to 8 bits, which moves
them by at most half an 8-bit step), so the prompt's pass computes the same model as the decode
steps: what differs is the rounding of the activations (per token, where the int4 kernel rounds a
block of 32 channels) and the weights' second rounding (a GGUF file's Q4_0 blocks are such
projections too). Other nodes (the 8-bit lm_head, blocks with zero points: ``--asymmetric``, GGUF
Q4_1; attention, norms, model state) are the prefill graph's own. The int8 weights are converted a
projection per thread on the engine's threads (the 1.39B's in 5.4 s at 2 threads, 11.8 s before) into
a temporary file, which the session reads and packs (as it does the artifact's weights file) and
which is removed once it has.

Smoothing (SmoothQuant's migration, Xiao et al. 2022). A per-token step rounds the channels beside
an outlier coarsely, and a model's activations have a few channels tens of times the median. At load
(:func:`activation_ranges`) the prefill graph runs once on 256 tokens of the bundled text
(``kvforge/tools/data/text.txt``) with each projection's input as an extra output, and each input
channel gets a factor ``s = sqrt(max|x|) / sqrt(max|w|)`` (:func:`smoothing`): the weights are
rounded to int8 times ``s`` and the activations divided by it, which halves their spread across
channels and leaves the product as it was. The division costs no pass where it folds: into the RMS
norm's scale that makes a q|k|v or gate|up input, and into the up columns' steps of the projection
whose ``act(gate) * up`` is the down projection's input; elsewhere (the attention output that o_proj
reads) it is one ``Mul``. (An artifact without a tokenizer is rounded per token, unsmoothed.) TTFT
is unchanged (SmolLM2 at 128 / 1024 tokens, one process taking turns: 65.8 / 664 ms smoothed against
67.4 / 661 without); an artifact's first such load takes one more session and call (SmolLM2 +0.7 s,
the 1.39B +10 s; peak RSS +80 / +230 MiB), and keeps the ranges in ``$KVFORGE_CACHE/calibration``
(:func:`cached_ranges`, keyed by the graph, its weights, the calibration ids, the prompt chunk and
the versions of kvforge and ONNX Runtime), which later loads read instead.

Quality. SmolLM2-135M int4 scored on Genesis (4,096 tokens, windows of 512) through the score graph
rewritten the same way: perplexity 10.38 against the int4 graph's 10.19 (+1.8%; teacher-forced
argmax agreement 91%), without the smoothing 10.62 (+4.2%, 87%); on 16,384 tokens 16.44 and 16.77
against 16.20 (+1.5% / +3.6%). (Without the floor on quiet channels, :func:`smoothing`: 10.31 and
16.44.) The weights' second rounding alone costs 10.19 -> 10.20. It is the prompt's pass that pays
it (its K/V and the first token's logits); the generated tokens are the int4 decode step's. So it is
an option, not the default.

Which calls. A prefill call whose every row has at least ``min_tokens`` (2) tokens runs the int8
graph; decode steps and any call with a one-token row run the artifact's own graphs. A row's result
does not depend on the other rows' tokens (each token's activations are rounded on their own), but a
one-token chunk, or a ragged batch with a one-token row, takes the int4 path. With speculative
decoding the prompts go to the int8 graph and the verify steps stay on the verify graph, as with the
OpenVINO prefill (:mod:`kvforge.runtime.ov_prefill`). Memory: one more session, holding ORT's packed
copy of the int8 weights and of the lm_head; peak RSS SmolLM2-135M 290 -> 506 MiB, the 1.39B 1387 ->
2989 with the calibration's session (OpenVINO GenAI: 396, 1948); load writes the int8 weights to a
temporary file first (``tempfile``'s folder; 1.2 GB at 1.39B). Refused: artifacts with no symmetric
4-bit projection (fp32, fp16, ``--quantize int8``), and ``prepack=False``.

``prefill="fp32"``: the same calls run the prefill graph with every 4-bit ``MatMulNBits`` at
accuracy level 1 (:func:`float_activations`): ORT's fp32 kernel over the same int4 weights, no
rounding of the prompt's activations at all (the int4 graph, level 4, rounds them to int8 a block
of 32), so the prompt's pass is the int4 model computed exactly. Whether it is faster depends on
the CPU: on an Intel Xeon with AVX512-VNNI and no AMX, 2 threads, the projections at 128-1024 tokens
run in 0.4-0.8x level 4's time, SmolLM2-135M's prompts in 0.67x / 0.77x at 128 / 1024 tokens and a
1.39B Llama's in 0.82x; on a Xeon with AMX level 1 was 1.11-1.15x slower (benchmarks/FINDINGS.md).
The prompt's pass scores perplexity 10.18 against the int4 graph's 10.19 (SmolLM2, Genesis). No new
weights, but the session packs the artifact's int4 blocks again for its kernel (peak RSS SmolLM2 278
-> 384 MiB, the 1.39B 1375 -> 2262). Refused: artifacts with no 4-bit projection, ``prepack=False``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext, suppress
from pathlib import Path

import numpy as np

from kvforge.graphs import contract

GRAPH = "prefill.rewritten"  # the backend's name for the rewritten graph (int8 or fp32)
MIN_TOKENS = 2  # a prefill call runs here when every row has at least this many tokens
CALIBRATION_TOKENS = 256  # of the bundled text, for the activations' ranges (activation_ranges; all ~400: no better)
CALIBRATION_DAYS = 90  # a stored calibration no load has read for this long is removed (cached_ranges)
CALIBRATION_METHOD = 1  # part of a stored calibration's key: bump it when activation_ranges measures differently

log = logging.getLogger("kvforge.runtime")


def _tensor(init, graph_file: Path) -> np.ndarray:
    """An initializer's values, read from the file beside ``graph_file`` where it is external."""
    import onnx

    from kvforge.runtime.ort_backend import external_location

    if init.data_location != onnx.TensorProto.EXTERNAL:
        return onnx.numpy_helper.to_array(init)
    file, offset, length = external_location(init, graph_file)
    with open(file, "rb") as f:
        f.seek(offset)
        raw = f.read(length)
    return np.frombuffer(raw, dtype=onnx.helper.tensor_dtype_to_np_dtype(init.data_type)).reshape(tuple(init.dims))


def dequantized_rows(blocks: np.ndarray, scales: np.ndarray, k: int, n: int, block_size: int, rows: int = 256):
    """A symmetric 4-bit ``MatMulNBits`` weight (``blocks`` ``[N, K/bs, bs/2]`` u8, two codes a byte,
    low nibble first, zero point 8; ``scales`` one a block) as float32, ``rows`` output channels at a
    time: (the first channel, ``[rows, K]``), each piece in the same buffer (use it before the next).
    Pieces that stay in the cache, and byte arithmetic before one conversion to float, take a 1.39B
    model's weights in a tenth of the time of whole arrays and a lookup table."""
    codes = blocks.reshape(n, -1)  # [N, K_padded / 2]
    scales = scales.reshape(n, -1, 1).astype(np.float32, copy=False)
    blocks_per_row = scales.shape[1]
    q = np.empty((min(rows, n), codes.shape[1], 2), np.int8)
    w = np.empty((min(rows, n), blocks_per_row, block_size), np.float32)
    for first in range(0, n, rows):
        piece = codes[first : first + rows]
        m = len(piece)
        np.bitwise_and(piece, 15, out=q[:m, :, 0].view(np.uint8))
        np.right_shift(piece, 4, out=q[:m, :, 1].view(np.uint8))
        q[:m] -= 8
        np.multiply(q[:m].reshape(m, blocks_per_row, block_size), scales[first : first + m], out=w[:m])
        yield first, w[:m].reshape(m, -1)[:, :k]


def int8_weights(blocks: np.ndarray, scales: np.ndarray, k: int, n: int, block_size: int, smooth=None):
    """A symmetric 4-bit ``MatMulNBits`` weight (see :func:`dequantized_rows`) as int8 ``[K, N]`` and a
    scale per output channel ``[N]``: each channel's dequantized values (times ``smooth`` ``[K]``, a
    factor per input channel, where given) rounded to ``max|w| / 127`` steps."""
    w8, steps = np.empty((k, n), np.int8), np.empty(n, np.float32)
    for first, w in dequantized_rows(blocks, scales, k, n, block_size):
        if smooth is not None:
            w *= smooth[None, :]
        step = np.abs(w).max(axis=1) / 127
        step[step == 0] = 1
        w /= step[:, None]
        w8[:, first : first + len(w)] = np.rint(w, out=w).T
        steps[first : first + len(w)] = step
    return w8, steps


def weight_ranges(blocks: np.ndarray, scales: np.ndarray, k: int, n: int, block_size: int) -> np.ndarray:
    """A symmetric 4-bit weight's largest magnitude per input channel, ``[K]``."""
    ranges = np.zeros(k, np.float32)
    for _, w in dequantized_rows(blocks, scales, k, n, block_size):
        np.maximum(ranges, np.abs(w).max(axis=0), out=ranges)
    return ranges


def _is_projection(node) -> bool:
    """Whether ``node`` is a symmetric 4-bit ``MatMulNBits`` (no zero points), what :func:`rewrite` takes."""
    from onnx import helper

    if node.op_type != "MatMulNBits" or len(node.input) != 3:
        return False
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == "bits"), None) == 4


def smoothing(ranges: np.ndarray, weight_ranges: np.ndarray) -> np.ndarray:
    """SmoothQuant's per-channel factors ``s = sqrt(max|x|) / sqrt(max|w|)`` for one activation
    (``ranges`` ``[K]``, its calibrated largest magnitude per channel) and the weights that read it
    (``weight_ranges`` ``[K]``, their largest magnitude per input channel): ``x / s`` and ``s * w``
    have the same product and both half the activation's spread across channels, so a step per
    token rounds the quiet channels beside an outlier less coarsely. A channel the calibration saw
    below a tenth of the median channel counts as that tenth (125 of SmolLM2's 97,920 input channels,
    down to 0.0006 of the median): its factor must not multiply by hundreds an input the calibration
    text never exercised."""
    ranges = np.maximum(ranges, 0.1 * np.median(ranges))
    s = np.sqrt(np.maximum(ranges, 1e-5)) / np.sqrt(np.maximum(weight_ranges, 1e-5))
    return s.astype(np.float32)


def rewrite(
    graph_file: Path, data_file: Path, ranges: dict[str, np.ndarray] | None = None, threads: int | None = None
) -> tuple[bytes, Path, int]:
    """``graph_file`` with its symmetric 4-bit projections on the integer GEMM: (the graph as bytes,
    the folder its external data paths are relative to, the number of projections rewritten). The
    new int8 weights and steps are written to ``data_file`` one projection at a time (never all in
    memory); the artifact's own weights stay in its weights file. Load the bytes with ORT's
    ``session.model_external_initializers_file_folder_path`` set to the folder returned.

    ``ranges`` (:func:`activation_ranges`: a projection input's name -> its largest magnitude per
    channel) smooths each input it names (:func:`smoothing`): its weights are rounded to int8 times
    the factors, and the input divided by them with no pass of its own where that folds (the scale
    of the RMS norm that makes it: :func:`_norm_folds`; the steps of the up columns whose product
    with ``act(gate)`` it is: :func:`_column_folds`), else by one ``Mul``. ``threads``: projections
    converted at once (numpy lets go of the GIL in its loops; default: the CPU's cores)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(str(graph_file), load_external_data=False)
    graph = model.graph
    inits = {init.name: init for init in graph.initializer}
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 21:  # kvforge exports opset 24; blocked QuantizeLinear is opset 21
        raise ValueError(f"{graph_file.name} imports ONNX opset {opset}; prefill='int8' needs 21 or later (recompile)")
    projections = [node for node in graph.node if _is_projection(node)]

    def weight(node) -> tuple[np.ndarray, np.ndarray, int, int, int]:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        blocks, scales = (_tensor(inits[name], graph_file) for name in node.input[1:])
        return blocks, scales, attrs["K"], attrs["N"], attrs["block_size"]

    pool = ThreadPoolExecutor(max_workers=threads or os.cpu_count() or 1)
    try:
        smoothed = sorted({node.input[0] for node in projections} & set(ranges or ()))
        readers = [node for node in projections if node.input[0] in (ranges or {})]
        widest = {}  # a smoothed input -> its weights' largest magnitude per channel, over all its readers
        for node, column in zip(readers, pool.map(lambda node: weight_ranges(*weight(node)), readers)):
            x = node.input[0]
            widest[x] = np.maximum(widest[x], column) if x in widest else column
        factors = {x: smoothing(ranges[x], widest[x]) for x in smoothed}  # one set for all its readers
        reads = Counter(name for node in graph.node for name in _names_read([node]))  # readers of each name
        by_projections = Counter(node.input[0] for node in projections)
        outputs = {value.name for value in graph.output}
        private = {x for x in factors if reads[x] == by_projections[x] and x not in outputs}  # the projections' alone
        norms = _norm_folds(graph, private, inits)
        columns = _column_folds(graph, projections, {x: factors[x] for x in private - set(norms)}, reads, inits)
        folded = set(norms) | {x for x, _, _ in columns.values()}  # divided with no pass of their own
        # One folder above both files: ORT refuses external data outside the folder it is given.
        root = Path(os.path.commonpath([data_file.resolve().parent, graph_file.resolve().parent]))
        location = os.path.relpath(data_file.resolve(), root)
        nodes, declared, divided = [], [], set()
        with open(data_file, "wb") as data:

            def declare(name: str, array: np.ndarray) -> None:
                offset = data.tell()
                data.write(array.tobytes())
                tensor = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype))
                tensor.dims.extend(array.shape)
                tensor.data_location = TensorProto.EXTERNAL
                for key, value in (("location", location), ("offset", str(offset)), ("length", str(array.nbytes))):
                    tensor.external_data.add(key=key, value=value)
                declared.append(tensor)

            def converted(node) -> tuple[np.ndarray, np.ndarray]:
                blocks, scales, k, n, bs = weight(node)
                return int8_weights(blocks, scales, k, n, bs, smooth=factors.get(node.input[0]))

            weights = pool.map(converted, projections)  # in the graph's order, a few at a time
            for node in graph.node:
                if node.output and node.output[0] in norms:  # the norm's scale divided by the factors
                    index = norms[node.output[0]]
                    gamma = _tensor(inits[node.input[index]], graph_file)
                    node.input[index] = f"{node.output[0]}.smoothed_scale"
                    declare(node.input[index], (gamma / factors[node.output[0]]).astype(gamma.dtype))
                if not _is_projection(node):
                    nodes.append(node)  # not a symmetric 4-bit projection: the graph's own node
                    continue
                p, x, y = f"{node.name}.int8", node.input[0], node.output[0]
                if x in factors and x not in folded:  # one Mul per smoothed input, before its first reader
                    if x not in divided:
                        declare(f"{x}.inverse_factors", 1 / factors[x])
                        nodes.append(helper.make_node("Mul", [x, f"{x}.inverse_factors"], [f"{x}.smoothed"]))
                        divided.add(x)
                    x = f"{x}.smoothed"
                k = next(a.i for a in node.attribute if a.name == "K")
                w, step = next(weights)
                if node.output[0] in columns:  # its columns [start, stop) are the next product's smoothed input
                    x_next, start, stop = columns[node.output[0]]
                    step[start:stop] /= factors[x_next]
                declare(p + ".w", w)
                declare(p + ".step", step)
                nodes += _integer_projection(p, x, y, k)
        for init in graph.initializer:  # the artifact's own external data, now relative to root
            for entry in init.external_data:
                if entry.key == "location":
                    entry.value = os.path.relpath((graph_file.parent / entry.value).resolve(), root)
        if projections:
            del graph.node[:]
            graph.node.extend(nodes)
            used = _names_read(nodes)
            kept = [init for init in graph.initializer if init.name in used]  # not the int4 blocks replaced
            del graph.initializer[:]
            consts = [numpy_helper.from_array(v, name) for name, v in _CONSTS.items() if name in used]
            graph.initializer.extend([*kept, *consts, *declared])
        return model.SerializeToString(), root, len(projections)
    finally:  # an error: the queued conversions dropped, the running ones waited for
        pool.shutdown(cancel_futures=True)


# RMS norms whose scale (input at this index) multiplies output 0 last: a smoothing divides it.
_NORM_SCALE = {"SimplifiedLayerNormalization": 1, "SkipSimplifiedLayerNormalization": 2, "RMSNormalization": 1}


def _column_folds(graph, projections, factors: dict, reads: Counter, inits: dict) -> dict[str, tuple[str, int, int]]:
    """Of the smoothed inputs ``factors`` names (each read by the projections alone), those that are an
    elementwise product (a gated MLP's ``act(gate) * up``) one of whose operands is a projection's
    output, or a last-axis ``Split`` of one, read by nothing else (``reads``: readers per name): that
    projection's output name -> (the input, the operand's first and end column in the output).
    Dividing those columns' steps divides the product by the factors."""
    from onnx import helper, numpy_helper

    made_by = {name: node for node in graph.node for name in node.output}
    widths = {
        node.output[0]: helper.get_attribute_value(next(a for a in node.attribute if a.name == "N"))
        for node in projections
    }
    columns = {}
    for x, factors_x in factors.items():
        product = made_by.get(x)
        if product is None or product.op_type != "Mul":
            continue
        for operand in product.input:
            source = made_by.get(operand)
            if reads[operand] != 1 or source is None:
                continue
            if operand in widths:
                y, start, stop = operand, 0, widths[operand]
            elif source.op_type == "Split" and source.input[0] in widths and reads[source.input[0]] == 1:
                axis = next((helper.get_attribute_value(a) for a in source.attribute if a.name == "axis"), 0)
                if axis != -1 or len(source.input) < 2 or source.input[1] not in inits:
                    continue
                sizes = numpy_helper.to_array(inits[source.input[1]]).tolist()
                index = list(source.output).index(operand)
                y, start = source.input[0], sum(sizes[:index])
                stop = start + sizes[index]
            else:
                continue
            if stop - start == len(factors_x) and y not in columns:
                columns[y] = (x, start, stop)
                break
    return columns


def _norm_folds(graph, private: set[str], inits: dict) -> dict[str, int]:
    """Of the smoothed inputs ``private`` names (each read by the projections alone), those an RMS norm
    makes (its output 0) whose scale is an initializer: input name -> the norm's scale input index.
    The norm gets a scale of its own (other norms may share the one it reads: ORT merges equal
    initializers)."""
    folds = {}
    for node in graph.node:
        index = _NORM_SCALE.get(node.op_type)
        if index is None or len(node.input) <= index or not node.output or node.output[0] not in private:
            continue
        if node.input[index] in inits:
            folds[node.output[0]] = index
    return folds


_CONSTS = {
    "int8_prefill.eps": np.array(1e-30, np.float32),
    "int8_prefill.inv127": np.array(1 / 127, np.float32),
    "int8_prefill.zero": np.array(128, np.uint8),
    "int8_prefill.one": np.array(1, np.float32),
    "int8_prefill.axes": np.array([-1], np.int64),
}


def _integer_projection(p: str, x: str, y: str, k: int) -> list:
    """The nodes of one projection ``y = x @ W`` on the integer GEMM, their names prefixed ``p``
    (the weights ``p.w``, int8 ``[K, N]``, and ``p.step``, ``[N]``): ``x`` rounded to u8 with a step
    per token (``max|x| / 127``, offset 128) by one blocked ``QuantizeLinear`` (a block of ``K``
    channels), ``MatMulIntegerToFloat`` (the int32 product times the weights' steps, one pass), then
    the tokens' steps. ``max|x|`` is ``max(max x, -min x)``: two reductions, no ``Abs`` pass. Bit-equal
    to ``Div``/``Round``/``Add``/``Cast``, ``MatMulInteger``, a ``Cast`` and two ``Mul``s, and 1.3-2.6x
    faster at SmolLM2's shapes (2 threads, 128 and 1024 tokens)."""
    from onnx import helper

    return [
        helper.make_node("ReduceMax", [x, "int8_prefill.axes"], [p + ".hi"], keepdims=1),
        helper.make_node("ReduceMin", [x, "int8_prefill.axes"], [p + ".lo"], keepdims=1),
        helper.make_node("Neg", [p + ".lo"], [p + ".nlo"]),
        helper.make_node("Max", [p + ".hi", p + ".nlo", "int8_prefill.eps"], [p + ".max"]),
        helper.make_node("Mul", [p + ".max", "int8_prefill.inv127"], [p + ".scale"]),  # a token's step
        helper.make_node("Shape", [p + ".scale"], [p + ".rows"]),
        helper.make_node("Expand", ["int8_prefill.zero", p + ".rows"], [p + ".zp"]),
        helper.make_node("QuantizeLinear", [x, p + ".scale", p + ".zp"], [p + ".xq"], axis=-1, block_size=k),
        helper.make_node(
            "MatMulIntegerToFloat",
            [p + ".xq", p + ".w", "int8_prefill.one", p + ".step", "int8_prefill.zero"],
            [p + ".yc"],
            name=p,
            domain="com.microsoft",
        ),
        helper.make_node("Mul", [p + ".yc", p + ".scale"], [y]),
    ]


def _names_read(nodes) -> set[str]:
    """Every name the nodes read, in their subgraphs too (an ``If`` branch reads outer initializers)."""
    from onnx import AttributeProto

    names = set()
    for node in nodes:
        names.update(node.input)
        for attribute in node.attribute:
            graphs = [attribute.g] if attribute.type == AttributeProto.GRAPH else list(attribute.graphs)
            for graph in graphs:
                names |= _names_read(graph.node)
    return names


def calibration_ids(engine, tokens: int = CALIBRATION_TOKENS) -> list[int]:
    """The first ``tokens`` ids of the bundled text (``kvforge/tools/data/text.txt``) in ``engine``'s
    tokenizer, fewer where its cache is shorter."""
    from importlib.resources import files

    text = files("kvforge.tools.data").joinpath("text.txt").read_text(encoding="utf-8")
    return engine.tokenizer.encode(text)[: min(tokens, engine.max_seq)]


def activation_ranges(engine, graph: str = "prefill", tokens: int = CALIBRATION_TOKENS) -> dict[str, np.ndarray]:
    """Each symmetric 4-bit projection input's largest magnitude per channel in ``engine``'s graph
    ``graph`` (``"prefill"`` or ``"score"``), over the first ``tokens`` tokens of the bundled text
    (``kvforge/tools/data/text.txt``, about 400 tokens; fewer where the cache is shorter): calls of the
    engine's prompt chunk into cache row 0 of a session of that graph with those inputs as extra
    outputs, closed after them. The engine must hold no sequence (it is loading); its row 0 is left
    empty."""
    import onnx
    from onnx import TensorProto, helper

    backend, session = engine.backend, f"{graph}.calibration"
    graph_file = backend.graph_files[graph]
    model = onnx.load(str(graph_file), load_external_data=False)
    names = sorted({node.input[0] for node in model.graph.node if _is_projection(node)})
    model.graph.output.extend(helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in names)
    ids = calibration_ids(engine, tokens)
    ranges = {}
    preoptimized = graph in backend.preoptimized
    backend.add_session(session, model.SerializeToString(), graph_file, preoptimized, data_folder=graph_file.parent)
    try:
        for start in range(0, len(ids), engine.prefill_chunk):
            chunk = ids[start : start + engine.prefill_chunk]
            inputs, outputs = engine._fill_inputs([chunk], [start], len(chunk)), engine._outputs(1)
            if graph == "score":
                del inputs[contract.INPUT_LENGTHS]
                logits = np.empty((1, len(chunk), engine.vocab_size), dtype=outputs[contract.LOGITS].dtype)
                outputs[contract.LOGITS] = logits
            binding = backend.bind_session(session, inputs, outputs)
            for name in names:
                binding.io_binding.bind_output(name, "cpu")
            backend.run(binding)
            values = binding.io_binding.get_outputs()[-len(names) :] if names else []
            for name, value in zip(names, values):
                largest = np.abs(value.numpy().reshape(-1, value.shape()[-1])).max(axis=0)
                ranges[name] = np.maximum(ranges[name], largest) if name in ranges else largest
        return ranges
    finally:
        backend.drop_session(session)
        engine.lengths[0] = 0


def calibration_folder() -> Path | None:
    """Where :func:`cached_ranges` keeps ranges: ``$KVFORGE_CALIBRATION`` if set (``off``: nowhere,
    None), else ``$KVFORGE_CACHE/calibration`` (default ``~/.cache/kvforge/calibration``)."""
    given = os.environ.get("KVFORGE_CALIBRATION")
    if given:
        return None if given == "off" else Path(given)
    from kvforge.graphs.environment import cache_root

    return cache_root() / "calibration"


def _calibration_key(engine, ids: list[int]) -> str:
    """What the ranges depend on: the graph ORT runs (its file's bytes and the weights' hash), the
    calibration ids (text, tokenizer and count), the engine's prompt chunk, how they are measured
    (``CALIBRATION_METHOD``), and the versions of kvforge and ONNX Runtime (their kernels round the
    projections' inputs)."""
    from importlib.metadata import PackageNotFoundError, version

    import onnxruntime

    try:
        kvforge_version = version("kvforge")
    except PackageNotFoundError:  # run from a source tree that was not installed
        kvforge_version = "source"
    graph_file = engine.backend.graph_files["prefill"]
    found = {
        "graph_sha256": hashlib.sha256(Path(graph_file).read_bytes()).hexdigest(),
        "weights_sha256": engine.manifest.weights.sha256,
        "ids_sha256": hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest(),
        "prefill_chunk": engine.prefill_chunk,
        "method": CALIBRATION_METHOD,  # a source tree's version stays put while the measurement changes
        "kvforge": kvforge_version,
        "onnxruntime": onnxruntime.__version__,
    }
    return hashlib.sha256(json.dumps(found, sort_keys=True).encode()).hexdigest()


def cached_ranges(engine, tokens: int = CALIBRATION_TOKENS, folder: Path | None = None) -> dict[str, np.ndarray]:
    """:func:`activation_ranges` of ``engine``'s prefill graph, kept in ``folder`` (default
    :func:`calibration_folder`) under a key of everything they depend on (:func:`_calibration_key`),
    so that a later load of the same artifact by the same kvforge and ONNX Runtime reads them instead
    of making the calibration session and running it (the 1.39B: 10 s and 230 MiB of peak RSS). A
    file that cannot be read is measured again and replaced; a folder that cannot be written leaves
    the ranges measured at every load (logged once a load, never an error). Each write removes the
    files no load has read for ``CALIBRATION_DAYS`` (:func:`_prune`)."""
    folder = calibration_folder() if folder is None else folder
    if folder is None:
        return activation_ranges(engine, tokens=tokens)
    ids = calibration_ids(engine, tokens)
    path = folder / f"{_calibration_key(engine, ids)}.npz"
    try:
        with np.load(path, allow_pickle=False) as stored:
            names = [str(name) for name in stored["names"]]
            ranges = {name: stored[f"r{i}"] for i, name in enumerate(names)}
        with suppress(OSError):
            os.utime(path)  # read now: kept another CALIBRATION_DAYS
        log.info("int8 prefill: the activations' ranges read from %s", path)
        return ranges
    except FileNotFoundError:
        pass
    except Exception as exc:  # a truncated or foreign file: measure again and replace it
        log.warning("int8 prefill: the stored calibration %s is unreadable (%s); measuring it again", path, exc)
    log.info(
        "int8 prefill: measuring the activations' ranges on %d tokens of the bundled text (kept in %s)",
        len(ids),
        folder,
    )
    ranges = activation_ranges(engine, tokens=tokens)
    names, written = sorted(ranges), None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, suffix=".tmp", delete=False) as handle:
            written = Path(handle.name)
            np.savez(handle, names=np.array(names), **{f"r{i}": ranges[name] for i, name in enumerate(names)})
        os.replace(written, path)  # whole or absent: loads running at once each write their own file
        _prune(folder)
    except OSError as exc:
        log.warning("int8 prefill: cannot keep the calibration in %s (%s); it is measured at every load", folder, exc)
        if written is not None:
            written.unlink(missing_ok=True)
    return ranges


def _prune(folder: Path) -> None:
    """Remove the stored calibrations no load has read for ``CALIBRATION_DAYS`` (those of artifacts
    deleted, or of kvforge and ONNX Runtime versions upgraded from), and temporary files a load that
    died left behind a day ago."""
    now = time.time()
    for file in folder.iterdir():
        age = {".npz": CALIBRATION_DAYS * 86400, ".tmp": 86400}.get(file.suffix)
        with suppress(OSError):
            if age is not None and now - file.stat().st_mtime > age:
                file.unlink()


def float_activations(graph_file: Path) -> tuple[bytes, Path, int]:
    """``graph_file`` with its 4-bit projections at ``MatMulNBits``' accuracy level 1 (``prefill="fp32"``):
    the same int4 weights (zero points too), float activations; the 8-bit lm_head keeps its level
    (at level 1 ORT runs 8-bit blocks on a reference loop: 548 against 20 ms a call). Returns the
    graph as bytes, the folder its external data paths are relative to (the graph's own) and the
    number of projections changed."""
    import onnx
    from onnx import helper

    model = onnx.load(str(graph_file), load_external_data=False)
    count = 0
    for node in model.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type != "MatMulNBits" or attrs.get("bits") != 4:
            continue
        kept = [a for a in node.attribute if a.name != "accuracy_level"]
        del node.attribute[:]
        node.attribute.extend([*kept, helper.make_attribute("accuracy_level", 1)])
        count += 1
    return model.SerializeToString(), graph_file.parent, count


class PrefillSession:
    """The artifact's prefill graph with its int4 projections on another ORT kernel, a session of
    ``backend`` (an :class:`~kvforge.runtime.ort_backend.OrtBackend`), for prefill calls whose rows
    have at least ``min_tokens`` tokens each (see the module docstring). ``compute``: ``"int8"``
    (:func:`rewrite`: the integer GEMM, its inputs smoothed by ``ranges`` where given) or ``"fp32"``
    (:func:`float_activations`)."""

    def __init__(
        self,
        backend,
        graph_file: Path,
        preoptimized: bool,
        compute: str = "int8",
        min_tokens: int = MIN_TOKENS,
        ranges: dict[str, np.ndarray] | None = None,
    ) -> None:
        if not backend.options.prepack:
            raise ValueError(f"prefill={compute!r} packs its weights into ORT's kernels; load it with prepack=True")
        # The int8 weights go through a file ORT reads, packs and lets go of (handed from memory, the
        # session would keep them beside its packed copy: 1.39B peak RSS 5.3 against 3.1 GB); the
        # fp32 graph reads the artifact's own weights.
        temporary = tempfile.TemporaryDirectory(prefix="kvforge-int8-prefill-") if compute == "int8" else nullcontext()
        with temporary as tmp:
            if compute == "int8":
                start = time.perf_counter()
                model, root, count = rewrite(graph_file, Path(tmp) / "int8.data", ranges, backend.options.threads)
                log.info(
                    "int8 prefill: %d projections' weights rounded to int8 in %.1f s",
                    count,
                    time.perf_counter() - start,
                )
            else:
                model, root, count = float_activations(graph_file)
            if not count:
                kind = "symmetric 4-bit" if compute == "int8" else "4-bit"
                raise ValueError(
                    f"prefill={compute!r} cannot run this artifact: its prefill graph has no {kind} projection "
                    "(compile with --quantize int4); load it with prefill='ort' (the default)"
                )
            backend.add_session(GRAPH, model, graph_file, preoptimized=preoptimized, data_folder=root)
        self.backend, self.min_tokens, self.projections = backend, min_tokens, count

    def wants(self, graph: str, inputs: dict[str, np.ndarray]) -> bool:
        """Whether a call of ``graph`` with these inputs runs here: prefill calls whose every row has
        at least ``min_tokens`` tokens."""
        return graph == "prefill" and int(inputs[contract.INPUT_LENGTHS].min()) >= self.min_tokens

    def bind(self, graph: str, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray]):
        """A binding of the rewritten graph's session, which the backend runs as any of its own."""
        return self.backend.bind_session(GRAPH, inputs, outputs)

    def close(self) -> None:
        self.backend.drop_session(GRAPH)
