"""Greedy decoding through a backend's device argmax (TensorRT's ``next_token_ids`` output): when
every decoding row is greedy, the batch loop reads back ``[B]`` token ids instead of ``[B, V]``
logits, with the same tokens; a batch with a sampled row falls back to the logits. Run on CPU with
ONNX Runtime's backend given the argmax output the TensorRT plan adds (the argmax of the logits), so
the engine's side of the GPU path is tested without a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from kvforge.graphs import contract
from kvforge.runtime import Engine, SamplingParams

PROMPTS = [[0, 17, 42, 99, 5], [0, 7], [0, 300, 301, 302, 303, 304, 305, 306, 12]]


class DeviceArgmax:
    """ORT's CPU backend plus an argmax output, as TensorRT's plan has; records, per run, whether
    the engine asked for the logits (``read_logits``) or only the ids."""

    device_argmax = True

    def __init__(self, inner) -> None:
        self.inner = inner
        self.read_logits: list[bool] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run(self, binding) -> None:
        self.read_logits.append(getattr(binding, "read_logits", True))
        self.inner.run(binding)

    def next_token_ids(self, binding) -> np.ndarray:
        return binding.tensors[contract.LOGITS].argmax(-1).astype(np.int32)


@pytest.fixture
def engines(llama_artifact):
    with Engine.load(llama_artifact) as plain, Engine.load(llama_artifact) as device:
        device.backend = DeviceArgmax(device.backend)
        yield plain, device


def test_greedy_batch_reads_back_ids_only(engines):
    plain, device = engines
    expected = [r.token_ids for r in plain.generate(PROMPTS, max_new_tokens=12)]
    got = [r.token_ids for r in device.generate(PROMPTS, max_new_tokens=12)]
    assert got == expected
    decode_runs = device.backend.read_logits[1:]  # the first run is the prefill: it reads logits
    assert device.backend.read_logits[0] is True
    assert decode_runs and not any(decode_runs), "every decode step of an all-greedy batch reads ids only"


def test_a_sampled_row_makes_the_batch_read_logits(engines):
    plain, device = engines
    sampling = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, seed=3),
        SamplingParams(temperature=0.0),
    ]
    expected = [r.token_ids for r in plain.generate(PROMPTS, max_new_tokens=10, sampling=sampling)]
    got = [r.token_ids for r in device.generate(PROMPTS, max_new_tokens=10, sampling=sampling)]
    assert got == expected
    assert all(device.backend.read_logits), "a sampler needs the logits of its row"


def test_decode_rows_argmax_needs_the_capability(llama_artifact):
    with Engine.load(llama_artifact) as engine:
        engine.prefill([[0, 5, 6]])
        with pytest.raises(RuntimeError, match="has no device argmax; use decode_rows"):
            engine.decode_rows_argmax(1)
