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

SCHEMA_VERSION = 1
MANIFEST_FILE = "manifest.json"


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
    engines: dict[str, Any] = field(default_factory=dict)  # TensorRT plans, when built

    def to_json(self) -> str:
        return json.dumps({"format": "kvforge", **asdict(self)}, indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ArtifactError(
                f"manifest schema_version is {version!r}; this kvforge reads schema {SCHEMA_VERSION} "
                "(recompile the model with this kvforge version: kvforge compile MODEL_DIR -o OUT)"
            )
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
        except (KeyError, TypeError) as e:
            raise ArtifactError(f"manifest is malformed ({e}); recompile the model") from e


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
    for name, digest, size in files:
        file = root / name
        if not file.is_file():
            raise ArtifactError(f"artifact file {name} is missing from {str(root)!r}; recompile the model")
        if size is not None and file.stat().st_size != size:
            raise ArtifactError(
                f"artifact file {name} has {file.stat().st_size} bytes, the manifest says {size}: "
                "the file is truncated or corrupted; recompile the model"
            )
        if verify and sha256_file(file) != digest:
            raise ArtifactError(
                f"artifact file {name} does not match its sha256 in the manifest: it is corrupted "
                "or was modified; recompile the model"
            )
    return manifest
