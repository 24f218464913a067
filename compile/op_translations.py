"""ONNX translations for torch ops that ``torch.onnx.export`` has none for, in standard ops.

Input: nothing; output: entries for ``torch.onnx.export(custom_translation_table=...)``, merged
with the attention lowering's (:func:`kvforge.graphs.lowering.translation_table`) by the export
stage. Each translation is checked against torch in ``tests/compile/test_op_translations.py``.

* ``erfinv`` (``prims.erf_inv``, the decomposition of ``torch.erfinv``): Gemma 3n's activation
  sparsity computes ``Normal(0, 1).icdf(p)`` in its forward, which is ``sqrt(2) * erfinv(2p - 1)``.
  ONNX has ``Erf`` but no inverse: Giles' single-precision approximation ("Approximating the erfinv
  function", GPU Computing Gems, 2011), then one Newton step on ``Erf``.
* ``kvforge::gated_delta_rule`` and ``kvforge::kda_rule`` (Gated DeltaNet and KDA layers,
  :mod:`kvforge.graphs.gated_delta`): one node each, which :func:`kvforge.graphs.gated_delta_onnx.expand`
  lowers after the export (an ``If`` on the length: a one-token step, or the chunked rule in MatMuls
  with one ``Scan`` over chunks).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Giles' polynomial coefficients, highest power first: central region (w < 5) and tails.
_CENTRAL = (
    2.81022636e-08,
    3.43273939e-07,
    -3.5233877e-06,
    -4.39150654e-06,
    0.00021858087,
    -0.00125372503,
    -0.00417768164,
    0.246640727,
    1.50140941,
)
_TAIL = (
    -0.000200214257,
    0.000100950558,
    0.00134934322,
    -0.00367342844,
    0.00573950773,
    -0.0076224613,
    0.00943887047,
    1.00167406,
    2.83297682,
)
_TWO_OVER_SQRT_PI = 1.1283791670955126


def _erfinv_translation() -> Callable:
    from onnxscript import ir, values

    op = values.Opset("", 18)

    def constant(x, like):
        return op.CastLike(op.Constant(value_float=x), like)

    def polynomial(coefficients, w):
        p = constant(coefficients[0], w)
        for c in coefficients[1:]:
            p = op.Add(op.Mul(p, w), constant(c, w))
        return p

    def erfinv(x):
        dtype = x.dtype
        x32 = op.Cast(x, to=ir.DataType.FLOAT) if dtype != ir.DataType.FLOAT else x
        one = constant(1.0, x32)
        w = op.Neg(op.Log(op.Mul(op.Sub(one, x32), op.Add(one, x32))))  # -log(1 - x^2)
        central = polynomial(_CENTRAL, op.Sub(w, constant(2.5, x32)))
        tail = polynomial(_TAIL, op.Sub(op.Sqrt(w), constant(3.0, x32)))
        y = op.Mul(op.Where(op.Less(w, constant(5.0, x32)), central, tail), x32)
        # one Newton step on erf(y) = x: y -= (erf(y) - x) / (2/sqrt(pi) * exp(-y^2))
        slope = op.Mul(constant(_TWO_OVER_SQRT_PI, x32), op.Exp(op.Neg(op.Mul(y, y))))
        y = op.Sub(y, op.Div(op.Sub(op.Erf(y), x32), slope))
        return op.Cast(y, to=dtype) if dtype != ir.DataType.FLOAT else y

    return erfinv


def translation_table() -> dict:
    """``custom_translation_table`` entries for the ops above."""
    from kvforge.graphs import gated_delta_onnx

    erfinv = _erfinv_translation()
    return {
        torch.ops.prims.erf_inv.default: erfinv,
        torch.ops.aten.erfinv.default: erfinv,
        **gated_delta_onnx.translation_table(),
    }
