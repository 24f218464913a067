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


def test_collect_runs_a_full_collection_only_for_large_drops(monkeypatch):
    calls = []
    monkeypatch.setattr(heap.gc, "collect", lambda *a: calls.append(a) or 0)
    assert heap.collect(heap.COLLECT_BYTES - 1) is False and calls == []
    assert heap.collect(heap.COLLECT_BYTES) is True and calls == [()]


def test_tensor_bytes_counts_parameters_buffers_and_meta_layers():
    import torch

    from kvforge.compile.load import tensor_bytes

    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
    model.append(torch.nn.Linear(4, 16, device="meta", dtype=torch.float16))  # a streamed layer's
    # fp32: 8x4 + 4 (Linear), 4 + 4 (affine) + 4 + 4 + 1 int64 (BatchNorm's buffers); fp16: 4x16 + 16
    assert tensor_bytes(model) == 4 * (32 + 4 + 4 + 4 + 4 + 4) + 8 + 2 * (64 + 16)


def test_a_tiny_models_compile_runs_no_full_collection(llama_dir, tmp_path, monkeypatch):
    """A model of a few KiB: compile's explicit collections (two here; each 0.6 s on average in a
    test worker) are skipped; the artifact is complete."""
    from kvforge.compile import compile_model

    calls = []
    real = heap.gc.collect
    monkeypatch.setattr(heap.gc, "collect", lambda *a: calls.append(a) or real(*a))
    manifest = compile_model(llama_dir, tmp_path / "out", max_batch=1, max_seq=32, progress=None)
    assert calls == [] and manifest.parity["greedy_match"]
