"""Swapping transformers' hub-registered kernels for kvforge's, on one model instance.

transformers 5.25 routes its recurrent kernels (Mamba's ``mamba_scan_forward``, Mamba2's
``mamba2_scan_forward``, Gated DeltaNet's ``chunk_gated_delta_rule`` /
``fused_recurrent_gated_delta_rule``) through the ``kernels`` package: each mixer holds a wrapper
per kernel (``use_kernelized_func``) whose forward ``kernels.kernelize`` replaces by a mapping's
layer. :func:`kernelize` maps hub names to kvforge layers defined in process (a repository is
anything with ``load()``), with ``inherit_mapping=False`` so every other hook keeps transformers'
forward, and only on ``model``: another instance of the family (compile's parity reference) keeps
transformers' kernels. No transformers global is patched.

``kernels`` checks each layer: no ``__init__``, no members beyond ``can_torch_compile`` /
``has_backward``, and a ``forward`` with the parameters of the function it replaces.

One call per model: ``kernels.kernelize`` puts transformers' forward back on every hook its
mapping does not name, so a second call would undo the first's swaps (a Mamba2 family's scan
undone by a later swap of its convolution alone). Each family swaps all its kernels in one call;
a second call on the same model is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch


class InProcessRepository:
    """A ``kernels`` repository (its protocol: ``load()`` returns the layer class) whose layer is
    defined in kvforge: nothing is fetched from the Hub."""

    def __init__(self, layer: type[torch.nn.Module]) -> None:
        self.layer = layer

    def load(self) -> type[torch.nn.Module]:
        return self.layer

    def __str__(self) -> str:
        return f"kvforge's {self.layer.__name__}"


def kernelize(model: torch.nn.Module, layers: Mapping[str, type[torch.nn.Module]]) -> dict[str, int]:
    """Put each of ``layers`` (transformers' hub name -> kvforge's layer) in place of that kernel
    in every module of ``model`` that holds it; returns, per name, how many kernel wrappers of
    ``model`` now run kvforge's layer (0: this transformers exposes no such hook)."""
    from kernels import Mode, use_kernel_mapping
    from kernels import kernelize as kernels_kernelize

    if getattr(model, "_kvforge_kernelized", None):
        raise RuntimeError(
            f"{type(model).__name__} already runs kvforge's {', '.join(model._kvforge_kernelized)}; a second "
            "kernelize would put transformers' forward back on them: swap every kernel in one call"
        )

    repositories = {name: InProcessRepository(layer) for name, layer in layers.items()}
    device = next(model.parameters()).device.type
    mapping = {name: {device: repository} for name, repository in repositories.items()}
    # kernelize warns once for every other hub-registered hook (norms, convs) that it leaves as it is
    logger = logging.getLogger("kernels")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with use_kernel_mapping(mapping, inherit_mapping=False):
            kernels_kernelize(model, mode=Mode.INFERENCE, device=device)
    finally:
        logger.setLevel(level)
    model._kvforge_kernelized = tuple(layers)
    counts = dict.fromkeys(layers, 0)
    for module in model.modules():
        for wrapper in getattr(module, "_kernel_funcs", {}).values():
            name = getattr(type(wrapper), "kernel_layer_name", None)
            if name in repositories and wrapper.__dict__.get("_kernel_repo") is repositories[name]:
                counts[name] += 1
    return counts
