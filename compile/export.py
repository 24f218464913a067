"""Stage 2: a loaded transformers model -> ONNX graphs (in memory).

Input: :class:`kvforge.compile.load.LoadedModel`. Output: ``onnx_ir.Model`` objects with symbolic
``batch``, ``seq`` and ``capacity`` dims. Compile traces the model ONCE, into the general graph
(:func:`export_general`, extra input ``logit_indices [batch, positions]``), and derives the
contract's prefill, decode and score graphs from it (:mod:`kvforge.compile.derive`).
:func:`export_prefill` and :func:`export_decode` trace one contract graph directly: the reference
the derived graphs are tested against. The weights are still inside the models (as views of the
torch parameters); :mod:`kvforge.compile.weights` moves them to one shared file.

One trace is two steps, each timed in :class:`ExportTimes`: ``torch.onnx.export`` (``torch.export``
tracing the wrapper, the exporter's decompositions, the ONNX translation) and onnxscript's
optimizer (constant folding, rewrite rules, common subexpressions), which ``torch.onnx.export``
would otherwise run inside.
"""

from __future__ import annotations

import ast
import contextlib
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import onnx_ir as ir
import torch

from kvforge.compile import complex_to_real, op_translations, quiet, replicate
from kvforge.compile.load import LoadedModel
from kvforge.graphs import contract, gated_delta_onnx, lowering, mamba, mamba2
from kvforge.graphs.wrappers import DecodeGraph, GeneralGraph, PrefillGraph, ScoreGraph

OPSET = 24
LOGIT_INDICES = "logit_indices"  # [batch, positions] int64: the general graph's extra input
POSITIONS_DIM = "positions"  # its symbolic dim: how many positions of each row get logits

# Example sizes for tracing. Distinct values, none 0 or 1, so that no dynamic dim gets specialized.
_EXAMPLE_BATCH, _EXAMPLE_SEQ, _EXAMPLE_CAPACITY, _EXAMPLE_POSITIONS = 2, 7, 37, 3


@dataclass
class ExportTimes:
    """Seconds spent in each step of the traces of one stage (summed over its traces), and how the
    decoder stack was traced (:mod:`kvforge.compile.replicate`: a prefix and copies, or in full
    and why)."""

    steps: dict[str, float] = field(default_factory=dict)
    trace: str = ""

    def add(self, step: str, seconds: float) -> None:
        self.steps[step] = self.steps.get(step, 0.0) + seconds

    def __str__(self) -> str:
        steps = ", ".join(f"{step} {seconds:.1f}s" for step, seconds in self.steps.items())
        return f"{steps}; {self.trace}" if self.trace else steps


def _example_past(loaded: LoadedModel, num_layers: int | None = None) -> list[torch.Tensor]:
    """Example past tensors in contract order: KV of ``num_layers`` layers (all by default), or for a
    family with state layers, KV of its attention layers and then each state tensor."""
    d = loaded.dims
    dtype = next(loaded.model.parameters()).dtype
    shape = (_EXAMPLE_BATCH, d.num_kv_heads, _EXAMPLE_CAPACITY, d.head_dim)
    layout = loaded.state_layout
    if layout.quantized_kv:  # int8 KV of every layer, then its float32 scales [B, H_kv, S_max, 1]
        count = 2 * (num_layers or d.num_layers)
        kv = [torch.zeros(shape, dtype=torch.int8) for _ in range(count)]
        return kv + [torch.zeros((*shape[:3], 1), dtype=torch.float32) for _ in range(count)]
    if not layout.has_state:
        return [torch.zeros(shape, dtype=dtype) for _ in range(2 * (num_layers or d.num_layers))]
    kv = [torch.zeros(shape, dtype=dtype) for _ in range(2 * len(layout.attention))]
    states = [torch.zeros((_EXAMPLE_BATCH, *t.shape), dtype=getattr(torch, t.dtype)) for _, t in layout.state_tensors()]
    return kv + states


def _past_shapes(loaded: LoadedModel, batch, capacity, num_layers: int | None = None) -> tuple:
    """The dynamic shapes of :func:`_example_past`'s tensors: KV ``{0: batch, 2: capacity}``, a
    state ``{0: batch}``."""
    layout = loaded.state_layout
    if layout.quantized_kv:  # KV and scales alike
        return tuple({0: batch, 2: capacity} for _ in range(4 * (num_layers or loaded.dims.num_layers)))
    if not layout.has_state:
        return tuple({0: batch, 2: capacity} for _ in range(2 * (num_layers or loaded.dims.num_layers)))
    kv = tuple({0: batch, 2: capacity} for _ in range(2 * len(layout.attention)))
    return kv + tuple({0: batch} for _ in layout.state_tensors())


def _names_layout(loaded: LoadedModel, num_layers: int):
    """What :mod:`kvforge.graphs.contract`'s name functions take for this trace: the layout of a
    family with state, else the number of (attention) layers traced."""
    layout = loaded.state_layout
    if layout.quantized_kv and not layout.has_state:  # the scale names, over the layers traced
        return contract.Layout(tuple(range(num_layers)), kv_dtype=layout.kv_dtype)
    return layout if layout.has_state else num_layers


def _dims(max_batch: int, max_seq: int) -> tuple[object, object, object]:
    batch = torch.export.Dim("batch", min=1, max=max(max_batch, _EXAMPLE_BATCH))
    seq = torch.export.Dim("seq", min=1, max=max(max_seq, _EXAMPLE_CAPACITY))
    capacity = torch.export.Dim("capacity", min=2, max=max(max_seq, _EXAMPLE_CAPACITY))
    return batch, seq, capacity


def _export(
    module: torch.nn.Module,
    args: tuple,
    dynamic_shapes: tuple,
    input_names,
    output_names,
    lowering_name,
    times: ExportTimes | None = None,
):
    times = times if times is not None else ExportTimes()
    model = _trace(module, args, dynamic_shapes, input_names, output_names, lowering_name, times)
    _finish(model, module, times)
    return model


def _trace(module, args, dynamic_shapes, input_names, output_names, lowering_name, times: ExportTimes):
    """``torch.onnx.export`` of ``module`` without its optimizer: the raw model, whose nodes still
    carry the exporter's module scopes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the eager call runs a few tokens; tracing runs no kernels
    try:
        with (
            warnings.catch_warnings(),
            torch.no_grad(),
            quiet.quiet_logger(quiet.EXPORTER_REGISTRY_LOGGER),
            mamba2.linear_attention(lowering_name == "gqa"),  # Mamba2's scan as one op for ORT's kernel
        ):
            # The exporter warns about things that do not concern us (missing torchvision ops, ...),
            # through Python's warnings and through its registry's logger.
            warnings.simplefilter("ignore")
            # One eager call first: some modules create buffers lazily on their first forward (Phi-3's
            # longrope frequencies); created during tracing, they would be fake tensors, not constants.
            started = time.perf_counter()
            module(*args)
            traced, shapes = module, dynamic_shapes
            spec = getattr(module, "spec", None)
            if spec is not None and spec.complex_arithmetic:  # carry complex values as real pairs first
                traced = torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=False)
                traced = traced.run_decompositions()
                complex_to_real.rewrite(traced)
                shapes = None  # the program carries its dynamic shapes
            onnx_program = torch.onnx.export(
                traced,
                args,
                dynamo=True,
                opset_version=OPSET,
                dynamic_shapes=shapes,
                input_names=input_names,
                output_names=output_names,
                custom_translation_table={
                    **op_translations.translation_table(),
                    **lowering.translation_table(lowering_name),
                    **mamba.translation_table(fast=lowering_name == "gqa"),
                },
                optimize=False,  # run below, timed on its own
                verbose=False,
            )
            times.add("trace and ONNX translation", time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
    model = onnx_program.model
    del onnx_program
    gated_delta_onnx.expand(model, fast=lowering_name == "gqa")  # the state ops' nodes to their lowering
    return model


def _finish(model, module: torch.nn.Module, times: ExportTimes, optimized: bool = False) -> None:
    """onnxscript's optimizer (unless ``optimized``), then HF-traceable node names; in place.
    ``module`` is the whole traced wrapper: the weights of its model that the optimizer left
    behind are dropped."""
    started = time.perf_counter()
    if not optimized:
        transpose_weights_lazily(model)
        optimize_exported(model)
    _drop_stale_weights(module)
    _name_nodes(model)
    times.add("onnxscript optimizer", time.perf_counter() - started)


# onnxscript's default rewrite rules that never match an exported causal LM but cost the most:
# SlicesSplit (Slices of one tensor -> Split) matches pairs of Slice nodes and took 85% of the
# optimizer's time on the SmolLM-135M shape (20 of 23 s) for no rewrite.
_SKIPPED_RULES = frozenset({"SlicesSplit"})


@contextlib.contextmanager
def without_unmatched_rules() -> Iterator[None]:
    """Inside the block, onnxscript's optimizer (``optimize_ir``, also run several times by
    ``ort_fusions.optimize_for_ort``) applies its default rewrite rules minus ``_SKIPPED_RULES``.
    onnxscript offers no parameter for it: the rule tuple it reads at each call is swapped for
    the block and restored after it."""
    from onnxscript import rewriter

    rules = rewriter._DEFAULT_REWRITE_RULES
    rewriter._DEFAULT_REWRITE_RULES = tuple(rule for rule in rules if rule.name not in _SKIPPED_RULES)
    try:
        yield
    finally:
        rewriter._DEFAULT_REWRITE_RULES = rules


def optimize_exported(model) -> None:
    """What ``torch.onnx.export(optimize=True)`` runs (``onnxscript.optimizer.optimize_ir``; its
    opset-23 fusions do not apply at opset 24), without ``_SKIPPED_RULES``. In place."""
    import onnxscript.optimizer

    with without_unmatched_rules():
        onnxscript.optimizer.optimize_ir(model)


def transpose_weights_lazily(model) -> dict[str, str]:
    """Replace the ``Transpose`` s of a 2-D initializer that only they read (a ``Linear``'s ``[out,
    in]`` weight, exported as ``MatMul(x, Transpose(W))``) by one initializer that holds the
    transposed ``[in, out]`` weight, computed only when read (the weights file writes it, one
    tensor at a time). The same graph as onnxscript's constant folding makes of a weight read once
    (it always folds such a Transpose, whatever its size), under the same value name, but the
    folded weights are not all copied in memory at once during export. A weight several layers
    share (Zamba2's one attention block, run at each hybrid layer) is read by a Transpose per use,
    which the constant folding leaves (and quantization after it, which takes only constant
    weights, with it): here its uses all read one transposed initializer. In place; returns {new
    initializer's name: the weight's name} (:func:`kvforge.compile.replicate.replicate` binds
    copies of layers by it)."""
    graph = model.graph
    replaced = {}
    for node in list(graph):
        if node.graph is None:  # a reader of a weight folded above
            continue
        weight = node.inputs[0] if node.op_type == "Transpose" and node.domain in ("", "ai.onnx") else None
        if weight is None or weight.const_value is None or not weight.is_initializer():
            continue
        source = weight.const_value
        readers = [use.node for use in weight.uses()]
        if (
            len(source.shape) != 2
            or not all(_swaps_two_axes(reader) for reader in readers)
            or weight.is_graph_output()
            or source.dtype.bitwidth < 8
        ):
            continue
        out = node.outputs[0]
        lazy = replicate.transposed_lazily(source, out.name)
        folded = ir.Value(name=out.name, shape=lazy.shape, type=weight.type, const_value=lazy)
        for reader in readers:
            graph.remove(reader, safe=False)
            reader.outputs[0].replace_all_uses_with(folded, replace_graph_outputs=True)
        graph.initializers.pop(weight.name)
        graph.register_initializer(folded)
        replaced[folded.name] = weight.name
    return replaced


def _swaps_two_axes(node) -> bool:
    """``node`` is a ``Transpose`` of a 2-D tensor (perm [1, 0] or none)."""
    if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
        return False
    perm = node.attributes.get("perm")
    return perm is None or list(perm.as_ints()) == [1, 0]


def _drop_stale_weights(module: torch.nn.Module) -> None:
    """Empty every ONNX value that is no graph's initializer and still holds one of ``module``'s
    parameters or buffers. The optimizer leaves such values behind: the initializers it folded
    away (a transposed copy replaced each) and a duplicate of a tied weight; onnx_ir's graph keeps
    stale values in its input bookkeeping, and onnxscript's module-level rewrite rules keep the
    last graph they matched. Each would keep a torch parameter, and with it the checkpoint's
    memory map, alive after the torch model is gone (SmolLM-135M: 620 MiB still mapped after the
    weights file was written). A walk of the heap (~0.3 s) finds them, whoever holds them."""
    import gc

    import onnx_ir as ir

    ours = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]} - {0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on deprecated torch objects warns
        stale = [obj for obj in gc.get_objects() if isinstance(obj, ir.Value)]
    for obj in stale:
        # An initializer of a live graph (this one, or another traced from the same model and
        # not written yet) keeps its tensor; a value no graph holds as an initializer is stale.
        if obj.is_initializer():
            continue
        raw = getattr(obj.const_value, "raw", None)  # the exporter's TorchTensor wraps a torch tensor
        if isinstance(raw, torch.Tensor) and raw.untyped_storage().data_ptr() in ours:
            obj.const_value = None


def _name_nodes(model) -> None:
    """Give nodes HF-traceable names (``/model/layers.0/self_attn/q_proj/linear``) from the module
    scopes the exporter records, then drop the exporter's per-node metadata (stack traces with local
    paths, FX dumps), which would be most of the graph file's bytes."""
    used: set[str] = set()
    for node in model.graph:
        scopes = node.metadata_props.get("pkg.torch.onnx.name_scopes")
        scopes = ast.literal_eval(scopes) if scopes else []
        module = scopes[-2] if len(scopes) > 1 else ""
        # "model.model.layers.0.mlp" -> ["model", "layers.0", "mlp"] (the wrapper's own "model." dropped)
        parts: list[str] = []
        if module.startswith("model."):
            for part in module.removeprefix("model.").split("."):
                if part.isdigit() and parts:
                    parts[-1] += f".{part}"
                else:
                    parts.append(part)
        name = "/" + "/".join([*parts, (node.name or node.op_type).removeprefix("node_")])
        while name in used:
            name += "_"
        used.add(name)
        node.name = name
        node.metadata_props.clear()
    for value in [*model.graph.inputs, *model.graph.outputs, *model.graph.initializers.values()]:
        value.metadata_props.clear()


class StreamedLayersError(RuntimeError):
    """The general graph needs a full trace, but the model was loaded with layers left in the
    checkpoint (:mod:`kvforge.compile.streamed`): load it whole and export again."""


def export_general(
    loaded: LoadedModel,
    lowering_name: str,
    max_batch: int,
    max_seq: int,
    times: ExportTimes | None = None,
    full_trace: bool = False,
):
    """The general graph: ``input_ids [B, S]``, ``position_ids [B, S]``, ``write_indices [B]``,
    ``logit_indices [B, K]`` (int64, positions in ``[0, S)``), pasts -> ``logits [B, K, V]``, presents.
    :mod:`kvforge.compile.derive` makes every contract graph from it.

    Where the decoder's layers are provably one computation, only the first
    :data:`kvforge.compile.replicate.TRACED` are traced and the others copied in the graph
    (:mod:`kvforge.compile.replicate`); ``full_trace`` traces every layer. ``times.trace`` says which
    was done, and why a full trace was needed."""
    times = times if times is not None else ExportTimes()
    n = loaded.dims.num_layers
    module = GeneralGraph(loaded.model, loaded.spec, loaded.layout).eval()
    # a family with state layers is traced whole: its layers are not one computation; 8-bit KV too
    # (the layer copies map each layer's key and value inputs, not yet its scales)
    layout = loaded.state_layout
    plan = replicate.plan(loaded.model, n, full_trace or layout.has_state or layout.quantized_kv)
    model, optimized = None, False
    if plan.stack is not None:
        with replicate.truncated(loaded.model, plan.stack, plan.traced):
            model = _trace_general(module, loaded, plan.traced, lowering_name, max_batch, max_seq, times)
        model, optimized = _copy_layers(model, plan, times, loaded.streamed)
    else:
        times.trace = f"traced all {n} layers: {plan.reason}"
    if model is None and loaded.streamed is not None:
        raise StreamedLayersError(f"the layers could not be copied ({times.trace}), and some are not loaded")
    if model is None:
        model = _trace_general(module, loaded, n, lowering_name, max_batch, max_seq, times)
    _finish(model, module, times, optimized)
    return model


def _copy_layers(short, plan: replicate.TracePlan, times: ExportTimes, streamed=None):
    """``(model, optimized)``: the graph of every layer from ``short``, the raw trace of the first
    ``plan.traced``; or ``(None, False)`` when the traced layers do not prove the copies right
    (``times.trace`` says why). Tried first on ``short`` after onnxscript's optimizer (a pass over
    3 layers, not all of them: ``optimized``), then on the raw trace, which the optimizer then
    takes whole."""
    from onnx_ir.passes import common as common_passes

    n, scope = plan.total, f"model.{plan.stack.path}"
    started = time.perf_counter()
    transposed = transpose_weights_lazily(short)
    raw = short.clone()  # shares the tensors
    independent = replicate.layer_independent_names(short, scope, plan.traced, transposed)
    optimize_exported(short)
    times.add("onnxscript optimizer", time.perf_counter() - started)
    started = time.perf_counter()
    copied = f"traced {plan.traced} of {n} layers, copied the other {n - plan.traced} in the graph"
    try:
        replicate.replicate(short, scope, plan.stack.layers, plan.traced, transposed, independent, streamed)
        # What the optimizer's last passes would do on the whole graph: equal small weights of
        # the copies merged into one initializer, as in the traced layers.
        common_passes.DeduplicateInitializersPass()(short)
        common_passes.CommonSubexpressionEliminationPass()(short)
        times.add("layer copies", time.perf_counter() - started)
        times.trace = f"{copied} after the optimizer"
        return short, True
    except replicate.NotReplicable as e:
        after_optimizer = str(e)
    del short
    try:
        replicate.replicate(raw, scope, plan.stack.layers, plan.traced, transposed, streamed=streamed)
        times.trace = f"{copied} before the optimizer (after it: {after_optimizer})"
        return raw, False
    except replicate.NotReplicable as e:
        times.trace = f"traced all {n} layers: {e}"
        return None, False
    finally:
        times.add("layer copies", time.perf_counter() - started)


def _trace_general(module, loaded: LoadedModel, n: int, lowering_name: str, max_batch: int, max_seq: int, times):
    """The raw trace of ``module`` (a :class:`GeneralGraph`) with ``n`` layers' caches."""
    batch, seq, capacity = _dims(max_batch, max_seq)
    positions = torch.export.Dim(POSITIONS_DIM, min=1, max=max(max_seq, _EXAMPLE_CAPACITY))
    b, s, k = _EXAMPLE_BATCH, _EXAMPLE_SEQ, _EXAMPLE_POSITIONS
    args = (
        torch.ones(b, s, dtype=torch.int64),
        torch.arange(s).expand(b, s).contiguous(),
        torch.zeros(b, dtype=torch.int64),
        torch.arange(s - k, s).expand(b, k).contiguous(),
        *_example_past(loaded, n),
    )
    shapes = (
        {0: batch, 1: seq},
        {0: batch, 1: seq},
        {0: batch},
        {0: batch, 1: positions},
        _past_shapes(loaded, batch, capacity, n),
    )
    layers = _names_layout(loaded, n)
    names = [*contract.decode_input_names(n)[:3], LOGIT_INDICES, *contract.past_names(layers)]
    return _trace(module, args, shapes, names, contract.output_names(layers), lowering_name, times)


def export_prefill(loaded: LoadedModel, lowering_name: str, max_batch: int, max_seq: int, all_logits: bool = False):
    """The prefill graph: ``input_ids [B, S]`` ... -> ``logits [B, V]``, presents. With
    ``all_logits``, the score graph instead: no ``input_lengths`` input, ``logits [B, S, V]``."""
    n = loaded.dims.num_layers
    batch, seq, capacity = _dims(max_batch, max_seq)
    b, s = _EXAMPLE_BATCH, _EXAMPLE_SEQ
    lengths = [] if all_logits else [torch.full((b,), s, dtype=torch.int64)]
    args = (
        torch.ones(b, s, dtype=torch.int64),
        torch.arange(s).expand(b, s).contiguous(),
        torch.zeros(b, dtype=torch.int64),
        *lengths,
        *_example_past(loaded),
    )
    shapes = (
        {0: batch, 1: seq},
        {0: batch, 1: seq},
        {0: batch},
        *({0: batch} for _ in lengths),
        _past_shapes(loaded, batch, capacity),
    )
    graph = "score" if all_logits else "prefill"
    module = (ScoreGraph if all_logits else PrefillGraph)(loaded.model, loaded.spec, loaded.layout).eval()
    layers = _names_layout(loaded, n)
    return _export(
        module, args, shapes, contract.input_names(graph, layers), contract.output_names(layers), lowering_name
    )


def export_decode(loaded: LoadedModel, lowering_name: str, max_batch: int, max_seq: int):
    """The decode graph: ``input_ids [B, 1]`` ... -> ``logits [B, V]``, presents."""
    n = loaded.dims.num_layers
    batch, _, capacity = _dims(max_batch, max_seq)
    b = _EXAMPLE_BATCH
    args = (
        torch.ones(b, 1, dtype=torch.int64),
        torch.full((b, 1), _EXAMPLE_SEQ, dtype=torch.int64),
        torch.full((b,), _EXAMPLE_SEQ, dtype=torch.int64),
        *_example_past(loaded),
    )
    shapes = ({0: batch}, {0: batch}, {0: batch}, _past_shapes(loaded, batch, capacity))
    module = DecodeGraph(loaded.model, loaded.spec, loaded.layout).eval()
    layers = _names_layout(loaded, n)
    return _export(
        module, args, shapes, contract.decode_input_names(layers), contract.output_names(layers), lowering_name
    )
