"""``manifest.json``: the only contract between ``kvforge.compile`` and ``kvforge.runtime``.

Written last by compile (its presence marks a finished artifact), read and checked first by the
runtime. Every field is documented in ``docs/manifest.md``; a change of meaning bumps
``SCHEMA_VERSION``. Plain JSON + dataclasses: no transformers, no ONNX, so loading an engine stays
light.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvforge.graphs import contract

SCHEMA_VERSION = 3
# Schemas this kvforge reads. 2 added graphs.verify (the general graph, logits at logit_indices) and
# changed nothing else: a schema-1 artifact still runs, without speculative decoding. 3 added
# ``state`` (the per-layer state entries of a hybrid family, kvforge.graphs.contract) and
# ``kv_cache.layers`` (the layers that keep KV); a schema-1 or -2 artifact has neither and means
# what it always meant: every layer attends.
# 4: the 8-bit KV cache (kv_cache.dtype "int8", kv_cache.scale_shape / scale_dtype: a float32 scale
# per cached row and head, graph inputs past_key_values.{l}.key_scale|value_scale); written only for
# an artifact compiled with --kv-dtype int8 (a float-KV artifact stays schema 3), so a kvforge that
# cannot bind the scales refuses it by its schema.
KV_INT8_SCHEMA = 4
READABLE_SCHEMAS = (1, 2, 3, 4)
MANIFEST_FILE = "manifest.json"
# How a model writes tool calls and reasoning (the server's parsers, kvforge.tools.serve.parsers):
# chosen at compile time from the chat template and the special tokens (kvforge.compile.chat_format).
TOOL_PARSERS = ("hermes", "llama3_json", "mistral", "qwen3_coder", "harmony")
REASONING_PARSERS = ("think", "harmony")


class ArtifactError(ValueError):
    """The artifact directory cannot be run: missing, foreign, corrupted or of another schema."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy-style name: "float32", "int64", ...
    shape: list[int | str]  # ints, or symbolic dims: "batch", "seq", "capacity"


@dataclass(frozen=True)
class GraphFile:
    file: str  # relative to the artifact directory
    sha256: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    ort_file: str | None = None  # ONNX Runtime-optimized variant (same I/O), if compiled
    ort_sha256: str | None = None


@dataclass(frozen=True)
class FileRef:
    file: str
    sha256: str
    bytes: int


@dataclass(frozen=True)
class ModelDims:
    architecture: str  # config.architectures[0]
    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int


@dataclass(frozen=True)
class Limits:
    max_batch: int  # rows of the KV cache
    max_seq: int  # cache capacity per row: prompt + generated tokens
    max_prompt: int  # longest prompt accepted (= max_seq: a full-length prompt still yields one token)


@dataclass(frozen=True)
class Manifest:
    schema_version: int
    kvforge_version: str
    created_utc: str
    source: dict[str, Any]  # path, config_sha256, weights: {file: sha256}
    model: ModelDims
    dtype: str  # "float32" | "float16" | "bfloat16": weights, activations and KV cache
    limits: Limits
    lowering: str  # "onnx"
    kv_cache: dict[str, Any]  # layout, shape, dtype, bytes
    graphs: dict[str, GraphFile]  # "prefill", "decode"
    weights: FileRef
    tokenizer: dict[str, Any]  # files, bos_token_id, eos_token_ids, pad_token_id
    generation: dict[str, Any]  # eos_token_ids, from generation_config.json
    versions: dict[str, str]  # torch, transformers, onnx, onnxruntime, opset used at compile
    parity: dict[str, Any]  # measured at compile time against transformers
    quantization: dict[str, Any] | None = None  # scheme, block_size, op, ... when weights are quantized
    ort_optimization: dict[str, Any] | None = None  # how the <graph>.ort.onnx files were optimized
    engines: dict[str, Any] = field(default_factory=dict)  # {"tensorrt": EngineRecord as a dict}, when built
    target: str = "cpu"  # "cpu" | "cuda" | "tensorrt": what the artifact was compiled for (kvforge compile --target)
    # Optional (older manifests lack them: hermes, no reasoning): one of TOOL_PARSERS, REASONING_PARSERS.
    tool_parser: str = "hermes"
    reasoning_parser: str | None = None
    # schema 3: the state entries of the layers that keep a state, not KV (StateEntry.to_dict each); [] none
    state: list[dict[str, Any]] = field(default_factory=list)

    @property
    def layout(self) -> contract.Layout:
        """Which layers keep KV (``kv_cache.layers``; every layer before schema 3) and which a state."""
        layers = self.kv_cache.get("layers")
        attention = tuple(layers) if layers is not None else tuple(range(self.model.num_layers))
        states = tuple(contract.StateEntry.from_dict(e) for e in self.state)
        return contract.Layout(attention, states, kv_dtype=self.kv_dtype)

    @property
    def kv_dtype(self) -> str:
        """ "int8" for an 8-bit KV cache (``--kv-dtype int8``), else "float" (the cache in ``dtype``)."""
        return "int8" if self.kv_cache.get("dtype") == "int8" else "float"

    def to_json(self) -> str:
        return json.dumps({"format": "kvforge", **asdict(self)}, indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        version = data.get("schema_version")
        if version not in READABLE_SCHEMAS:
            raise ArtifactError(
                f"manifest schema_version is {version!r}; this kvforge reads schemas "
                f"{', '.join(map(str, READABLE_SCHEMAS))} "
                "(recompile the model with this kvforge version: kvforge compile MODEL_DIR -o OUT)"
            )
        check_schema(data)
        try:
            return cls(
                **{
                    **data,
                    "model": ModelDims(**data["model"]),
                    "limits": Limits(**data["limits"]),
                    "graphs": {k: _graph(v) for k, v in data["graphs"].items()},
                    "weights": FileRef(**data["weights"]),
                }
            )
        except (KeyError, TypeError, AttributeError) as e:
            raise ArtifactError(f"manifest is malformed ({e}); recompile the model") from e


# ---------------------------------------------------------------- field types (read side)

DTYPES = ("float32", "float16", "bfloat16")
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
_DIMS = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size", "vocab_size")


def _malformed(where: str, value: Any, expected: str) -> ArtifactError:
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return ArtifactError(f"manifest is malformed: {where} is {text}, expected {expected}; recompile the model")


def _positive(where: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _malformed(where, value, "a positive integer")
    return value


def _text(where: str, value: Any, optional: bool = False) -> None:
    if not (isinstance(value, str) or (optional and value is None)):
        raise _malformed(where, value, "a string" + (" or null" if optional else ""))


def _mapping(where: str, value: Any, optional: bool = False) -> dict:
    if not (isinstance(value, dict) or (optional and value is None)):
        raise _malformed(where, value, "an object" + (" or null" if optional else ""))
    return value or {}


def _relative_file(where: str, value: Any) -> None:
    _text(where, value)
    path = Path(value)
    if not value or path.is_absolute() or ".." in path.parts:
        raise _malformed(where, value, "a file name inside the artifact directory")


def check_schema(data: dict[str, Any]) -> None:
    """Every field the runtime reads, by type and range, and the KV cache record consistent with
    the model's dims and limits; a hand-edited or corrupted manifest is an :class:`ArtifactError`
    naming the field, never a TypeError deep in the runtime. Files must lie inside the artifact."""
    for key in ("model", "limits", "graphs", "weights", "kv_cache", "tokenizer", "generation"):
        if key not in data:
            raise ArtifactError(f"manifest is malformed (no {key!r}); recompile the model")
        _mapping(key, data[key])
    for key in ("source", "versions", "parity", "engines"):
        _mapping(key, data.get(key, {}))
    for key in ("quantization", "ort_optimization"):
        _mapping(key, data.get(key), optional=True)
    for key in ("kvforge_version", "created_utc", "lowering", "target"):
        _text(key, data.get(key, ""))
    if data.get("tool_parser", "hermes") not in TOOL_PARSERS:
        raise _malformed("tool_parser", data["tool_parser"], f"one of {', '.join(TOOL_PARSERS)}")
    if data.get("reasoning_parser") not in (None, *REASONING_PARSERS):
        raise _malformed("reasoning_parser", data["reasoning_parser"], f"null or one of {', '.join(REASONING_PARSERS)}")
    model, limits = data["model"], data["limits"]
    for name in _DIMS:
        _positive(f"model.{name}", model.get(name))
    for name in ("architecture", "model_type"):
        _text(f"model.{name}", model.get(name))
    for name in ("max_batch", "max_seq", "max_prompt"):
        _positive(f"limits.{name}", limits.get(name))
    if limits["max_prompt"] > limits["max_seq"]:
        raise _malformed("limits.max_prompt", limits["max_prompt"], f"at most limits.max_seq={limits['max_seq']}")
    dtype = data.get("dtype")
    if dtype not in DTYPES:
        raise _malformed("dtype", dtype, f"one of {', '.join(DTYPES)}")
    cache = data["kv_cache"]
    attention = _check_state(data, cache)
    shape = [len(attention), 2, limits["max_batch"], model["num_kv_heads"], limits["max_seq"], model["head_dim"]]
    int8 = cache.get("dtype") == "int8" and data.get("schema_version", 0) >= KV_INT8_SCHEMA
    if int8 and (cache.get("scale_shape") != shape[:-1] or cache.get("scale_dtype") != contract.KV_SCALE_DTYPE):
        raise ArtifactError(
            f"manifest is inconsistent: kv_cache.scale_shape is {cache.get('scale_shape')!r} "
            f"{cache.get('scale_dtype')!r}, but the 8-bit KV cache {shape} needs {shape[:-1]} "
            f"{contract.KV_SCALE_DTYPE}; the manifest was edited or corrupted: recompile the model"
        )
    if cache.get("shape") != shape or (cache.get("dtype") != dtype and not int8):
        raise ArtifactError(
            f"manifest is inconsistent: kv_cache is {cache.get('shape')!r} {cache.get('dtype')!r}, but the model's "
            f"dims and limits make {shape} {dtype}; the manifest was edited or corrupted: recompile the model"
        )
    graphs = data["graphs"]
    if not graphs:
        raise _malformed("graphs", graphs, "at least the prefill graph")
    for name, graph in graphs.items():
        _mapping(f"graphs.{name}", graph)
        _relative_file(f"graphs.{name}.file", graph.get("file"))
        _text(f"graphs.{name}.sha256", graph.get("sha256"))
        if graph.get("ort_file") is not None:
            _relative_file(f"graphs.{name}.ort_file", graph["ort_file"])
            _text(f"graphs.{name}.ort_sha256", graph.get("ort_sha256"))
        for side in ("inputs", "outputs"):
            specs = graph.get(side)
            if not isinstance(specs, list) or not all(isinstance(t, dict) for t in specs):
                raise _malformed(f"graphs.{name}.{side}", specs, "a list of tensor specs")
    weights = data["weights"]
    _relative_file("weights.file", weights.get("file"))
    _text("weights.sha256", weights.get("sha256"))
    size = weights.get("bytes")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise _malformed("weights.bytes", size, "a byte count")
    for where, record in (("tokenizer", data["tokenizer"]), ("generation", data["generation"])):
        eos = record.get("eos_token_ids", [])
        if not isinstance(eos, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in eos):
            raise _malformed(f"{where}.eos_token_ids", eos, "a list of token ids")
    if not isinstance(data["tokenizer"].get("has_tokenizer", False), bool):
        raise _malformed("tokenizer.has_tokenizer", data["tokenizer"]["has_tokenizer"], "true or false")
    for name, record in data.get("engines", {}).items():
        _mapping(f"engines.{name}", record)


def _check_state(data: dict[str, Any], cache: dict[str, Any]) -> list[int]:
    """The layers that keep KV (``kv_cache.layers``, every layer when absent) and the state
    entries (``state``): each layer exactly once, kinds known, shapes positive, dtypes known.
    Returns the attention layers."""
    num_layers = data["model"]["num_layers"]
    layers = cache.get("layers", list(range(num_layers)))
    if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise _malformed("kv_cache.layers", layers, "a list of layer indices")
    entries = data.get("state", [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise _malformed("state", entries, "a list of state entries")
    seen = list(layers)
    for i, entry in enumerate(entries):
        if entry.get("kind") not in contract.STATE_KINDS[1:]:
            raise _malformed(f"state[{i}].kind", entry.get("kind"), f"one of {', '.join(contract.STATE_KINDS[1:])}")
        tensors = entry.get("tensors")
        if not isinstance(tensors, list) or not tensors or not all(isinstance(t, dict) for t in tensors):
            raise _malformed(f"state[{i}].tensors", tensors, "a list of state tensors")
        for j, t in enumerate(tensors):
            shape = t.get("shape")
            if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 1 for d in shape):
                raise _malformed(f"state[{i}].tensors[{j}].shape", shape, "a list of positive integers")
            if t.get("dtype") not in DTYPES:
                raise _malformed(f"state[{i}].tensors[{j}].dtype", t.get("dtype"), f"one of {', '.join(DTYPES)}")
            _text(f"state[{i}].tensors[{j}].part", t.get("part"))
        seen.append(entry.get("layer"))
    # A layer attends, keeps a state, both (Falcon-H1 runs attention and a Mamba2 mixer side by side)
    # or neither (Nemotron-H's MLP-only blocks); it is listed at most once among each.
    states = seen[len(layers) :]
    ints = all(isinstance(x, int) and not isinstance(x, bool) for x in seen)
    valid = range(num_layers)
    if not ints or any(len(set(group)) != len(group) or not set(group) <= set(valid) for group in (layers, states)):
        raise ArtifactError(
            f"manifest is inconsistent: kv_cache.layers {layers} and the state entries' layers "
            f"{[e.get('layer') for e in entries]} are not layers of the model's {num_layers}, each listed at most "
            "once among each; the manifest was edited or corrupted: recompile the model"
        )
    return layers


def _graph(data: dict[str, Any]) -> GraphFile:
    return GraphFile(
        file=data["file"],
        sha256=data["sha256"],
        inputs=[TensorSpec(**t) for t in data["inputs"]],
        outputs=[TensorSpec(**t) for t in data["outputs"]],
        ort_file=data.get("ort_file"),
        ort_sha256=data.get("ort_sha256"),
    )


def kvforge_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvforge")
    except PackageNotFoundError:
        return "unknown"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write(manifest: Manifest, out_dir: Path) -> Path:
    path = out_dir / MANIFEST_FILE
    path.write_text(manifest.to_json())
    return path


def read(artifact_dir: str | Path, verify: bool = True) -> Manifest:
    """Read and check an artifact's manifest.

    Always checks that the directory is an artifact of this schema and that every file it names
    exists with its recorded size; with ``verify``, also each file's sha256.
    """
    root = Path(artifact_dir)
    path = root / MANIFEST_FILE
    if not root.is_dir():
        raise ArtifactError(f"artifact directory {str(root)!r} does not exist")
    if not path.is_file():
        raise ArtifactError(
            f"{str(root)!r} has no {MANIFEST_FILE}: it is not a kvforge artifact "
            "(or its compile did not finish); create one with: kvforge compile MODEL_DIR -o OUT"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path} is not valid JSON ({e}); recompile the model") from e
    if not isinstance(data, dict) or data.get("format") != "kvforge":
        raise ArtifactError(f"{path} is not a kvforge manifest; recompile the model with kvforge compile")
    manifest = Manifest.from_dict({k: v for k, v in data.items() if k != "format"})
    files = [(g.file, g.sha256, None) for g in manifest.graphs.values()]
    files += [(g.ort_file, g.ort_sha256, None) for g in manifest.graphs.values() if g.ort_file]
    files.append((manifest.weights.file, manifest.weights.sha256, manifest.weights.bytes))
    engine = engine_record(manifest)
    engine_file = engine.plan_file if engine else None
    if engine:
        files.append((engine.plan_file, engine.plan_sha256, engine.plan_bytes))
    for name, digest, size in files:
        file = root / name
        # A changed or missing engine is rebuilt from the graphs; anything else means recompiling.
        redo = REBUILD if name == engine_file else "recompile the model"
        if not file.is_file():
            raise ArtifactError(f"artifact file {name} is missing from {str(root)!r}; {redo}")
        if size is not None and file.stat().st_size != size:
            raise ArtifactError(
                f"artifact file {name} has {file.stat().st_size} bytes, the manifest says {size}: "
                f"the file is truncated or corrupted; {redo}"
            )
        if verify and sha256_file(file) != digest:
            raise ArtifactError(
                f"artifact file {name} does not match its sha256 in the manifest: it is corrupted "
                f"or was modified; {redo}"
            )
    return manifest


# ---------------------------------------------------------------- TensorRT engine record

REBUILD = "rebuild with `kvforge build OUT`"
ENGINE_KEY = "tensorrt"


@dataclass(frozen=True)
class EngineProfile:
    """One optimization profile of the plan: ``shapes`` maps an input name to its
    ``[min, opt, max]`` shapes (lists of ints)."""

    name: str  # "prefill" | "decode"
    index: int  # the profile index in the plan (the execution context's profile)
    shapes: dict[str, list[list[int]]]


@dataclass(frozen=True)
class EngineRecord:
    """``manifest.engines["tensorrt"]``: the TensorRT plan built by ``kvforge build`` and the GPU and
    TensorRT it was built with. Engines run only where they were built: :func:`check_engine`."""

    plan_file: str  # "engine.plan", relative to the artifact
    plan_sha256: str
    plan_bytes: int
    source_graph: str  # the graph the plan was built from: "prefill" (decode is its S = 1 profile)
    tensorrt_version: str
    gpu_name: str
    compute_capability: str  # "9.0"
    profiles: list[EngineProfile]
    timing_cache_file: str | None  # kept in the artifact, reused by the next build
    strongly_typed: bool
    workspace_bytes: int | None  # the builder's workspace limit (from --gpu-memory), None: TensorRT's default
    device_memory_bytes: int  # TensorRT's own activation figure for one context (device_memory_size_v2)
    outputs: list[str] = field(default_factory=list)  # extra outputs added at build: "next_token_ids"
    cache_aliased: bool | None = None  # every present.* aliases its past input (get_aliased_input_tensor)
    built_utc: str = ""
    build_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineRecord:
        try:
            return cls(**{**data, "profiles": [EngineProfile(**p) for p in data["profiles"]]})
        except (KeyError, TypeError) as e:
            raise ArtifactError(f"manifest engines.{ENGINE_KEY} is malformed ({e}); {REBUILD}") from e

    def profile(self, name: str) -> EngineProfile:
        for p in self.profiles:
            if p.name == name:
                return p
        raise ArtifactError(f"the TensorRT plan has no {name!r} profile; {REBUILD}")


def engine_record(manifest: Manifest) -> EngineRecord | None:
    """The artifact's TensorRT engine record, or None when no engine was built."""
    data = manifest.engines.get(ENGINE_KEY)
    if not data:
        return None
    try:
        return EngineRecord.from_dict(data)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        if isinstance(e, ArtifactError):
            raise
        raise ArtifactError(f"the manifest's TensorRT engine record is malformed ({e}); {REBUILD}") from e


def check_engine(record: EngineRecord | None, *, tensorrt_version: str, gpu_name: str, compute_capability: str) -> None:
    """Refuse an engine that cannot run here. TensorRT plans are specific to the TensorRT version
    and to the GPU (its compute capability, and the tactics timed on that model); raises
    :class:`ArtifactError` naming what differs, with "rebuild with `kvforge build OUT`"."""
    if record is None:
        raise ArtifactError(f"this artifact has no TensorRT engine; build one on this GPU: {REBUILD}")
    differences = []
    if record.tensorrt_version != tensorrt_version:
        differences.append(f"TensorRT {record.tensorrt_version}, this machine has TensorRT {tensorrt_version}")
    if record.compute_capability != compute_capability:
        differences.append(
            f"compute capability {record.compute_capability}, this GPU ({gpu_name}) has {compute_capability}"
        )
    elif record.gpu_name != gpu_name:
        differences.append(f"GPU {record.gpu_name!r}, this GPU is {gpu_name!r}")
    if differences:
        raise ArtifactError(f"the TensorRT engine was built for {'; '.join(differences)}: {REBUILD}")
