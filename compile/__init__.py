"""kvforge.compile: Hugging Face model directory -> prefill/decode graphs, shared weights, manifest."""

from kvforge.compile.pipeline import CompileOptions, compile_model

__all__ = ["CompileOptions", "compile_model"]
