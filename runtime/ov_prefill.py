"""Prefill on OpenVINO's CPU plugin, decode on ONNX Runtime: ``Engine.load(prefill="openvino")``.

Why. On a CPU with AMX / AVX512-VNNI, ORT's int4 kernel (``MatMulNBits``) prefills slower than
ORT's own fp32 GEMM, while OpenVINO runs the same int4 ``MatMulNBits`` nodes with int8 activations
in its brgemm kernels: SmolLM2-135M int4, 128 tokens, 2 threads: 80.7 ms on OpenVINO against
166.4 ms on ORT, the same greedy tokens (benchmarks/FINDINGS.md, "OpenVINO on kvforge's graph").
Its decode step through the same graph is ~3.5x ORT's, so only calls of many tokens go to it.

Precision. ``"openvino"`` compiles the graph at f32, kvforge's arithmetic. ``"openvino:bf16"``
compiles it at bf16 (OpenVINO's own default on such CPUs, what OpenVINO GenAI runs): the weights,
activations and paged K/V blocks of the prompt's pass in bfloat16 on the AMX / AVX512-BF16 units,
the engine's cache still float32 (holding bfloat16 values). About twice as fast again (SmolLM2
int4 through the engine: 61.5 against 104.0 ms at 128 tokens, 349 against 732 ms at 1024;
docs/performance.md), at bfloat16's rounding of the prompt's logits and K/V (its cost in
perplexity and greedy agreement: benchmarks/FINDINGS.md, "The bf16 prefill"). Refused on a CPU
without bf16 arithmetic, where OpenVINO would quietly run f32 instead.

How. OpenVINO reads the artifact's ``prefill.onnx`` (the graph before ORT's optimization; its
``gqa`` lowering: the ``onnx`` lowering's ``TensorScatter`` has no OpenVINO conversion) through
its ONNX reader with one conversion of kvforge's own, registered at the reader's extension point
(``ConversionExtension``): each ``GroupQueryAttention`` becomes OpenVINO's
``PagedAttentionExtension``, the op OpenVINO GenAI's pipeline runs, whose CPU kernel skips the
causal upper half and writes the layer's keys and values into blocks of ``BLOCK`` positions. The
stock translation decomposes it into a whole ``S x S`` score matrix per head plus transposes and
concatenations of the presents; the paged one prefilled SmolLM2-135M in 0.6-0.75x its time, at
the same perplexity (benchmarks/FINDINGS.md, "OpenVINO's paged attention on kvforge's graph"). The
layer's past input is the op's block cache (shape ``[blocks, H_kv, BLOCK, D]``, float32 or
bfloat16 as the precision), the present outputs are dropped, and the op's past length, block
table and context length are computed in the graph from its ``total_sequence_length``. Compile
packs a layer's projections into one product whose output is split (q/k/v, gate/up:
``kvforge.compile.packing``), which OpenVINO runs as a reference ``VariadicSplit`` kernel with the
gate's SiLU left unfused; after reading, each such product is unpacked into one per part
(:func:`unpack_projections`: one ``FullyConnected`` a projection, as in OV GenAI's IR; SmolLM2-135M
at 1024 tokens 0.93-0.97x the time, logits bit-equal at f32, +14 MiB resident at int4 bf16 and +165
MiB at fp32 f32 for the weights' second layout).

A call binds the engine's step inputs and logits by pointer (``ov.Tensor(array,
shared_memory=True)``) and each layer's block arrays, kept here and grown to the largest call. A
row that resumes a cached prefix (``write_indices > 0``) first has its past positions copied from
the engine's cache into the blocks; after the call the row's new positions are copied from the
blocks into the engine's cache (the cache stays the engine's one allocation, whichever runtime
wrote a row). Full causal attention only: a graph whose attention has a sliding window, a
softcap, sinks or in-op rotary is refused at load (:func:`unsupported`).

Rows. A prefill call of B rows, each of at least ``min_tokens`` tokens, is one OpenVINO call of
the engine's padded ``[B, S]`` inputs (as ORT's): the paged op takes each row as a sequence of S
tokens with its own past length (``seqlens_k + 1 - S``) and its own run of blocks, and only each
row's real positions are copied into the cache. (OpenVINO 2026.4's stock translation failed at
batch > 1, so the translation before this one ran a call per row: ×1.45 OV GenAI's TTFT at 4
prompts of 128, against ×1.08 as one call; docs/performance.md.) A call with a shorter row, and
every decode step, stays on ORT. With speculative decoding the engine's step graph is the verify
graph: a prompt OpenVINO takes runs this prefill graph instead, and the verify steps stay on ORT.

Limits (refused at load by :func:`check_artifact`): float32 artifacts of the ``gqa`` lowering
with a KV cache only (no model state, no 8-bit KV); the CPU; OpenVINO's ``PagedAttentionExtension`` of the
pinned release series (its 28 inputs are OpenVINO 2026.4's; another series' fails to compile, with
OpenVINO's message). Cost: OpenVINO holds its own compiled copy of the model (SmolLM2-135M: +550
MiB resident at int4, +1.2 GiB at fp32 and f32; of the int4 compile's ~480 MiB, ~260 MiB are the
memory-mapped weights file, clean pages the kernel may drop under pressure, ~220 MiB OpenVINO's
own), and the block arrays hold the largest call's K/V (SmolLM2, one row of 1024 tokens: 45
MiB float32, 23 MiB bfloat16). Each new prompt length costs OpenVINO a shape preparation on its first
call (SmolLM2 int4 bf16: +20 ms at 130 tokens, +130-190 ms near 1024; ORT has no such cost).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvforge.graphs import contract
from kvforge.graphs import manifest as mf

# Calls of fewer tokens (B x S) stay on ORT: OpenVINO beat ORT from ~32 tokens (FINDINGS.md).
MIN_TOKENS = 32
INSTALL = "pip install 'kvforge[openvino]'"
# Engine.load's prefill= choices that run here -> OpenVINO's INFERENCE_PRECISION_HINT.
PRECISIONS = {"openvino": "f32", "openvino:bf16": "bf16"}
CHOICES = ("ort", "int8", "fp32", *PRECISIONS)  # Engine.load(prefill=...) and --prefill; int8, fp32: int8_prefill
BLOCK = 32  # positions a KV block of OpenVINO's CPU paged attention holds
# GroupQueryAttention's attributes the paged translation takes, at the values it takes them
_PLAIN = {"local_window_size": -1, "softcap": 0.0, "do_rotary": 0, "smooth_softmax": 0}


def check_artifact(manifest: mf.Manifest, choice: str = "openvino") -> None:
    """Refuse, before anything loads, an artifact the OpenVINO prefill cannot run exactly."""
    why = None
    if manifest.layout.has_state:
        why = "it keeps model state (a hybrid or recurrent family), which only the ORT lowering runs"
    elif manifest.layout.quantized_kv:
        why = "its KV cache is 8-bit with scales (--kv-dtype int8)"
    elif manifest.lowering != "gqa":
        why = f"its lowering is {manifest.lowering!r}; OpenVINO reads only the gqa lowering's graph"
    elif manifest.dtype != "float32":
        why = f"it is {manifest.dtype}; the OpenVINO prefill binds float32 caches"
    if why:
        raise ValueError(_refusal(choice, why))


def _refusal(choice: str, why: str) -> str:
    return f"prefill={choice!r} cannot run this artifact: {why}; load it with prefill='ort' (the default)"


def unsupported(graph) -> str | None:
    """Why the paged translation cannot run this ``onnx.GraphProto``'s attention, or None: it
    takes full causal attention, not a sliding window, a softcap, sinks or in-op rotary."""
    import onnx

    for node in graph.node:
        if node.op_type != "GroupQueryAttention":
            continue
        extra = [name for name in node.input[7:] if name]
        if extra:
            return f"its attention {node.name!r} takes {len(extra)} input(s) past the seventh (rotary caches or sinks)"
        for attribute in node.attribute:
            value = onnx.helper.get_attribute_value(attribute)
            if attribute.name in _PLAIN and value != _PLAIN[attribute.name]:
                return f"its attention {node.name!r} has {attribute.name}={value}"
    return None


def _paged_attention(node):
    """The ONNX reader's conversion of one ``GroupQueryAttention``: OpenVINO's
    ``PagedAttentionExtension`` over the layer's past input as its block cache, each of the B rows
    a sequence of the call's S (padded) tokens with a run of n blocks of its own (row b's:
    ``[b * n, (b + 1) * n)``, n = ceil((the longest past + S) / BLOCK)). Outputs: the attention,
    then empty placeholders for the presents (the caller drops those results)."""
    from openvino import opset13 as ops
    from openvino._pyopenvino.op import _PagedAttentionExtension

    def const(value, dtype):
        return ops.constant(np.asarray(value, dtype))

    def scalar(x):
        return ops.squeeze(x, const(0, np.int64))

    query, key, value, past_key, past_value, seqlens, total = (node.get_input(i) for i in range(7))
    heads, kv_heads = node.get_attribute("num_heads"), node.get_attribute("kv_num_heads")
    head_dim = past_key.get_partial_shape()[3].get_length()
    scale = node.get_attribute("scale", 0.0) or head_dim**-0.5
    shape = ops.shape_of(query, "i32")
    rows, new = (ops.gather(shape, const([i], np.int64), const(0, np.int64)) for i in (0, 1))  # [1]: B, S
    context = ops.reshape(ops.convert(total, "i32"), const([1], np.int64), False)  # [1]: the longest past + S
    blocks = ops.divide(ops.add(context, const([BLOCK - 1], np.int32)), const([BLOCK], np.int32))  # a row's
    zero, none_i32, none_f32 = const(0, np.int32), const([], np.int32), const([], np.float32)
    # seqlens_k is past + S - 1 of each row (its own past, the call's S)
    past_lens = ops.subtract(ops.add(ops.convert(seqlens, "i32"), const([1], np.int32)), new)
    begins = ops.range(zero, scalar(ops.add(ops.multiply(rows, new), new)), scalar(new), "i32")  # 0, S, .., B*S
    table = ops.range(zero, scalar(ops.multiply(rows, blocks)), const(1, np.int32), "i32")
    table_begins = ops.range(zero, scalar(ops.add(ops.multiply(rows, blocks), blocks)), scalar(blocks), "i32")
    widths = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    unused = [  # the features kvforge does not use, each input empty or zero
        none_i32, none_i32, none_f32,  # cache rotation: rotated_block_indices, rotation_deltas, rotation_trig_lut
        none_f32, zero, zero,  # xattention: threshold, block size, stride
        none_f32,  # sinks
        zero, none_i32, none_i32, none_i32,  # adaptive R-KV: start size, evictable sizes, diversity sets, their begins
        none_i32, const([], np.uint8), none_i32,  # token_type_ids, qq_bias, qq_bias_begins
    ]  # fmt: skip
    inputs = [
        *(ops.reshape(x, const([-1, width], np.int64), False) for x, width in zip((query, key, value), widths)),
        past_key,  # key_cache [blocks, H_kv, BLOCK, D]
        past_value,  # value_cache
        past_lens,
        begins,  # subsequence_begins
        table,  # block_indices
        table_begins,  # block_indices_begins
        const(scale, np.float32),
        zero,  # sliding_window: none
        none_f32,  # alibi_slopes
        scalar(context),  # max_context_len
        ops.broadcast(zero, rows),  # score_aggregation_window: [B] zeros (the CPU kernel checks its length)
        *unused,
    ]
    paged = _PagedAttentionExtension([x.output(0) if hasattr(x, "output") else x for x in inputs])
    info = paged.get_rt_info()  # the CPU plugin sizes the blocks from these
    info["k_head_size"] = info["v_head_size"] = head_dim
    info["num_k_heads"] = info["num_v_heads"] = kv_heads
    attention = ops.reshape(paged.output(0), ops.shape_of(query), False)
    # the presents: placeholders (their results are dropped); returning the pasts would rename them
    empty = [const(np.zeros((1, kv_heads, 0, head_dim)), np.float32) for _ in range(2)]
    return [attention.output(0), *(e.output(0) for e in empty)]


def unpack_projections(model) -> int:
    """Undo compile's projection packing (``kvforge.compile.packing``) in this ``openvino.Model``,
    in place; returns the products unpacked. Each ``MatMul`` whose one reader is a ``VariadicSplit``
    of its output columns becomes one ``MatMul`` per part, writing the split's outputs: the same
    values (an output column is its own dot product; bit-equal at f32). OpenVINO runs such a split
    as a reference kernel and cannot fuse the gate's SiLU into a product whose output is split;
    unpacked, SmolLM2-135M prefilled 1024 tokens in 0.95x the time (benchmarks/FINDINGS.md). An
    int4 part's weight is the chain OpenVINO's ONNX reader made of ``MatMulNBits`` (blocks less a
    zero point, times scales, ``[N, K]``) over copies of the packed constants' rows (:func:`_rows`);
    a float ``[K, N]`` weight is split by columns by a ``VariadicSplit`` of the constant, which
    OpenVINO folds when it compiles. A product of any other form is left packed."""
    from openvino import opset13 as ops

    unpacked = 0
    for split in model.get_ordered_ops():
        product = split.input_value(0).get_node() if split.get_type_name() == "VariadicSplit" else None
        if product is None or product.get_type_name() != "MatMul" or len(product.output(0).get_target_inputs()) != 1:
            continue
        axis, sizes = (_constant(split.input_value(i)) for i in (1, 2))
        rank = split.get_input_partial_shape(0).rank.get_length()
        if axis is None or sizes is None or int(axis) % rank != rank - 1:
            continue
        bounds = np.cumsum([0, *sizes.tolist()]).tolist()
        x, weight = product.input_value(0), product.input_value(1)
        flags = product.get_attributes()  # transpose_a, transpose_b
        if flags["transpose_b"]:  # [N, K]: a part is a range of rows, through the decompression chain
            parts = [_rows(weight, lo, hi, bounds[-1]) for lo, hi in itertools.pairwise(bounds)]
        elif weight.get_node().get_type_name() == "Constant":  # [K, N] floats
            parts = ops.variadic_split(
                weight, ops.constant(np.int64(1)), ops.constant(np.asarray(sizes, np.int64))
            ).outputs()
        else:
            continue
        if any(part is None for part in parts):
            continue
        for out, part in zip(split.outputs(), parts):
            out.replace(ops.matmul(x, part, flags["transpose_a"], flags["transpose_b"]).output(0))
        unpacked += 1
    return unpacked


def _constant(value) -> np.ndarray | None:
    node = value.get_node()
    return node.get_data() if node.get_type_name() == "Constant" else None


def _rows(value, start: int, stop: int, rows: int):
    """Rows ``[start, stop)`` of ``value``, a weight of ``rows`` rows made of constants by
    ``Convert`` / ``Subtract`` / ``Multiply`` / ``Reshape`` (what OpenVINO's ONNX reader makes of
    ``MatMulNBits``: int4 blocks less a zero point, times scales, reshaped to ``[N, K]``), rebuilt
    over copies of the constants' rows; inputs that are not per row (a zero point) are shared.
    None for any other op."""
    import openvino as ov
    from openvino import opset13 as ops

    shape = value.get_partial_shape()
    if shape.rank.get_length() == 0 or shape[0].is_dynamic or shape[0].get_length() != rows:
        return value  # broadcast over the rows
    node, kind = value.get_node(), value.get_node().get_type_name()
    inputs = [node.input_value(i) for i in range(node.get_input_size())]
    if kind == "Constant":  # int4 data comes packed, two to a byte: a row is whole bytes
        data = node.get_tensor_view().data.reshape(-1).view(np.uint8)
        size = data.size // rows
        new_shape = ov.Shape([stop - start, *value.get_shape()[1:]])
        piece = ov.Tensor(data[start * size : stop * size], new_shape, node.get_element_type())  # points into it
        return ops.constant(piece, shared_memory=False).output(0)  # a copy
    parts = [_rows(x, start, stop, rows) for x in inputs]
    if any(part is None for part in parts):
        return None
    if kind == "Convert":
        return ops.convert(parts[0], node.get_destination_type()).output(0)
    if kind in ("Subtract", "Multiply"):
        return getattr(ops, kind.lower())(*parts).output(0)
    if kind == "Reshape" and (target := _constant(inputs[1])) is not None:
        keep = node.get_special_zero() and target[0] == 0  # "the input's first axis": the rows
        if not keep and target[0] != rows:
            return None
        target = target if keep else np.concatenate([[stop - start], target[1:]]).astype(target.dtype)
        return ops.reshape(parts[0], ops.constant(target), node.get_special_zero()).output(0)
    return None


def _blocks_view(blocks: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Positions ``[start, stop)`` of ``blocks`` ``[N, H, BLOCK, D]``, a run inside one block or of
    whole blocks, as a view ``[H, n, D]`` or ``[H, n / BLOCK, BLOCK, D]``."""
    first, offset = divmod(start, BLOCK)
    if offset == 0 and (stop - start) % BLOCK == 0:
        return blocks[first : first + (stop - start) // BLOCK].transpose(1, 0, 2, 3)
    return blocks[first, :, offset : offset + stop - start]


def _runs(start: int, stop: int) -> list[tuple[int, int]]:
    """``[start, stop)`` cut at the block boundaries inside it into at most three runs, each inside
    one block or of whole blocks."""
    cuts = {p for p in (-(-start // BLOCK) * BLOCK, stop // BLOCK * BLOCK) if start < p < stop}
    edges = sorted({start, stop, *cuts})
    return list(itertools.pairwise(edges))


def blocks_to_cache(blocks: np.ndarray, cache: np.ndarray, start: int, stop: int) -> None:
    """Positions ``[start, stop)`` of ``blocks`` ``[N, H, BLOCK, D]`` into ``cache`` ``[H, S, D]``."""
    for a, b in _runs(start, stop):
        cache[:, a:b] = _blocks_view(blocks, a, b).reshape(cache.shape[0], b - a, cache.shape[2])


def cache_to_blocks(cache: np.ndarray, blocks: np.ndarray, start: int, stop: int) -> None:
    """Positions ``[start, stop)`` of ``cache`` ``[H, S, D]`` into ``blocks`` ``[N, H, BLOCK, D]``."""
    for a, b in _runs(start, stop):
        view = _blocks_view(blocks, a, b)
        view[...] = cache[:, a:b].reshape(view.shape)


@dataclass
class OvBinding:
    tensors: dict[str, object]  # input or logits name -> ov.Tensor over the engine's array
    starts: list[int]  # each row's first new position (its write index)
    lengths: list[int]  # each row's real new tokens (the call's S counts its padding too)
    width: int  # S
    caches: dict[str, np.ndarray]  # past input -> the engine's cache view [B, H, S_max, D] (in place)
    arrays: list[np.ndarray]  # keeps the bound arrays alive while the binding exists


class OpenVinoPrefill:
    """The prefill graph compiled by OpenVINO, for prefill calls whose rows have at least
    ``min_tokens`` tokens each; ``precision``: ``"f32"`` or ``"bf16"`` (see the module docstring)."""

    # Its paged attention skips the causal square's masked blocks: generation gives it whole prompts
    # (the engine's prefill_chunk default; 256-token calls were x1.11-1.13 slower at 512-2000 tokens).
    whole_prompts = True

    def __init__(
        self,
        graph_file: Path,
        threads: int | None = None,
        min_tokens: int = MIN_TOKENS,
        precision: str = "f32",
        unpack: bool = True,
    ) -> None:
        try:
            import openvino as ov
            from openvino.frontend.onnx import ConversionExtension
        except ImportError as e:
            raise ValueError(f"prefill='openvino' needs OpenVINO: {INSTALL}") from e
        import onnx
        from ml_dtypes import bfloat16  # onnx's dependency: numpy's bfloat16

        why = unsupported(onnx.load(str(graph_file), load_external_data=False).graph)
        if why:
            raise ValueError(_refusal(next(c for c, p in PRECISIONS.items() if p == precision), why))
        self._ov = ov
        core = ov.Core()
        if precision == "bf16" and "BF16" not in core.get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
            raise ValueError(
                "prefill='openvino:bf16' needs a CPU with bfloat16 arithmetic (AVX512-BF16 or AMX), and OpenVINO "
                "finds none on this one; load with prefill='openvino' (f32)"
            )
        # stated: OpenVINO's own defaults would be bf16 arithmetic and an 8-bit cache
        config = {"INFERENCE_PRECISION_HINT": precision, "KV_CACHE_PRECISION": precision}
        if threads is not None:
            config["INFERENCE_NUM_THREADS"] = threads
        try:
            core.add_extension(ConversionExtension("GroupQueryAttention", "com.microsoft", _paged_attention))
            model = core.read_model(str(graph_file))
            self.unpacked = unpack_projections(model) if unpack else 0
            pasts = self._to_block_caches(model)
            self.compiled = core.compile_model(model, "CPU", config)
        except Exception as e:  # OpenVINO's conversion errors are RuntimeErrors of many lines
            detail = str(e).strip().splitlines()[0][:240] if str(e).strip() else type(e).__name__
            raise mf.ArtifactError(
                f"OpenVINO cannot compile {graph_file.name} ({detail}); load the artifact with prefill='ort'"
            ) from e
        self._port = {p.get_friendly_name(): i for i, p in enumerate(model.get_parameters())}
        self._block_type = {name: self.compiled.input(self._port[name]).get_element_type() for name in pasts}
        self._dtype = np.float32 if precision == "f32" else bfloat16
        self._blocks: dict[str, np.ndarray] = {}  # past input -> [N, H_kv, BLOCK, D], grown to the largest call
        self.request = self.compiled.create_infer_request()
        self.precision = precision
        self.min_tokens = min_tokens
        self.calls = 0  # one-row calls run here (bench and the tests read it)

    @staticmethod
    def _to_block_caches(model) -> list[str]:
        """Drop the present results and make each past input a block cache of any length and element
        type (the CPU plugin fixes ``BLOCK`` and the precision's type); the past inputs' names."""
        import openvino as ov

        for result in list(model.get_results()):
            if any(name.startswith("present.") for name in result.output(0).get_names()):
                model.remove_result(result)
        pasts = []
        for parameter in model.get_parameters():
            name = parameter.get_friendly_name()
            if name.startswith("past_key_values."):
                shape = parameter.get_partial_shape()
                parameter.set_element_type(ov.Type.dynamic)
                parameter.set_partial_shape(ov.PartialShape([-1, shape[1], -1, shape[3]]))
                parameter.validate_and_infer_types()
                pasts.append(name)
        model.validate_nodes_and_infer_types()
        return pasts

    def wants(self, graph: str, inputs: dict[str, np.ndarray]) -> bool:
        """Whether a call of ``graph`` with these inputs runs here: prefill calls whose every row has
        at least ``min_tokens`` tokens."""
        return graph == "prefill" and int(inputs[contract.INPUT_LENGTHS].min()) >= self.min_tokens

    def _block_tensors(self, caches: dict[str, np.ndarray], count: int) -> dict[str, object]:
        """Each layer's first ``count`` blocks, wrapped by pointer."""
        tensors = {}
        for name, view in caches.items():
            blocks = self._blocks.get(name)
            if blocks is None or len(blocks) < count:
                blocks = self._blocks[name] = np.zeros((count, view.shape[1], BLOCK, view.shape[3]), self._dtype)
            bits = blocks[:count].view(np.uint32 if self._dtype is np.float32 else np.uint16)  # OpenVINO reads raw
            tensors[name] = self._ov.Tensor(bits, bits.shape, self._block_type[name])
        return tensors

    def bind(self, graph: str, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> OvBinding:
        """The step inputs and the logits, wrapped by pointer; the cache views are read and written
        around the call (``run``)."""
        steps = (contract.INPUT_IDS, contract.POSITION_IDS, contract.WRITE_INDICES, contract.INPUT_LENGTHS)
        arrays = {name: np.ascontiguousarray(inputs[name]) for name in steps}  # ids/positions: copies
        arrays[contract.LOGITS] = outputs[contract.LOGITS]
        tensors = {name: self._ov.Tensor(array, shared_memory=True) for name, array in arrays.items()}
        caches = {name: array for name, array in inputs.items() if name not in steps}  # the past = present views
        starts, lengths = inputs[contract.WRITE_INDICES].tolist(), inputs[contract.INPUT_LENGTHS].tolist()
        width = inputs[contract.INPUT_IDS].shape[1]
        return OvBinding(tensors, starts, lengths, width, caches, list(arrays.values()))

    def run(self, binding: OvBinding) -> None:
        per_row = -(-(max(binding.starts) + binding.width) // BLOCK)  # as the graph computes it
        blocks = self._block_tensors(binding.caches, len(binding.starts) * per_row)
        rows = [slice(b * per_row, (b + 1) * per_row) for b in range(len(binding.starts))]
        for b, s0 in enumerate(binding.starts):
            if s0:  # a resumed prefix: its positions are the paged attention's past
                for name, view in binding.caches.items():
                    cache_to_blocks(view[b], self._blocks[name][rows[b]], 0, s0)
        for name, tensor in (*binding.tensors.items(), *blocks.items()):
            if name == contract.LOGITS:
                self.request.set_output_tensor(0, tensor)  # the one result left
            else:
                self.request.set_input_tensor(self._port[name], tensor)
        self.request.infer()
        for b, (s0, n) in enumerate(zip(binding.starts, binding.lengths)):
            for name, view in binding.caches.items():
                blocks_to_cache(self._blocks[name][rows[b]], view[b], s0, s0 + n)
        self.calls += 1

    def close(self) -> None:
        self.request = self.compiled = None
