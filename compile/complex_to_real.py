"""Rewrite the complex-number arithmetic of an exported program into real pairs, before ONNX.

Input: a ``torch.export.ExportedProgram`` (decomposed to ATen) of a family that computes in
complex numbers: DeepSeek-V2 and Llama 4 apply their rotary embeddings as
``view_as_real(view_as_complex(x) * polar(1, angle))``. Output: the same program, in place, with
every complex value ``z [..., n]`` carried as a real tensor ``[..., n, 2]`` (real and imaginary
parts on a last axis, the layout ``view_as_real`` gives), so that ``torch.onnx.export`` meets only
real tensors: its translations of complex-valued ops are incomplete (no ``unsqueeze``, no product
with a real scalar).

Rewritten ops (each keeps its value exactly, up to float rounding): ``polar``, ``view_as_complex``,
``view_as_real``, ``unsqueeze``, ``mul`` (complex by complex, or by a real tensor or scalar),
``clone``/``_to_copy``/``alias`` within complex64, and ``_assert_tensor_metadata`` (dropped). Any
other op on a complex value raises :class:`ComplexOpError` naming it, before the ONNX translation.
"""

from __future__ import annotations

import torch
from torch._guards import detect_fake_mode

aten = torch.ops.aten


class ComplexOpError(ValueError):
    """The program computes in complex numbers with an op this pass does not rewrite."""


def _is_complex(node) -> bool:
    val = getattr(node, "meta", {}).get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.is_complex()


def has_complex(program: torch.export.ExportedProgram) -> bool:
    """True when any value of ``program``'s graph is complex."""
    return any(_is_complex(node) for node in program.graph.nodes)


def rewrite(program: torch.export.ExportedProgram) -> int:
    """Carry ``program``'s complex values as real pairs (see the module docstring); returns the
    number of nodes rewritten. Raises :class:`ComplexOpError` for an op it cannot rewrite."""
    graph = program.graph
    vals = [n.meta.get("val") for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    fake_mode = detect_fake_mode(vals)
    real: dict[torch.fx.Node, torch.fx.Node] = {}  # complex node -> its real-pair node

    def call(target, *args) -> torch.fx.Node:
        """A new node computing ``target(*args)``, with its fake value in meta (the exporter reads it)."""
        node = graph.call_function(target, args)
        fake_args = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
        with fake_mode:
            node.meta["val"] = target(*fake_args)
        return node

    def pair(value, node) -> torch.fx.Node:
        if value not in real:
            raise ComplexOpError(
                f"{node.target} makes a complex value from a real one other than by polar or view_as_complex"
            )
        return real[value]

    def part(pair: torch.fx.Node, index: int) -> torch.fx.Node:
        return call(aten.select.int, pair, -1, index)  # [..., n, 2] -> [..., n]

    def stacked(re: torch.fx.Node, im: torch.fx.Node) -> torch.fx.Node:
        """``[..., n]`` real and imaginary parts -> the pair ``[..., n, 2]`` (aten.stack takes a list)."""
        node = graph.call_function(aten.stack.default, ([re, im], -1))
        with fake_mode:
            node.meta["val"] = aten.stack.default([re.meta["val"], im.meta["val"]], -1)
        return node

    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        inputs = [a for a in node.args if isinstance(a, torch.fx.Node)]
        if not (_is_complex(node) or any(_is_complex(a) for a in inputs)):
            continue
        target, args = node.target, node.args
        with graph.inserting_before(node):
            if target == aten._assert_tensor_metadata.default:
                graph.erase_node(node)
                count += 1
                continue
            if target == aten.polar.default:  # abs * (cos + i sin)
                magnitude, angle = args
                out = stacked(
                    call(aten.mul.Tensor, magnitude, call(aten.cos.default, angle)),
                    call(aten.mul.Tensor, magnitude, call(aten.sin.default, angle)),
                )
            elif target == aten.view_as_complex.default:
                out = args[0]  # already [..., n, 2]
            elif target == aten.view_as_real.default:
                node.replace_all_uses_with(pair(args[0], node))
                graph.erase_node(node)
                count += 1
                continue
            elif target == aten.unsqueeze.default:
                dim = args[1]
                out = call(aten.unsqueeze.default, pair(args[0], node), dim if dim >= 0 else dim - 1)
            elif target in (aten.clone.default, aten.alias.default, aten._to_copy.default):
                if node.kwargs.get("dtype") not in (None, torch.complex64) or not _is_complex(node):
                    raise ComplexOpError(f"{target} changes the dtype of a complex value (node {node.name})")
                out = pair(args[0], node)
            elif target == aten.mul.Tensor:
                a, b = args
                if _is_complex(a) and _is_complex(b):  # (a0 + i a1)(b0 + i b1)
                    a, b = pair(a, node), pair(b, node)
                    a0, a1, b0, b1 = part(a, 0), part(a, 1), part(b, 0), part(b, 1)
                    out = stacked(
                        call(aten.sub.Tensor, call(aten.mul.Tensor, a0, b0), call(aten.mul.Tensor, a1, b1)),
                        call(aten.add.Tensor, call(aten.mul.Tensor, a0, b1), call(aten.mul.Tensor, a1, b0)),
                    )
                else:  # complex by a real tensor or scalar: scale both parts
                    z, r = (a, b) if _is_complex(a) else (b, a)
                    if isinstance(r, torch.fx.Node):
                        r = call(aten.unsqueeze.default, r, -1)
                    out = call(aten.mul.Tensor, pair(z, node), r)
            else:
                raise ComplexOpError(
                    f"{target} on a complex value (node {node.name}); kvforge rewrites only polar, "
                    "view_as_complex, view_as_real, unsqueeze and mul of complex values"
                )
        if _is_complex(node):
            real[node] = out
        count += 1
    for node in reversed(list(graph.nodes)):  # the complex nodes, now unused
        if node in real and not node.users:
            graph.erase_node(node)
    graph.lint()
    program.graph_module.recompile()
    return count
