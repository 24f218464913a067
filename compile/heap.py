"""The garbage collector during compile: long-lived objects are frozen, so that the full
collections Python starts on its own do not walk them again and again.

The libraries' modules and, after the trace, torch's, sympy's and the exporter's caches are ~700k
long-lived objects. Each full (generation 2) collection walks all of them: on the SmolLM-135M shape
13 full collections took ~2.8 s of a 16 s compile (the two that Python started during the ORT
optimization 0.85 s). :func:`freeze_survivors` (``gc.freeze``) moves every object alive at that
point out of the collector's reach; objects made after it are collected as before.
:func:`unfreeze` gives them back (``gc.unfreeze``), so a frozen object that became garbage in the
meantime (the general graph, a cycle of small ONNX IR objects) is still freed later.

Compile freezes at its start (the libraries), after the transformers reference (the loaded model
too: the trace's collections skip it) and after the weights file holds every tensor; it unfreezes
before the torch model is dropped (a model in a reference cycle must be collectable, or it would
keep the checkpoint's memory map for the rest of compile) and at its end.
"""

from __future__ import annotations

import gc

_frozen_here = False


def freeze_survivors() -> None:
    """``gc.freeze()`` (again, adding what is alive now, when this module froze before), unless
    the caller froze objects of its own (its freeze is left alone and none is added)."""
    global _frozen_here
    if _frozen_here or gc.get_freeze_count() == 0:
        gc.freeze()
        _frozen_here = True


def unfreeze() -> None:
    """``gc.unfreeze()`` if :func:`freeze_survivors` froze; else nothing."""
    global _frozen_here
    if _frozen_here:
        gc.unfreeze()
        _frozen_here = False
