"""compile/complex_to_real.py: a program that computes rotary embeddings in complex numbers, as
DeepSeek-V2 and Llama 4 do (``view_as_complex(x) * polar(1, angle)``, scaled, unsqueezed,
``view_as_real``), is rewritten to real pairs: no complex value is left, the rewritten program
gives the original's values (within 1e-6) at another sequence length too, ``torch.onnx.export``
exports it, and ONNX Runtime gives the same values. An op the pass does not rewrite is
refused by name."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from kvforge.compile import complex_to_real


class _ComplexRotary(torch.nn.Module):
    """x ``[B, H, S, D]``, positions ``[B, S]`` -> x rotated pairwise by ``position * inv_freq``."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        freqs = positions[..., None].float() * self.inv_freq  # (B, S, D/2)
        cis = torch.polar(torch.ones_like(freqs), freqs) * 0.5  # (B, S, D/2) complex
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # (B, H, S, D/2)
        return torch.view_as_real(pairs * cis.unsqueeze(1)).flatten(3).type_as(x)  # (B, H, S, D)


def _program(module: torch.nn.Module, args: tuple) -> torch.export.ExportedProgram:
    seq = torch.export.Dim("seq", min=1, max=64)
    return torch.export.export(module, args, dynamic_shapes=({2: seq}, {1: seq}), strict=False).run_decompositions()


def test_complex_rotary_is_rewritten_to_real_pairs_and_exports(tmp_path):
    module = _ComplexRotary()
    args = (torch.randn(1, 2, 5, 8), torch.arange(5)[None])
    program = _program(module, args)
    assert complex_to_real.has_complex(program)
    assert complex_to_real.rewrite(program) > 0
    assert not complex_to_real.has_complex(program)
    longer = (torch.randn(1, 2, 9, 8), torch.arange(3, 12)[None])  # another length: shapes stay dynamic
    for inputs in (args, longer):
        torch.testing.assert_close(program.module()(*inputs), module(*inputs), atol=1e-6, rtol=0)
    onnx_program = torch.onnx.export(program, args, dynamo=True, verbose=False)
    onnx_program.save(str(tmp_path / "rotary.onnx"))
    session = ort.InferenceSession(str(tmp_path / "rotary.onnx"), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    got = session.run(None, dict(zip(names, (t.numpy() for t in longer))))[0]
    np.testing.assert_allclose(got, module(*longer).numpy(), atol=1e-6, rtol=0)


class _ComplexExp(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.view_as_real(torch.exp(torch.view_as_complex(x)))


def test_an_op_the_pass_does_not_rewrite_is_named():
    program = torch.export.export(_ComplexExp(), (torch.randn(3, 2),), strict=False).run_decompositions()
    with pytest.raises(complex_to_real.ComplexOpError, match=r"aten\.exp\.default on a complex value"):
        complex_to_real.rewrite(program)
