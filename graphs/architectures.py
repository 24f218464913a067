"""The architecture table: the decoder families kvforge verifies, one small frozen entry each.

An entry maps the ``architectures[0]`` string of a Hugging Face ``config.json`` to what the export
wrappers need to know beyond transformers' own modules. Everything that a family does in its own
modules (RoPE variants, norms, MLPs) stays transformers' code; an entry only says what the wrapper
must do around them. ``tests/graphs/test_architectures.py`` mirrors this table with one tiny test
config per entry, and fails when an entry has none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ArchSpec:
    """What kvforge needs to know about one family.

    architecture: the ``config.architectures[0]`` string.
    sliding_window: whether ``config.sliding_window`` applies (to every layer, or to the layers
        that ``config.layer_types`` marks ``"sliding_attention"``).
    final_softcap_attr / logit_scale_attr: config attributes holding a final logit soft-cap
        (``tanh(x / c) * c``) or a logit multiplier, applied after the lm_head.
    """

    architecture: str
    sliding_window: bool = False
    final_softcap_attr: str | None = None
    logit_scale_attr: str | None = None

    def layer_windows(self, config: Any) -> list[int | None]:
        """Per layer: the sliding window in tokens, or None for full causal attention."""
        n = config.num_hidden_layers
        window = getattr(config, "sliding_window", None) if self.sliding_window else None
        if not window:
            return [None] * n
        layer_types = getattr(config, "layer_types", None)
        if layer_types is None:
            return [int(window)] * n
        return [int(window) if t == "sliding_attention" else None for t in layer_types]

    def final_logit_softcap(self, config: Any) -> float:
        return float(getattr(config, self.final_softcap_attr, None) or 0.0) if self.final_softcap_attr else 0.0

    def logit_scale(self, config: Any) -> float:
        if not self.logit_scale_attr:
            return 1.0
        return float(getattr(config, self.logit_scale_attr))


ARCHITECTURES: dict[str, ArchSpec] = {spec.architecture: spec for spec in (ArchSpec("LlamaForCausalLM"),)}


class UnsupportedArchitectureError(ValueError):
    pass


def lookup(architecture: str | None) -> ArchSpec:
    """The entry for ``architecture``; an error that lists the supported ones if there is none."""
    if architecture in ARCHITECTURES:
        return ARCHITECTURES[architecture]
    supported = ", ".join(sorted(ARCHITECTURES))
    raise UnsupportedArchitectureError(f"architecture {architecture!r} is not supported; kvforge supports: {supported}")


@dataclass(frozen=True)
class Dims:
    """The model dimensions the KV contract needs, read from a transformers config."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int

    @classmethod
    def from_config(cls, config: Any) -> Dims:
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        return cls(
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
        )
