"""The transformers side of ``compare`` and ``bench``: the model users trust, run as they run it.

The reference is transformers' own ``*ForCausalLM`` with eager attention and its default cache
(``DynamicCache``), in the artifact's dtype, loaded from the model directory the user names. These
helpers never touch kvforge's graphs; the tools put the two sides next to each other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvforge.compile import load as load_stage
from kvforge.graphs import manifest as mf


def load(model_dir: str | Path, manifest: mf.Manifest, attention: str = "eager") -> torch.nn.Module:
    """transformers' model of ``model_dir`` (``attention``: eager by default, the artifact's dtype,
    eval mode).

    Raises :class:`kvforge.compile.load.ModelDirError` for a missing or non-HF directory, and a
    ``ValueError`` when its vocabulary is not the artifact's (then no logit can be compared).
    """
    config, _ = load_stage.read_config(model_dir)
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if vocab is not None and vocab != manifest.model.vocab_size:
        raise ValueError(
            f"the reference {str(model_dir)!r} has vocab_size {vocab} but the artifact's logits have "
            f"{manifest.model.vocab_size}; pass the model directory the artifact was compiled from"
        )
    try:
        # compile ran this directory's own modeling code only because its user trusted it; so do we
        trusted = bool((manifest.source or {}).get("trust_remote_code"))
        return load_stage.load_reference(model_dir, manifest.dtype, attention, trust_remote_code=trusted)
    except (OSError, RuntimeError) as e:
        raise load_stage.ModelDirError(f"transformers could not load {str(model_dir)!r}: {e}") from e


def matches_source(manifest: mf.Manifest, model_dir: str | Path) -> bool | None:
    """Whether ``model_dir`` holds the config and weights the artifact was compiled from (by sha256),
    or ``None`` when the manifest does not record them."""
    root = Path(model_dir)
    source = manifest.source or {}
    recorded = source.get("weights") or {}
    if not source.get("config_sha256") or not recorded:
        return None
    if mf.sha256_file(root / "config.json") != source["config_sha256"]:
        return False
    return all((root / name).is_file() and mf.sha256_file(root / name) == digest for name, digest in recorded.items())


@torch.inference_mode()
def all_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """Logits at every position of ``tokens`` from one forward pass, ``[T, V]`` float32."""
    return model(torch.tensor([tokens])).logits[0].float()


@torch.inference_mode()
def cache_tensors(model: torch.nn.Module, tokens: list[int]) -> dict[tuple[int, str], torch.Tensor]:
    """transformers' cache after one forward pass over ``tokens`` (batch 1), by ``(layer, part)``:
    ``key``/``value`` ``[H_kv, T, D]`` of an attention layer (``T``: the positions its cache layer
    keeps, the last ones for a sliding window), ``conv`` / ``recurrent`` of a layer that keeps a state
    (``cache_utils.LinearAttentionLayer``'s ``conv_states`` ``[C, K]``: the last ``K`` inputs, and
    ``recurrent_states``). A cache layer of another kind is left out."""
    cache = model(torch.tensor([tokens]), use_cache=True, logits_to_keep=1).cache
    out = {}
    for layer, entry in enumerate(getattr(cache, "layers", None) or []):
        parts = {"key": getattr(entry, "keys", None), "value": getattr(entry, "values", None)}
        for part, states in (("conv", "conv_states"), ("recurrent", "recurrent_states")):
            held = getattr(entry, states, None)
            parts[part] = held.get(0) if isinstance(held, dict) else held
        for part, tensor in parts.items():
            if isinstance(tensor, torch.Tensor):
                out[layer, part] = tensor[0].float()
    return out


@torch.inference_mode()
def greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """``steps`` greedy tokens after ``prompt`` with transformers' default cache, not stopping at eos
    (callers cut at eos where they compare free generation; teacher forcing continues past it)."""
    out = model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(steps - 1):
        out = model(torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


@dataclass
class TimedRun:
    ttft_s: float  # prefill + first token
    step_s: list[float]  # each decode step: one more token for every row
    e2e_s: float  # ttft + every step
    tokens: list[list[int]]  # generated ids per row
    cache_bytes: int | None  # bytes of the cache tensors at the end of the run


@torch.inference_mode()
def timed_greedy(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int) -> TimedRun:
    """Greedy decoding of ``new_tokens`` tokens for each row of ``ids`` ``[B, P]`` (rows of equal
    length, so no padding), timed the way ``bench`` times kvforge: prefill to the first token,
    then one forward per step. ``logits_to_keep=1`` at prefill, as transformers' ``generate`` does."""
    start = time.perf_counter()
    out = model(ids, use_cache=True, logits_to_keep=1)
    next_ids = out.logits[:, -1].argmax(-1)  # (B,)
    ttft = time.perf_counter() - start
    generated, steps = [next_ids], []
    for _ in range(new_tokens - 1):
        t = time.perf_counter()
        out = model(next_ids[:, None], cache=out.cache, use_cache=True)
        next_ids = out.logits[:, -1].argmax(-1)
        steps.append(time.perf_counter() - t)
        generated.append(next_ids)
    e2e = time.perf_counter() - start
    tokens = torch.stack(generated, dim=1).tolist()  # (B, new_tokens)
    return TimedRun(ttft, steps, e2e, tokens, cache_nbytes(out.cache))


def cache_nbytes(cache) -> int | None:
    """Bytes held by a transformers cache's key and value tensors (``None`` if its layout is unknown)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        return None
    total = 0
    for layer in layers:
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total
