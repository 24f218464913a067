"""The garbage collector during compile: the survivors of the trace are frozen once the torch model
and the weights have left memory, so that later collections do not walk them.

Tracing leaves ~700k long-lived objects (torch's, sympy's and the exporter's caches, the libraries'
modules). Each full (generation 2) collection walks all of them: on the SmolLM-135M shape the two
that Python starts on its own during the ORT optimization took 0.85 s, and 13 full collections
~2.7 s of a 16 s compile. :func:`freeze_survivors` (``gc.freeze``) moves every object alive at that
point out of the collector's reach; objects made after it are collected as before.
:func:`unfreeze` gives them back (``gc.unfreeze``), so a frozen object that became garbage in the
meantime (the general graph, a cycle of small ONNX IR objects) is still freed later.

Freezing before the torch model and its weights are gone would keep them (and the checkpoint's
memory map) alive for the rest of compile if they sit in a reference cycle: compile freezes after
the weights file holds every tensor and a full collection has run.
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
