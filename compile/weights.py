"""Stage 3: two in-memory graphs -> two ``.onnx`` files that read ONE external weights file.

Input: the prefill and decode ``onnx_ir.Model`` from :mod:`kvforge.compile.export`. Output:
``prefill.onnx``, ``decode.onnx`` and ``weights.data`` in the output directory. Every tensor of
``SHARE_THRESHOLD`` bytes or more is stored once: tensors are keyed by their content (dtype, shape,
bytes), not by name, because the exporter names constant-folded tensors (transposed weights, ...)
differently in each graph. Tensors are aligned to ``ALIGNMENT`` bytes so the file can be memory
mapped.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import onnx_ir as ir

WEIGHTS_FILE = "weights.data"
SHARE_THRESHOLD = 1024  # smaller tensors (shape constants, scalars) stay inside the graph
ALIGNMENT = 4096


@dataclass
class WeightsReport:
    file: str
    bytes: int  # size of the weights file
    tensors: int  # distinct tensors stored
    references: int  # initializers of all graphs that point into the file


def write_shared(models: dict[str, ir.Model], out_dir: Path) -> WeightsReport:
    """Move the large initializers of every model into ``out_dir/weights.data`` (each distinct
    tensor once) and save each model as ``out_dir/<name>.onnx``."""
    stored: dict[tuple, tuple[int, int]] = {}  # content key -> (offset, length)
    references = 0
    with open(out_dir / WEIGHTS_FILE, "wb") as f:
        for model in models.values():
            for value in _initializers(model):
                tensor = value.const_value
                if tensor is None or tensor.nbytes < SHARE_THRESHOLD:
                    continue
                data = tensor.tobytes()
                key = (tensor.dtype, tuple(tensor.shape), hashlib.sha256(data).digest())
                if key not in stored:
                    offset = -f.tell() % ALIGNMENT + f.tell()
                    f.seek(offset)
                    f.write(data)
                    stored[key] = (offset, len(data))
                offset, length = stored[key]
                value.const_value = ir.ExternalTensor(
                    location=WEIGHTS_FILE,
                    offset=offset,
                    length=length,
                    dtype=tensor.dtype,
                    shape=tensor.shape,
                    name=value.name,
                    base_dir=out_dir,
                )
                references += 1
        size = f.tell()
    for name, model in models.items():
        ir.save(model, out_dir / f"{name}.onnx")
    return WeightsReport(WEIGHTS_FILE, size, len(stored), references)


def _initializers(model: ir.Model) -> Iterable[ir.Value]:
    # The exporter's graphs have no subgraphs or functions holding weights: the top graph is all.
    return list(model.graph.initializers.values())
