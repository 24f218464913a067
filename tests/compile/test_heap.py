"""kvforge.compile.heap: compile freezes the collector's survivors only for its own duration: it
gives back exactly what it froze, and adds no freeze to a caller's (nor gives any of it back)."""

from __future__ import annotations

import gc

from kvforge.compile import heap


def test_freeze_then_unfreeze_leaves_nothing_frozen():
    callers = gc.get_freeze_count()  # a caller (an earlier in-process test) may have frozen objects
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


def test_a_callers_freeze_is_left_alone(monkeypatch):
    """Counted by the calls heap makes, not by gc.get_freeze_count(): that count also drops when a
    frozen object is freed, which an earlier test's freeze (the CLI's) makes likely."""
    before = gc.get_freeze_count()
    gc.freeze()
    calls = []
    monkeypatch.setattr(heap.gc, "freeze", lambda: calls.append("freeze"))
    monkeypatch.setattr(heap.gc, "unfreeze", lambda: calls.append("unfreeze"))
    try:
        heap.freeze_survivors()
        _garbage = [object() for _ in range(1000)]
        heap.freeze_survivors()
        heap.unfreeze()
        assert calls == []  # nothing added to the caller's freeze, nothing of it given back
    finally:
        monkeypatch.undo()
        if not before:
            gc.unfreeze()
