"""kvforge.runtime: load a compiled artifact and generate, with one persistent KV cache."""

from kvforge.graphs.manifest import ArtifactError
from kvforge.runtime.chat import ChatTemplate, ChatTemplateError
from kvforge.runtime.detokenize import IncrementalDetokenizer
from kvforge.runtime.facade import Engine
from kvforge.runtime.generation import GenerationResult, StreamChunk, Timing
from kvforge.runtime.kv import KVBlock, KVBlockError, PrefixPool
from kvforge.runtime.sampling import GenerationDefaults, Sampler, SamplingParams, TokenLogprob
from kvforge.runtime.scheduler import RequestHandle, Scheduler
from kvforge.runtime.session import Session
from kvforge.runtime.stops import StopStrings
from kvforge.runtime.tokenizer import Tokenizer

__all__ = [
    "ArtifactError",
    "ChatTemplate",
    "ChatTemplateError",
    "Engine",
    "GenerationDefaults",
    "GenerationResult",
    "IncrementalDetokenizer",
    "KVBlock",
    "KVBlockError",
    "PrefixPool",
    "RequestHandle",
    "Sampler",
    "SamplingParams",
    "Scheduler",
    "Session",
    "StopStrings",
    "StreamChunk",
    "Timing",
    "TokenLogprob",
    "Tokenizer",
]
