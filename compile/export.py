"""Stage 2: a loaded transformers model -> the prefill and decode ONNX graphs (in memory).

Input: :class:`kvforge.compile.load.LoadedModel`. Output: two ``onnx_ir.Model`` objects whose I/O
follows :mod:`kvforge.graphs.contract`, with symbolic ``batch``, ``seq`` and ``capacity`` dims. The
weights are still inside the models; :mod:`kvforge.compile.weights` moves them to one shared file.
"""

from __future__ import annotations

import ast
import warnings

import torch

from kvforge.compile.load import LoadedModel
from kvforge.graphs import contract, lowering
from kvforge.graphs.wrappers import DecodeGraph, PrefillGraph, ScoreGraph

OPSET = 24

# Example sizes for tracing. Distinct values, none 0 or 1, so that no dynamic dim gets specialized.
_EXAMPLE_BATCH, _EXAMPLE_SEQ, _EXAMPLE_CAPACITY = 2, 7, 37


def _example_past(loaded: LoadedModel) -> list[torch.Tensor]:
    d = loaded.dims
    dtype = next(loaded.model.parameters()).dtype
    shape = (_EXAMPLE_BATCH, d.num_kv_heads, _EXAMPLE_CAPACITY, d.head_dim)
    return [torch.zeros(shape, dtype=dtype) for _ in range(2 * d.num_layers)]


def _dims(max_batch: int, max_seq: int) -> tuple[object, object, object]:
    batch = torch.export.Dim("batch", min=1, max=max(max_batch, _EXAMPLE_BATCH))
    seq = torch.export.Dim("seq", min=1, max=max(max_seq, _EXAMPLE_CAPACITY))
    capacity = torch.export.Dim("capacity", min=2, max=max(max_seq, _EXAMPLE_CAPACITY))
    return batch, seq, capacity


def _export(module: torch.nn.Module, args: tuple, dynamic_shapes: tuple, input_names, output_names, lowering_name):
    with warnings.catch_warnings(), torch.no_grad():
        # The exporter warns about things that do not concern us (missing torchvision ops, ...).
        warnings.simplefilter("ignore")
        # One eager call first: some modules create buffers lazily on their first forward (Phi-3's
        # longrope frequencies); created during tracing, they would be fake tensors, not constants.
        module(*args)
        program = torch.onnx.export(
            module,
            args,
            dynamo=True,
            opset_version=OPSET,
            dynamic_shapes=dynamic_shapes,
            input_names=input_names,
            output_names=output_names,
            custom_translation_table=lowering.translation_table(lowering_name),
            optimize=True,
            verbose=False,
        )
    model = program.model
    _name_nodes(model)
    return model


def _name_nodes(model) -> None:
    """Give nodes HF-traceable names (``/model/layers.0/self_attn/q_proj/linear``) from the module
    scopes the exporter records, then drop the exporter's per-node metadata (stack traces with local
    paths, FX dumps), which would be most of the graph file's bytes."""
    used: set[str] = set()
    for node in model.graph:
        scopes = node.metadata_props.get("pkg.torch.onnx.name_scopes")
        module = ast.literal_eval(scopes)[-2] if scopes and len(ast.literal_eval(scopes)) > 1 else ""
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
        tuple({0: batch, 2: capacity} for _ in range(2 * n)),
    )
    graph = "score" if all_logits else "prefill"
    module = (ScoreGraph if all_logits else PrefillGraph)(loaded.model, loaded.spec).eval()
    return _export(module, args, shapes, contract.input_names(graph, n), contract.output_names(n), lowering_name)


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
    shapes = ({0: batch}, {0: batch}, {0: batch}, tuple({0: batch, 2: capacity} for _ in range(2 * n)))
    module = DecodeGraph(loaded.model, loaded.spec).eval()
    return _export(module, args, shapes, contract.decode_input_names(n), contract.output_names(n), lowering_name)
