"""kvforge.compile.heap: compile freezes the collector's survivors only for its own duration: it
gives back exactly what it froze, and adds no freeze to a caller's (nor gives any of it back)."""

from __future__ import annotations

import gc

from kvforge.compile import heap


def test_freeze_then_unfreeze_leaves_nothing_frozen():
    callers = gc.get_freeze_count()  # the CLI freezes after a compile: an earlier in-process test may have
    gc.unfreeze()
    try:
        heap.freeze_survivors()
        assert gc.get_freeze_count() > 0
        heap.freeze_survivors()  # a second freeze of its own adds what is alive now
        heap.unfreeze()
        assert gc.get_freeze_count() == 0
        heap.unfreeze()  # nothing of its own left: a no-op
        assert gc.get_freeze_count() == 0
    finally:
        if callers:
            gc.freeze()


def test_a_callers_freeze_is_left_alone():
    before = gc.get_freeze_count()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        heap.freeze_survivors()
        _garbage = [object() for _ in range(1000)]
        heap.freeze_survivors()
        assert gc.get_freeze_count() == frozen  # nothing added to the caller's freeze
        heap.unfreeze()
        assert gc.get_freeze_count() == frozen  # and nothing of it given back
    finally:
        if not before:
            gc.unfreeze()
