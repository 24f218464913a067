"""Export pass: a trace of the first layers of the decoder stack -> the graph of the whole stack.

Tracing costs time per layer (``torch.export`` and the ONNX translation: ~0.6 s a layer of the
SmolLM-135M shape on 2 cores, 20 of compile's 38 s; onnxscript's optimizer ~0.1 s more), and a
decoder stack repeats one computation.
So when every layer is provably the same computation, compile traces only the first
:data:`TRACED` layers (the stack's ``ModuleList`` cut to them, the config's layer count with it,
both restored after) and copies the last traced layer's subgraph for the others.

Input: the ``onnx_ir.Model`` of ``torch.onnx.export`` of the general graph over :data:`TRACED`
layers, whose nodes still carry the exporter's module scopes (``model.model.layers.2...``): after
onnxscript's optimizer (compile's first try: the optimizer then runs over 3 layers, not all) or
raw (its fallback, where the optimized layers do not pass the checks below: a rewrite that drops
the scopes of the nodes it makes, per-layer constants it folds). Output: the same model, edited in
place, with every layer. Layer ``i``'s copy reads its own initializers, bound to layer ``i``'s
torch parameters and buffers the way the exporter binds them (a wrapper of the tensor: no bytes
are copied; a weight the graph reads transposed is transposed lazily, when the weights file
writes it), its own ``past_key_values.{i}.key|value`` inputs and writes ``present.{i}.key|value``
outputs (contract order), and reads from layer ``i - 1``'s copy what the last traced layer read
from the one before it.

Same computation, checked in two steps (either refusal means the full trace, and says why):

1. before tracing (:func:`plan`): every layer is the same module tree (classes, parameter and
   buffer names, shapes and dtypes, every plain attribute but ``layer_idx``: sliding window,
   layer type, scaling, ...) and every per-layer list of the config (``layer_types``, ...) holds
   one value;
2. after tracing (:func:`replicate`): the last two traced layers are the same graph node for node
   (op, attributes, module scope), and their inputs differ only as a layer's should: its own
   weights, its own cache, and the previous layer's values; what both read alike depends on no
   layer's weights or cache (positions, masks, rotary cos/sin).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
import torch

from kvforge.graphs import contract
from kvforge.graphs.wrappers import decoder_of

TRACED = 3  # layers traced: the first, and two that show how a layer follows another
_SCOPES = "pkg.torch.onnx.name_scopes"  # the exporter's per-node module scopes
_IGNORED_ATTRIBUTES = frozenset({"layer_idx", "training"})


class NotReplicable(ValueError):
    """The traced layers do not prove that copying the last one gives the other layers."""


@dataclass(frozen=True)
class LayerStack:
    """The decoder's ``ModuleList`` of layers: ``parent.<attribute>``, at ``path`` in the LM."""

    parent: torch.nn.Module
    attribute: str
    path: str  # "model.layers" in a LlamaForCausalLM
    layers: tuple[torch.nn.Module, ...]  # every layer, also while the list is cut


@dataclass(frozen=True)
class TracePlan:
    """How to trace: ``traced`` of ``total`` layers (``stack`` set) or all of them (``stack`` None,
    ``reason`` says why)."""

    total: int
    traced: int
    stack: LayerStack | None
    reason: str = ""


def plan(model: torch.nn.Module, num_layers: int, full_trace: bool = False) -> TracePlan:
    """Trace :data:`TRACED` layers of ``model`` (a ``*ForCausalLM``) and copy the rest, or all of
    them when ``full_trace``, when the stack is too short, or when its layers differ."""
    full = TracePlan(num_layers, num_layers, None)
    if full_trace:
        return TracePlan(num_layers, num_layers, None, "full trace asked for")
    if num_layers <= TRACED:
        return TracePlan(num_layers, num_layers, None, f"{num_layers} layers, no more than a prefix of {TRACED}")
    stack = find_stack(model, num_layers)
    if isinstance(stack, str):
        return TracePlan(full.total, full.traced, None, stack)
    why = _config_difference(model, num_layers) or _layer_difference(stack.layers)
    if why:
        return TracePlan(full.total, full.traced, None, why)
    return TracePlan(num_layers, TRACED, stack)


def find_stack(model: torch.nn.Module, num_layers: int) -> LayerStack | str:
    """The decoder's one ``ModuleList`` of ``num_layers`` modules, or why there is none."""
    decoder = decoder_of(model)
    lists = [
        (name, child)
        for name, child in decoder.named_children()
        if isinstance(child, torch.nn.ModuleList) and len(child) == num_layers
    ]
    if len(lists) != 1:
        return f"the decoder has {len(lists)} ModuleLists of {num_layers} layers, not one"
    attribute, layers = lists[0]
    path = next(name for name, module in model.named_modules() if module is layers)
    return LayerStack(decoder, attribute, path, tuple(layers))


def _configs(model: torch.nn.Module) -> list:
    configs = [model.config]
    decoder_config = getattr(decoder_of(model), "config", None)
    if decoder_config is not None and decoder_config is not model.config:
        configs.append(decoder_config)
    return configs


def _config_difference(model: torch.nn.Module, num_layers: int) -> str | None:
    """Why the config treats layers differently, or None: a list with one entry per layer
    (``layer_types``, ...) that holds more than one value."""
    for config in _configs(model):
        if getattr(config, "num_hidden_layers", None) != num_layers:
            return f"config.num_hidden_layers is {getattr(config, 'num_hidden_layers', None)}, not {num_layers}"
        for key, value in vars(config).items():
            if isinstance(value, (list, tuple)) and len(value) == num_layers and not _all_same(value):
                return f"config.{key} differs across layers ({', '.join(sorted({repr(v) for v in value}))})"
    return None


def _all_same(values: Sequence) -> bool:
    return all(_same(values[0], v) for v in values[1:])


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and bool(torch.equal(a, b))
        )
    if a is b:
        return True
    if isinstance(a, functools.partial) and isinstance(b, functools.partial):  # one per layer (Gemma's act_fn)
        return a.func is b.func and _same(list(a.args), list(b.args)) and _same(a.keywords, b.keywords)
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # an == that returns no bool (arrays, ...): distinct objects differ
        return False


def _signature(layer: torch.nn.Module) -> list[tuple[str, str, dict, list, list]]:
    """What makes a layer's computation, but for its weights' values and its index: per submodule,
    its class, plain attributes, parameter and buffer names with shapes and dtypes."""
    signature = []
    for name, module in layer.named_modules(remove_duplicate=False):
        attributes = {k: v for k, v in vars(module).items() if not k.startswith("_") and k not in _IGNORED_ATTRIBUTES}
        tensors = [
            [(n, tuple(t.shape), t.dtype) for n, t in named]
            for named in (module.named_parameters(recurse=False), module.named_buffers(recurse=False))
        ]
        signature.append((name, type(module).__qualname__, attributes, *tensors))
    return signature


def _layer_difference(layers: Sequence[torch.nn.Module]) -> str | None:
    """Why some layer is not the same computation as layer 0, or None."""
    first = _signature(layers[0])
    for index, layer in enumerate(layers[1:], start=1):
        other = _signature(layer)
        for (name, kind, attrs, params, buffers), (name_i, kind_i, attrs_i, params_i, buffers_i) in zip(first, other):
            if (name, kind) != (name_i, kind_i):
                return f"layer {index}'s {name_i or 'module'} is {kind_i}, layer 0's {name or 'module'} {kind}"
            where = f"layer {index}'s {name or 'module'}"
            if params != params_i or buffers != buffers_i:
                return f"{where} has other parameters or buffers than layer 0's"
            for key in sorted(set(attrs) | set(attrs_i)):
                if key not in attrs or key not in attrs_i or not _same(attrs[key], attrs_i[key]):
                    return f"{where} has {key}={_short(attrs_i.get(key))}, layer 0's {key}={_short(attrs.get(key))}"
        if len(other) != len(first):
            return f"layer {index} has {len(other)} modules, layer 0 {len(first)}"
    return None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@contextlib.contextmanager
def truncated(model: torch.nn.Module, stack: LayerStack, keep: int) -> Iterator[None]:
    """Inside the block, ``model`` has its first ``keep`` layers only: the stack's ``ModuleList``
    and the config's ``num_hidden_layers`` (and ``layer_types``) are cut, and restored after."""
    saved: list[tuple[object, str, object]] = [(stack.parent, stack.attribute, getattr(stack.parent, stack.attribute))]
    try:
        setattr(stack.parent, stack.attribute, torch.nn.ModuleList(stack.layers[:keep]))
        for config in _configs(model):
            saved.append((config, "num_hidden_layers", config.num_hidden_layers))
            config.num_hidden_layers = keep
            layer_types = getattr(config, "layer_types", None)
            if isinstance(layer_types, (list, tuple)) and len(layer_types) == len(stack.layers):
                saved.append((config, "layer_types", layer_types))
                config.layer_types = layer_types[:keep]
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def _layer_of(node: ir.Node, pattern: re.Pattern) -> int | None:
    """The decoder layer whose module scope ``node`` was traced in, or None (outside the layers)."""
    scopes = node.metadata_props.get(_SCOPES)
    if not scopes:
        return None
    found = {int(m.group(1)) for scope in ast.literal_eval(scopes) if (m := pattern.fullmatch(scope))}
    if len(found) > 1:
        raise NotReplicable(f"node {node.name} lies in the scopes of layers {sorted(found)}")
    return found.pop() if found else None


def _renamed_scopes(node: ir.Node, scope: str, source: int, target: int) -> str | None:
    scopes = node.metadata_props.get(_SCOPES)
    if not scopes:
        return None
    old, new = f"{scope}.{source}", f"{scope}.{target}"
    renamed = [new + s[len(old) :] if s == old or s.startswith(old + ".") else s for s in ast.literal_eval(scopes)]
    return repr(renamed)


def _modules(scopes: str | None) -> list[str]:
    """The module path of a node's scopes (the last scope is the node's own FX name, numbered
    differently in each layer)."""
    return ast.literal_eval(scopes)[:-1] if scopes else []


def _attribute_difference(a: ir.Node, b: ir.Node) -> str | None:
    if set(a.attributes) != set(b.attributes):
        return f"attributes {sorted(a.attributes)} vs {sorted(b.attributes)}"
    for name, attr in a.attributes.items():
        other = b.attributes[name]
        if attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
            return f"a subgraph attribute {name!r}"
        if attr.type != other.type or attr.ref_attr_name != other.ref_attr_name:
            return f"attribute {name!r} of another kind"
        if attr.type == ir.AttributeType.TENSOR:
            same = attr.value.dtype == other.value.dtype and attr.value.tobytes() == other.value.tobytes()
        else:
            same = attr.value == other.value
        if not same:
            return f"attribute {name}={_short(attr.value)} vs {_short(other.value)}"
    return None


def _same_constant(a: ir.Value, b: ir.Value) -> bool:
    """Two initializers that are no layer's weights hold equal tensors (lifted constants)."""
    x, y = a.const_value, b.const_value
    return (
        a.is_initializer()
        and b.is_initializer()
        and x is not None
        and y is not None
        and x.dtype == y.dtype
        and tuple(x.shape) == tuple(y.shape)
        and x.tobytes() == y.tobytes()
    )


def _layer_dependent(
    graph: ir.Graph,
    scope: str,
    pasts: set[str],
    transposed: Mapping[str, str],
    independent: set[str] | None = None,
) -> set[ir.Value]:
    """Values computed from some layer's weights or cache contents (a Shape of one is not: every
    layer's tensors have the same shapes). With ``independent`` (the names of the values that
    depend on neither in the raw trace, :func:`layer_independent_names`), every initializer not
    named there counts as dependent too: a constant onnxscript's optimizer folded may come from a
    layer's weight (Gemma's ``1 + weight``)."""
    tainted = {
        v
        for name, v in graph.initializers.items()
        if name.startswith(scope + ".") or name in transposed or (independent is not None and name not in independent)
    }
    tainted |= {v for v in graph.inputs if v.name in pasts}
    for node in graph:
        if node.op_type in ("Shape", "Size") and node.domain in ("", "ai.onnx"):
            continue
        if any(v is not None and v in tainted for v in node.inputs):
            tainted.update(node.outputs)
    return tainted


def transposed_lazily(source: ir.TensorProtocol, name: str) -> ir.LazyTensor:
    """``source`` (2-D) transposed, computed only when read (the weights file writes it, one tensor
    at a time), C-contiguous."""
    shape = ir.Shape([source.shape[1], source.shape[0]])

    def transposed() -> ir.Tensor:
        return ir.Tensor(np.ascontiguousarray(source.numpy().T), name=name)

    lazy = ir.LazyTensor(transposed, dtype=source.dtype, shape=shape, name=name)
    lazy.kvforge_source = source  # what it transposes (kvforge.compile.streamed rebinds it)
    return lazy


def _weight_of(value: ir.Value, pattern: re.Pattern, transposed: Mapping[str, str]) -> tuple[int, str, bool] | None:
    """``(layer, name in the layer, transposed)`` when ``value`` is a layer's weight as the graph
    reads it: the exporter's initializer ``<stack>.{layer}.<name>``, or its lazily transposed copy
    (``transposed`` maps such a value's name to the weight's)."""
    if not value.is_initializer():
        return None
    source = transposed.get(value.name)
    match = pattern.fullmatch(source if source is not None else value.name)
    return (int(match.group(1)), match.group(2), source is not None) if match else None


def layer_independent_names(
    model: ir.Model, scope: str, traced: int, transposed: Mapping[str, str] | None = None
) -> set[str]:
    """The names of the values of ``model`` (the raw trace, before the optimizer) that depend on no
    layer's weights or cache: what :func:`replicate` may let every copy share after the optimizer."""
    graph = model.graph
    tainted = _layer_dependent(graph, scope, set(contract.past_names(traced)), transposed or {})
    values = [*graph.inputs, *graph.initializers.values(), *(out for node in graph for out in node.outputs)]
    return {v.name for v in values if v not in tainted and v.name}


def _layer_tensors(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        **dict(layer.named_parameters(remove_duplicate=False)),
        **dict(layer.named_buffers(remove_duplicate=False)),
    }


def replicate(
    model: ir.Model,
    scope: str,
    layers: Sequence[torch.nn.Module],
    traced: int,
    transposed: Mapping[str, str] | None = None,
    independent: set[str] | None = None,
    streamed=None,
) -> int:
    """Add layers ``traced .. len(layers) - 1`` to ``model`` (traced with its first ``traced``
    layers), each a copy of layer ``traced - 1`` bound to its own weights and cache; in place.
    ``scope`` is the stack's path in the traced wrapper (``model.model.layers``): its layers'
    module scopes and initializer names start with it. ``transposed`` names the initializers that
    hold a weight transposed (:func:`kvforge.compile.export.transpose_weights_lazily`): {value name:
    weight name}. The model may come straight from the exporter or from onnxscript's optimizer
    (then small weights of equal content may be one initializer: the copies get their own, which
    the optimizer's deduplication merges again; and ``independent``, the raw trace's
    :func:`layer_independent_names`, says which of the optimizer's constants the layers may share:
    any other is taken as made from a layer's weights). Returns the nodes added. Raises
    :class:`NotReplicable`, with the model untouched, when the traced layers do not show that the
    copies compute what the layers would. ``streamed`` (:class:`kvforge.compile.streamed.StreamedLayers`):
    the layers whose parameters are on ``meta`` and stay in the checkpoint; their copies bind
    tensors read from it when the weights file takes them."""
    from torch.onnx._internal.exporter._core import TorchTensor  # how the exporter binds weights

    transposed = transposed or {}

    graph = model.graph
    total = len(layers)
    if traced < 3 or total <= traced:
        raise NotReplicable(f"replication needs 3 traced layers and more in the model ({traced} of {total})")
    a, b = traced - 2, traced - 1
    pattern = re.compile(re.escape(scope) + r"\.(\d+)")
    by_layer: dict[int | None, list[ir.Node]] = {}
    for node in graph:
        by_layer.setdefault(_layer_of(node, pattern), []).append(node)
    nodes_a, nodes_b, nodes_before = by_layer.get(a, []), by_layer.get(b, []), set(by_layer.get(a - 1, []))
    if not nodes_b or len(nodes_a) != len(nodes_b):
        raise NotReplicable(f"layers {a} and {b} traced to {len(nodes_a)} and {len(nodes_b)} nodes")
    in_a, in_b = set(nodes_a), set(nodes_b)
    past_of = {contract.past_key_name(b): "key", contract.past_value_name(b): "value"}
    past_a = {contract.past_key_name(a): "key", contract.past_value_name(a): "value"}
    tainted = _layer_dependent(graph, scope, set(contract.past_names(traced)), transposed, independent)
    weight_pattern = re.compile(re.escape(scope) + r"\.(\d+)\.(.+)")
    tensors = [_layer_tensors(layer) for layer in layers]

    mapping: dict[ir.Value, ir.Value] = {}  # layer a's values -> layer b's
    # layer b's weights -> (their name in the layer ("mlp.up_proj.weight"), transposed, merged)
    params: dict[ir.Value, tuple[str, bool, bool]] = {}
    pasts: dict[ir.Value, str] = {}  # layer b's cache inputs -> "key" | "value"
    streams: set[ir.Value] = set()  # layer a's values that layer b reads
    for na, nb in zip(nodes_a, nodes_b):
        what = f"layer {b}'s node {nb.name} ({nb.op_type})"
        if (na.domain, na.op_type, na.overload, len(na.inputs), len(na.outputs)) != (
            nb.domain,
            nb.op_type,
            nb.overload,
            len(nb.inputs),
            len(nb.outputs),
        ):
            raise NotReplicable(f"{what} differs from layer {a}'s {na.name} ({na.op_type})")
        why = _attribute_difference(na, nb)
        if why or _modules(_renamed_scopes(na, scope, a, b)) != _modules(nb.metadata_props.get(_SCOPES)):
            raise NotReplicable(f"{what} differs from layer {a}'s: {why or 'module scope'}")
        for x, y in zip(na.inputs, nb.inputs):
            if x is None or y is None:
                if x is not y:
                    raise NotReplicable(f"{what} has an input that layer {a}'s lacks")
                continue
            wx, wy = _weight_of(x, weight_pattern, transposed), _weight_of(y, weight_pattern, transposed)
            if x.producer() in in_a:  # wiring inside the layer
                if mapping.get(x) is not y:
                    raise NotReplicable(f"{what} is wired otherwise than in layer {a}")
            elif y.producer() in in_a:  # the previous layer's value (the hidden state)
                if x.producer() not in nodes_before:
                    raise NotReplicable(f"{what} reads layer {a}'s {y.name}, but layer {a} no value of layer {a - 1}")
                streams.add(y)
            elif wx is not None or wy is not None:  # each layer's own weight
                params[y] = _weight_pair(x, y, wx, wy, (a, b), tensors, what)
            elif x is y:  # shared by every layer: must depend on no layer's weights or cache
                if x in tainted:
                    raise NotReplicable(f"layers {a} and {b} both read {x.name}, which depends on a layer's weights")
            elif past_a.get(x.name) is not None and past_of.get(y.name) == past_a[x.name] and y.is_graph_input():
                pasts[y] = past_of[y.name]
            elif _same_constant(x, y) and y not in tainted:
                pass  # equal lifted constants: the copies read layer b's
            else:
                raise NotReplicable(f"{what} reads {y.name} where layer {a} reads {x.name}")
        for x, y in zip(na.outputs, nb.outputs):
            mapping[x] = y
    if sorted(pasts.values()) != ["key", "value"]:
        raise NotReplicable(f"layer {b} reads {len(pasts)} cache inputs, not its key and value")

    # What leaves the layers: layer a's values go to layer b or are its presents; layer b's go to
    # its presents or to the graph's tail (final norm), which must read what a next layer would.
    present_a = {contract.present_key_name(a): "key", contract.present_value_name(a): "value"}
    present_b = {contract.present_key_name(b): "key", contract.present_value_name(b): "value"}
    for x, y in mapping.items():
        outside = [use.node for use in x.uses() if use.node not in in_a]
        if any(node not in in_b for node in outside):
            raise NotReplicable(f"layer {a}'s {x.name} is read outside layers {a} and {b}")
        if x.is_graph_output() != y.is_graph_output() or (
            x.is_graph_output() and present_a.get(x.name, "a") != present_b.get(y.name, "b")
        ):
            raise NotReplicable(f"layer {b}'s output {y.name} is not layer {a}'s {x.name} of the next layer")
    next_inputs = {mapping[y] for y in streams}
    tail: list[tuple[ir.Value, ir.Node, int]] = []  # layer b's value, a node outside the layers, its input index
    for y in mapping.values():
        for use in y.uses():
            if use.node in in_b:
                continue
            if y not in next_inputs:
                raise NotReplicable(f"{use.node.name} reads layer {b}'s {y.name}, which no next layer would read")
            tail.append((y, use.node, use.idx))
    presents = {present_b[y.name]: y for y in mapping.values() if y.is_graph_output()}
    if sorted(presents) != ["key", "value"]:
        raise NotReplicable(f"layer {b} writes {sorted(presents)} of its cache, not its key and value")

    # The weights of every copy, checked before the graph changes.
    layer_b = tensors[b]
    for value, (name, flip, merged) in params.items():
        raw = getattr(value.const_value, "raw", None)
        if not flip and not merged and (name not in layer_b or raw is not layer_b[name]):
            raise NotReplicable(f"{value.name} is not layer {b}'s tensor {name} as the exporter bound it")
    weights = tensors
    for i in range(traced, total):
        for name, _, _ in params.values():
            tensor = weights[i].get(name)
            if tensor is None or tensor.shape != layer_b[name].shape or tensor.dtype != layer_b[name].dtype:
                raise NotReplicable(f"layer {i} has no {name} like layer {b}'s")

    added = 0
    anchor = nodes_b[-1]
    previous: dict[ir.Value, ir.Value] = {y: y for y in mapping.values()}  # layer b's values -> layer i-1's
    past_template = {kind: value for value, kind in pasts.items()}
    for i in range(traced, total):
        inputs = {}
        for kind, name in (("key", contract.past_key_name(i)), ("value", contract.past_value_name(i))):
            template = past_template[kind]
            inputs[kind] = ir.Value(name=name, shape=_copy_shape(template.shape), type=template.type)
            graph.inputs.append(inputs[kind])
        own = {}
        for value, (name, flip, _) in params.items():
            full = f"{value.name}__{i}" if flip else f"{scope}.{i}.{name}"
            if streamed is not None and streamed.streams(i):
                tensor = streamed.tensor(i, name, tuple(weights[i][name].shape))
            else:
                tensor = TorchTensor(weights[i][name], name=f"{scope}.{i}.{name}")
            own[value] = ir.Value(
                name=full,
                shape=_copy_shape(value.shape),
                type=value.type,
                const_value=transposed_lazily(tensor, full) if flip else tensor,
            )
            graph.register_initializer(own[value])
        copies: dict[ir.Value, ir.Value] = {}
        new_nodes = []
        for node in nodes_b:
            node_inputs = []
            for v in node.inputs:
                if v is None:
                    node_inputs.append(None)
                elif v in copies:
                    node_inputs.append(copies[v])
                elif v in own:
                    node_inputs.append(own[v])
                elif v in pasts:
                    node_inputs.append(inputs[pasts[v]])
                elif v in streams:
                    node_inputs.append(previous[mapping[v]])
                else:
                    node_inputs.append(v)
            metadata = {_SCOPES: _renamed_scopes(node, scope, b, i)} if node.metadata_props.get(_SCOPES) else None
            copy = ir.Node(
                node.domain,
                node.op_type,
                node_inputs,
                [ir.Attr(x.name, x.type, x.value, ref_attr_name=x.ref_attr_name) for x in node.attributes.values()],
                overload=node.overload,
                num_outputs=len(node.outputs),
                version=node.version,
                name=node.name,
                metadata_props=metadata,
            )
            for out, original in zip(copy.outputs, node.outputs):
                out.name, out.type, out.shape = f"{original.name}__{i}", original.type, _copy_shape(original.shape)
                copies[original] = out
            new_nodes.append(copy)
        graph.insert_after(anchor, new_nodes)
        anchor = new_nodes[-1]
        added += len(new_nodes)
        for kind, name in (("key", contract.present_key_name(i)), ("value", contract.present_value_name(i))):
            present = copies[presents[kind]]
            present.name = name
            graph.outputs.append(present)
        previous = copies
    for value, node, index in tail:
        node.replace_input_with(index, previous[value])
    graph.sort()  # the tail now reads the last copy, inserted after it
    return added


def _weight_pair(
    x: ir.Value,
    y: ir.Value,
    wx: tuple[int, str, bool] | None,
    wy: tuple[int, str, bool] | None,
    layer_pair: tuple[int, int],
    tensors: Sequence[dict[str, torch.Tensor]],
    what: str,
) -> tuple[str, bool, bool]:
    """``(name in the layer, transposed, merged)`` of the weight that layer b reads as ``y`` where
    layer a reads ``x``: each its own (``<stack>.a.<name>``, ``<stack>.b.<name>``), or one value
    that onnxscript's optimizer merged from several layers' equal tensors (``merged``: checked
    equal here, byte for byte, to layers a's and b's own)."""
    from torch.onnx._internal.exporter._core import TorchTensor

    a, b = layer_pair
    if wx is None or wy is None or wx[1:] != wy[1:]:
        raise NotReplicable(f"{what} reads {y.name} where layer {a} reads {x.name}")
    (layer_x, name, flip), layer_y = wx, wy[0]
    if (layer_x, layer_y) == (a, b) and x is not y:
        return name, flip, False
    if x is y and y.const_value is not None and name in tensors[a] and name in tensors[b]:
        stored = y.const_value.numpy()
        own = [TorchTensor(tensors[layer][name]).numpy() for layer in (a, b)]
        if all(np.array_equal(t.T if flip else t, stored) for t in own):
            return name, flip, True
    raise NotReplicable(f"{what} reads {y.name}, a weight of layer {layer_x}, where layer {a} reads {x.name}")


def _copy_shape(shape: ir.Shape | None) -> ir.Shape | None:
    return None if shape is None else shape.copy()
