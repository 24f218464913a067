"""``kvforge inspect``: what is in an artifact, and can TensorRT build it?

Input: an artifact directory (or a single ``.onnx`` file). Output: a report dict (JSON schema in
docs/tools.md), printed as text: the manifest summary, each graph's inputs and outputs with dtypes
and shapes, its op histogram, the files and their sizes (and whether each still matches its sha256
in the manifest), and a TensorRT compatibility check.

The check looks up every op of every graph (local functions and control-flow subgraphs expanded)
in ``tools/data/tensorrt_onnx_ops.json``, the operator table of the ONNX-TensorRT parser of the
targeted TensorRT version (its source is named in the file). An op of another domain than the
default ONNX one (``com.microsoft.GroupQueryAttention``, ...) is unsupported. For ``Attention`` and
``TensorScatter``, the ops of kvforge's ``onnx`` lowering, the parser's restrictions are also
checked on each node, and so is a constant ``axes`` input where the parser needs one; the other
restrictions of the ops present are listed for the user to check. Graphs are read without their
external weights, so inspecting a large artifact is fast (hashing aside).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import onnx
from onnx import helper

from kvforge.graphs import manifest as mf
from kvforge.tools.report import data_file

SCHEMA = "kvforge.inspect"
SCHEMA_VERSION = 1
TENSORRT_TABLE = "tensorrt_onnx_ops.json"
DEFAULT_DOMAINS = ("", "ai.onnx")
# Ops whose second input is ``axes``, which TensorRT needs at build time (an initializer or a Constant).
AXES_INPUT = {"Squeeze", "Unsqueeze", "CumSum"} | {
    f"Reduce{r}" for r in ("L1", "L2", "LogSum", "LogSumExp", "Max", "Mean", "Min", "Prod", "Sum", "SumSquare")
}


def op_name(domain: str, op_type: str) -> str:
    """``MatMul`` for the default ONNX domain, ``com.microsoft.GroupQueryAttention`` otherwise."""
    return op_type if domain in DEFAULT_DOMAINS else f"{domain}.{op_type}"


def tensorrt_table() -> dict[str, Any]:
    return json.loads(data_file(TENSORRT_TABLE).read_text())


# ---------------------------------------------------------------- graphs


def _nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Every node that runs: the graph's, with calls of the model's local functions replaced by the
    function bodies and the subgraphs of control-flow ops (If, Loop, Scan) included."""
    functions = {(f.domain, f.name): f for f in model.functions}
    out: list[onnx.NodeProto] = []

    def walk(nodes, depth: int) -> None:
        if depth > 32:
            raise ValueError("graph nesting deeper than 32 levels (recursive local functions?)")
        for node in nodes:
            body = functions.get((node.domain, node.op_type))
            if body is not None:
                walk(body.node, depth + 1)
                continue
            out.append(node)
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    walk(attr.g.node, depth + 1)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    for g in attr.graphs:
                        walk(g.node, depth + 1)

    walk(model.graph.node, 0)
    return out


def _tensor(value: onnx.ValueInfoProto) -> dict[str, Any]:
    t = value.type.tensor_type
    if t.elem_type == onnx.TensorProto.BFLOAT16:
        dtype = "bfloat16"
    elif t.elem_type:
        dtype = helper.tensor_dtype_to_np_dtype(t.elem_type).name
    else:
        dtype = None
    shape = [d.dim_param or d.dim_value for d in t.shape.dim] if t.HasField("shape") else None
    return {"name": value.name, "dtype": dtype, "shape": shape}


def graph_info(path: Path) -> tuple[dict[str, Any], onnx.ModelProto]:
    """The ``graphs.<name>`` object of the report, and the model (without external data)."""
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # a boundary: whatever onnx cannot parse is a corrupted file to the user
        raise ValueError(f"{path} is not a readable ONNX model ({e}); recompile the model") from e
    nodes = _nodes(model)
    ops = Counter(op_name(n.domain, n.op_type) for n in nodes)
    external = [i for i in model.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL]
    external_bytes = sum(int(next((e.value for e in i.external_data if e.key == "length"), 0)) for i in external)
    info = {
        "file": path.name,
        "bytes": path.stat().st_size,
        "opset": {domain or "ai.onnx": o.version for o in model.opset_import for domain in [o.domain]},
        "inputs": [_tensor(v) for v in model.graph.input],
        "outputs": [_tensor(v) for v in model.graph.output],
        "nodes": len(nodes),
        "initializers": len(model.graph.initializer),
        "external_initializers": len(external),
        "external_bytes": external_bytes,
        "local_functions": [f"{f.domain}.{f.name}" for f in model.functions],
        "ops": dict(sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))),
    }
    return info, model


# ---------------------------------------------------------------- TensorRT


def _attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _node_violations(node: onnx.NodeProto) -> list[str]:
    """Problems of one node against the TensorRT parser's restrictions (Attention, TensorScatter)."""
    problems = []
    if node.op_type == "Attention" and node.domain in DEFAULT_DOMAINS:
        extra_inputs = [name for name in node.input[4:] if name]
        if extra_inputs:
            problems.append(f"uses past_key/past_value/nonpad_kv_seqlen inputs {extra_inputs}")
        extra_outputs = [name for name in node.output[1:] if name]
        if extra_outputs:
            problems.append(f"uses present_key/present_value/qk_matmul_output outputs {extra_outputs}")
        if _attr(node, "softcap", 0.0):
            problems.append(f"softcap={_attr(node, 'softcap')}")
        if _attr(node, "qk_matmul_output_mode", 0):  # exporters write the default 0 explicitly
            problems.append(f"qk_matmul_output_mode={_attr(node, 'qk_matmul_output_mode')}")
    elif node.op_type == "TensorScatter" and node.domain in DEFAULT_DOMAINS:
        axis = _attr(node, "axis", -2)
        if axis != -2:
            problems.append(f"axis={axis} (TensorRT needs -2)")
    return problems


def tensorrt_check(model: onnx.ModelProto, table: dict[str, Any]) -> dict[str, Any]:
    """The ``tensorrt.graphs.<name>`` object: unsupported ops, restriction violations, notes."""
    supported, unsupported = set(table["supported"]), set(table["unsupported"])
    opset = next((o.version for o in model.opset_import if o.domain in DEFAULT_DOMAINS), None)
    nodes = _nodes(model)
    counts = Counter((n.domain, n.op_type) for n in nodes)
    problems = []
    for (domain, op_type), count in sorted(counts.items(), key=lambda kv: op_name(*kv[0])):
        if domain not in DEFAULT_DOMAINS:
            reason = f"op of domain {domain!r}, not ONNX: TensorRT parses it only through a plugin of that name"
            if op_type == "GroupQueryAttention":
                reason += " (the gqa lowering's attention: compile with --lowering onnx for TensorRT)"
        elif op_type in unsupported:
            reason = f"listed as unsupported by the TensorRT {table['tensorrt_version']} ONNX parser"
        elif op_type not in supported:
            reason = f"not in the TensorRT {table['tensorrt_version']} ONNX parser's operator table"
        else:
            continue
        problems.append({"op": op_name(domain, op_type), "count": count, "reason": reason})
    violations = [
        {"op": n.op_type, "node": n.name, "problem": problem} for n in nodes for problem in _node_violations(n)
    ]
    # Restrictions checked here are not listed for the user; an axes input is checked to be constant.
    constants = {i.name for i in model.graph.initializer}
    constants |= {out for n in nodes if n.op_type == "Constant" for out in n.output}
    dynamic_axes = Counter(
        n.op_type for n in nodes if n.op_type in AXES_INPUT and len(n.input) > 1 and n.input[1] not in constants
    )
    present = {t for d, t in counts if d in DEFAULT_DOMAINS} & set(table["restrictions"])
    notes = [
        {"op": op, "restriction": table["restrictions"][op]}
        for op in sorted(present - {"Attention", "TensorScatter"} - (AXES_INPUT - set(dynamic_axes)))
    ]
    opset_ok = opset is not None and table["opset_min"] <= opset <= table["opset_max"]
    return {
        "opset": opset,
        "opset_ok": opset_ok,
        "unsupported": problems,
        "violations": violations,
        "restrictions_to_check": notes,
        "compatible": opset_ok and not problems and not violations,
    }


# ---------------------------------------------------------------- report


def _manifest_summary(manifest: mf.Manifest) -> dict[str, Any]:
    m = manifest.model
    return {
        "schema_version": manifest.schema_version,
        "kvforge_version": manifest.kvforge_version,
        "created_utc": manifest.created_utc,
        "source_path": manifest.source.get("path"),
        "model": {
            "architecture": m.architecture,
            "model_type": m.model_type,
            "num_layers": m.num_layers,
            "num_heads": m.num_heads,
            "num_kv_heads": m.num_kv_heads,
            "head_dim": m.head_dim,
            "hidden_size": m.hidden_size,
            "vocab_size": m.vocab_size,
        },
        "dtype": manifest.dtype,
        "lowering": manifest.lowering,
        "limits": {
            "max_batch": manifest.limits.max_batch,
            "max_seq": manifest.limits.max_seq,
            "max_prompt": manifest.limits.max_prompt,
        },
        "kv_cache": dict(manifest.kv_cache),
        "state": list(getattr(manifest, "state", [])),  # schema 3: layers that keep a state, not KV
        "eos_token_ids": list(manifest.generation.get("eos_token_ids", [])),
        "versions": dict(manifest.versions),
        "parity": dict(manifest.parity),
        "quantization": getattr(manifest, "quantization", None),
        "ort_optimization": getattr(manifest, "ort_optimization", None),
        "engines": dict(manifest.engines),
        "target": getattr(manifest, "target", "cpu"),
    }


def inspect(path: str | Path) -> dict[str, Any]:
    """Inspect an artifact directory (or one ``.onnx`` file); the report dict (docs/tools.md).

    Does not refuse a modified artifact: each file's sha256 is reported (``sha256_ok``) instead.
    """
    root = Path(path)
    table = tensorrt_table()
    # name -> (file, graph it implements, variant): "onnx" graphs are what TensorRT builds from,
    # "ort" graphs the ONNX Runtime-optimized copies (same I/O) the CPU runtime loads by default.
    graph_files: dict[str, tuple[Path, str, str]] = {}
    digests: dict[str, str] = {}
    if root.is_file() and root.suffix == ".onnx":
        manifest, files = None, [root]
        stem = root.name[: -len(".onnx")]
        variant = "ort" if stem.endswith(".ort") else "onnx"
        graph_files[stem] = (root, stem.removesuffix(".ort"), variant)
    elif root.is_dir():
        manifest = mf.read(root, verify=False)  # missing, foreign or truncated artifacts are refused here
        for name, g in manifest.graphs.items():
            graph_files[name] = (root / g.file, name, "onnx")
            digests[g.file] = g.sha256
            ort_file = getattr(g, "ort_file", None)
            if ort_file:
                graph_files[f"{name}.ort"] = (root / ort_file, name, "ort")
                digests[ort_file] = g.ort_sha256
        digests[manifest.weights.file] = manifest.weights.sha256
        files = sorted(f for f in root.iterdir() if f.is_file())
    else:
        raise ValueError(f"{str(root)!r} is neither an artifact directory nor an .onnx file")

    graphs, checks = {}, {}
    for name, (file, graph, variant) in graph_files.items():
        info, model = graph_info(file)
        info["graph"], info["variant"] = graph, variant
        info["sha256_ok"] = mf.sha256_file(file) == digests[file.name] if file.name in digests else None
        graphs[name] = info
        if variant == "onnx":
            checks[name] = tensorrt_check(model, table)
    file_rows = [
        {
            "file": f.name,
            "bytes": f.stat().st_size,
            "sha256_ok": mf.sha256_file(f) == digests[f.name] if f.name in digests else None,
        }
        for f in files
    ]
    unsupported = sorted({p["op"] for c in checks.values() for p in c["unsupported"]})
    return {
        "kind": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "path": str(root),
        "manifest": _manifest_summary(manifest) if manifest else None,
        "graphs": graphs,
        "files": file_rows,
        "total_bytes": sum(f["bytes"] for f in file_rows),
        "tensorrt": {
            "tensorrt_version": table["tensorrt_version"],
            "source": table["source"],
            "opset_range": [table["opset_min"], table["opset_max"]],
            "compatible": all(c["compatible"] for c in checks.values()),
            "unsupported_ops": unsupported,
            "graphs": checks,
        },
    }


# ---------------------------------------------------------------- terminal


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _shape(shape: list | None) -> str:
    return "?" if shape is None else "[" + ", ".join(str(d) for d in shape) + "]"


def _tensor_lines(tensors: list[dict[str, Any]]) -> list[str]:
    """One line per tensor, the per-layer cache tensors folded into one line each (``.*.``)."""
    groups: dict[tuple, list[str]] = {}
    for t in tensors:
        key = (re.sub(r"\.\d+\.", ".*.", t["name"]), t["dtype"], _shape(t["shape"]))
        groups.setdefault(key, []).append(t["name"])
    lines = []
    for (name, dtype, shape), names in groups.items():
        count = f"  x{len(names)}" if len(names) > 1 else ""
        lines.append(f"    {(names[0] if len(names) == 1 else name):30} {dtype or '?':9} {shape}{count}")
    return lines


_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def _state_lines(state: list[dict], max_batch: int) -> list[str]:
    """A hybrid model's state entries: which layers, what kind, the bytes of max_batch rows; then one
    line per kind of entry with its tensors' per-row shapes and dtypes and its layers."""
    if not state:
        return []
    total = 0
    for entry in state:
        for t in entry["tensors"]:
            n = max_batch * _ITEMSIZE.get(t["dtype"], 4)
            for d in t["shape"]:
                n *= d
            total += n
    kinds = ", ".join(sorted({e["kind"] for e in state}))
    layers = [e["layer"] for e in state]
    lines = [f"  state ({kinds}) of layers {layers}, KV only for layers that attend; state = {_size(total)}"]
    groups: dict[tuple[str, str], list[int]] = {}
    for entry in state:
        tensors = ", ".join(f"{t['part']} {_shape(t['shape'])} {t['dtype']}" for t in entry["tensors"])
        groups.setdefault((entry["kind"], tensors), []).append(entry["layer"])
    for (kind, tensors), where in groups.items():
        lines.append(f"    {kind}: {tensors} per row, layers {where}")
    return lines


def _quantization_lines(q: dict[str, Any] | None) -> list[str]:
    """One line saying how the weights are quantized (none for a float artifact)."""
    if not q:
        return []
    if q.get("scheme") == "gguf":
        kept = f"a GGUF file's own blocks ({q['gguf'].get('file')}), {q.get('op')}"
        return [f"  weights: {kept}; embedding {q.get('embedding')}"]
    blocks = f"blocks of {q.get('block_size')}, {'symmetric' if q.get('symmetric', True) else 'asymmetric'}"
    head = q.get("lm_head")
    if q.get("lm_head_block_size"):
        head = f"{head} in blocks of {q['lm_head_block_size']}"
    level = f", accuracy level {q['accuracy_level']}" if "accuracy_level" in q else ""
    line = f"  weights: {q.get('scheme')} {q.get('op')} ({blocks}{level}); lm_head {head}"
    line += f"; embedding {q['embedding']}" if q.get("embedding") else ""
    return [line + (f"; GGUF blocks kept from {q['gguf'].get('file')}" if q.get("gguf") else "")]


def format_report(result: dict[str, Any]) -> str:
    lines = [f"kvforge inspect: {result['path']}"]
    m = result["manifest"]
    if m:
        d, lim, kv = m["model"], m["limits"], m["kv_cache"]
        lines += [
            f"  model: {d['architecture']} ({d['model_type']}), {d['num_layers']} layers, hidden {d['hidden_size']}, "
            f"{d['num_heads']} heads / {d['num_kv_heads']} KV heads, head_dim {d['head_dim']}, vocab {d['vocab_size']}",
            f"  dtype {m['dtype']}, lowering {m['lowering']}, max_batch {lim['max_batch']}, max_seq {lim['max_seq']}; "
            f"KV cache {kv.get('shape')} {kv.get('dtype')}"
            + (f" + scales {kv.get('scale_shape')} {kv.get('scale_dtype')}" if kv.get("dtype") == "int8" else "")
            + f" = {_size(kv.get('bytes', 0))}",
            *_state_lines(m.get("state") or [], lim["max_batch"]),
            *_quantization_lines(m.get("quantization")),
            f"  compiled by kvforge {m['kvforge_version']} at {m['created_utc']} from {m['source_path']}",
            "  versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()),
        ]
        p = m["parity"]
        if "skipped" in p:
            lines.append(f"  parity at compile: skipped ({p['skipped']})")
        elif p:
            lines.append(
                f"  parity at compile: prefill max|diff| {p.get('prefill_max_abs_diff', float('nan')):.2e}, "
                f"decode {p.get('decode_max_abs_diff', float('nan')):.2e}, greedy match {p.get('greedy_match')}"
            )
    for name, g in result["graphs"].items():
        integrity = {True: "sha256 ok", False: "sha256 MISMATCH", None: "no recorded sha256"}[g["sha256_ok"]]
        opset = g["opset"].get("ai.onnx", "?")  # other domains: see the op names (JSON: every import)
        lines += [
            "",
            f"graph {name} ({g['file']}, {_size(g['bytes'])}, {integrity}): {g['nodes']} nodes, opset {opset}, "
            f"{g['initializers']} initializers ({g['external_initializers']} external, {_size(g['external_bytes'])})",
        ]
        base = result["graphs"].get(g["graph"])
        if g["variant"] == "ort" and base and (base["inputs"], base["outputs"]) == (g["inputs"], g["outputs"]):
            lines.append(f"  ONNX Runtime-optimized {g['graph']} graph; inputs and outputs as {g['graph']}")
        else:
            lines += ["  inputs:", *_tensor_lines(g["inputs"]), "  outputs:", *_tensor_lines(g["outputs"])]
        lines.append("  ops: " + ", ".join(f"{op} {n}" for op, n in g["ops"].items()))
    lines += ["", "files:"]
    for f in result["files"]:
        flag = {True: "", False: "  (sha256 MISMATCH)", None: ""}[f["sha256_ok"]]
        lines.append(f"  {f['file']:28} {_size(f['bytes']):>10}{flag}")
    lines.append(f"  {'total':28} {_size(result['total_bytes']):>10}")
    trt = result["tensorrt"]
    lines += [
        "",
        f"TensorRT {trt['tensorrt_version']} ONNX parser (opset {trt['opset_range'][0]}-{trt['opset_range'][1]}):",
    ]
    if trt["compatible"]:
        lines.append("  compatible: every op of every graph is supported")
    else:
        lines.append("  NOT compatible:")
    for name, c in trt["graphs"].items():
        if not c["opset_ok"]:
            lines.append(f"    {name}: opset {c['opset']} is outside the parser's range")
        for p in c["unsupported"]:
            lines.append(f"    {name}: {p['op']} x{p['count']}: {p['reason']}")
        for v in c["violations"]:
            lines.append(f"    {name}: {v['op']} node {v['node']!r}: {v['problem']}")
    notes = {n["op"]: n["restriction"] for c in trt["graphs"].values() for n in c["restrictions_to_check"]}
    for op, restriction in notes.items():
        lines.append(f"  check by hand: {op}: {restriction}")
    lines.append(f"  (table: {trt['source']})")
    return "\n".join(lines)
