"""kvforge.runtime: load a compiled artifact and generate, with one persistent KV cache."""

from kvforge.graphs.manifest import ArtifactError
from kvforge.runtime.engine import Engine, GenerationResult

__all__ = ["ArtifactError", "Engine", "GenerationResult"]
