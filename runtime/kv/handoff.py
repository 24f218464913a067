"""``Handoff``: a request after its first token, as plain data plus one KV block (disaggregated
prefill/decode).

    handle = prefill_sched.submit(prompt, 64, sampling, stop, hand_off=True)   # prefill + first token
    handoff = handle.result().handoff                                          # None if it finished there
    handle = decode_sched.resume(handoff)                                      # another engine, same artifact

What a decode worker needs to continue exactly as the colocated scheduler would: the prompt, the
request's parameters (``sampling``: the resolved :class:`SamplingParams` as a JSON-able dict),
the first token with its logprob entry, the sampler's RNG state after its first draw, the prefix
cache hits of the prefill side, and the KV of positions ``[0, len(prompt_ids))`` as a
:class:`KVBlock` (the first token is not in it: the decode side feeds it at its first step). On a
hybrid artifact the block carries the row's state at ``len(prompt_ids)`` too (its ``state``), and
the checksum covers the state after the KV.

Transport. :meth:`Handoff.header` is everything but the block's data, JSON-able (small: the
prompt ids and the fingerprint; on a hybrid each state tensor's name, shape and dtype);
:meth:`Handoff.from_parts` rebuilds a hand-off from a header, an array ``[L, 2, H_kv, n, D]`` (e.g.
a view on shared memory, :mod:`kvforge.runtime.kv.shm`, or an object in Ray's store) and the state
arrays the header names (:func:`split_state` cuts them from the bytes after the KV). Neither
copies the data.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from kvforge.runtime.kv.block import DTYPES, KVBlock, KVBlockError
from kvforge.runtime.sampling import SamplingParams, TokenLogprob

HEADER_VERSION = 1


@dataclass
class Handoff:
    """Everything a decode worker needs to continue a request: plain data plus one KVBlock."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: dict[str, Any]  # the request's resolved SamplingParams, JSON-able (params_dict)
    stop: list[str] | None
    first_token: int
    first_logprobs: TokenLogprob | None  # the first token's entry when sampling["logprobs"] is set
    rng_state: dict[str, Any]  # the sampler's numpy PCG64 state after its first draw
    block: KVBlock  # positions [0, len(prompt_ids))
    cached_tokens: int = 0  # prompt tokens the prefill side took from its prefix cache
    # The block data's checksum ("algorithm:hex", :mod:`.digest`): computed by the export as it
    # copies, checked by the import as it copies (KVBlockError: not imported). Not in the header:
    # a transport carries it (a shared-memory ref's ``checksum``).
    checksum: str | None = field(default=None, compare=False)
    # Seconds the prefill side's export took (the copy out of the cache with its checksum), for
    # metrics; not in the header.
    export_s: float = field(default=0.0, compare=False)
    # Called once the block's data is no longer needed (imported, or the request dropped): a
    # transport's hook that frees the memory the data is a view of (shm.take sets it).
    on_release: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def release(self) -> None:
        """The block's data will not be read again: run ``on_release`` (once)."""
        hook, self.on_release = self.on_release, None
        if hook is not None:
            hook()

    @property
    def nbytes(self) -> int:
        """Bytes of KV data and state (what a transport moves)."""
        return self.block.nbytes

    def header(self) -> dict[str, Any]:
        """JSON-able: everything except ``block.data`` (whose shape and dtype it records)."""
        lp = self.first_logprobs
        return {
            "version": HEADER_VERSION,
            "prompt_ids": [int(t) for t in self.prompt_ids],
            "max_new_tokens": int(self.max_new_tokens),
            "sampling": self.sampling,
            "stop": self.stop,
            "first_token": int(self.first_token),
            "first_logprobs": None if lp is None else [lp.token_id, lp.logprob, [list(t) for t in lp.top]],
            "rng_state": self.rng_state,
            "cached_tokens": int(self.cached_tokens),
            "block": {
                "fingerprint": self.block.fingerprint,
                "start": self.block.start,
                "shape": list(self.block.data.shape),
                "dtype": self.block.data.dtype.name,
                "meta": self.block.meta,
                "state": None
                if self.block.state is None
                else [{"name": k, "shape": list(a.shape), "dtype": a.dtype.name} for k, a in self.block.state.items()],
                # 8-bit KV: the block's scales travel beside its data (from_parts' scales)
                **({"scales_shape": list(self.block.scales.shape)} if self.block.scales is not None else {}),
            },
        }

    @classmethod
    def from_parts(
        cls,
        header: Mapping[str, Any],
        data: np.ndarray,
        state: Mapping[str, np.ndarray] | None = None,
        scales: np.ndarray | None = None,
    ) -> Handoff:
        """The hand-off of ``header`` (from :meth:`header`) with ``data`` as its block's data,
        ``state`` as its state (kept as is: a view stays a view), and ``scales`` its scales when the
        KV is 8-bit. KVBlockError when the header is not one this kvforge reads, or ``data``,
        ``state`` or ``scales`` are not the arrays it describes."""
        if not isinstance(header, Mapping) or header.get("version") != HEADER_VERSION:
            got = header.get("version") if isinstance(header, Mapping) else type(header).__name__
            raise KVBlockError(
                f"not a kvforge hand-off header of version {HEADER_VERSION} (got {got!r}); "
                "the prefill and decode workers must run the same kvforge"
            )
        b = header["block"]
        dtype = np.dtype(DTYPES.get(b["dtype"], b["dtype"]))
        if tuple(data.shape) != tuple(b["shape"]) or data.dtype != dtype:
            raise KVBlockError(
                f"the hand-off's KV data is {data.dtype} {tuple(data.shape)}, its header says {dtype} "
                f"{tuple(b['shape'])}: the data does not belong to this header"
            )
        specs = state_layout(header)
        got = None if state is None else [(k, list(a.shape), a.dtype.name) for k, a in state.items()]
        if got != (None if specs is None else [(k, list(s), d.name) for k, s, d in specs]):
            raise KVBlockError(
                f"the hand-off's state is {got}, its header says {b.get('state')}: the state does not belong to "
                "this header"
            )
        want = b.get("scales_shape")
        if (want is None) != (scales is None) or (scales is not None and tuple(scales.shape) != tuple(want)):
            raise KVBlockError(
                f"the hand-off's header says its KV scales are {want!r} (8-bit KV: [L, 2, H_kv, n] float32; None: a "
                f"float cache), the scales given are {None if scales is None else tuple(scales.shape)!r}: pass the "
                "block's scales with its data (a transport that moves the data only cannot carry 8-bit KV yet)"
            )
        prompt = [int(t) for t in header["prompt_ids"]]
        start = int(b["start"])
        ids = tuple(prompt[start : start + data.shape[3]])
        block = KVBlock(
            b["fingerprint"], start, ids, data, dict(b["meta"]), None if state is None else dict(state), scales
        )
        lp = header["first_logprobs"]
        first_lp = (
            None if lp is None else TokenLogprob(int(lp[0]), float(lp[1]), [(int(t), float(v)) for t, v in lp[2]])
        )
        return cls(
            prompt_ids=prompt,
            max_new_tokens=int(header["max_new_tokens"]),
            sampling=dict(header["sampling"]),
            stop=None if header["stop"] is None else list(header["stop"]),
            first_token=int(header["first_token"]),
            first_logprobs=first_lp,
            rng_state=header["rng_state"],
            block=block,
            cached_tokens=int(header.get("cached_tokens", 0)),
        )


def state_layout(header: Mapping[str, Any]) -> list[tuple[str, tuple[int, ...], np.dtype]] | None:
    """The state tensors a hand-off header names (name, shape, dtype), in data order; None: KV only."""
    specs = header["block"].get("state")
    if specs is None:
        return None
    return [(str(s["name"]), tuple(s["shape"]), np.dtype(DTYPES.get(s["dtype"], s["dtype"]))) for s in specs]


def split_state(header: Mapping[str, Any], raw: np.ndarray) -> dict[str, np.ndarray] | None:
    """The state arrays of ``header`` as views of ``raw`` (uint8, the bytes after the KV data, in
    the header's order); KVBlockError when ``raw`` is shorter. None for a KV-only hand-off."""
    specs = state_layout(header)
    if specs is None:
        return None
    state, at = {}, 0
    for name, shape, dtype in specs:
        size = int(np.prod(shape)) * dtype.itemsize
        if at + size > raw.nbytes:
            raise KVBlockError(f"the hand-off's memory ends inside its state ({raw.nbytes} bytes after the KV data)")
        state[name] = raw[at : at + size].view(dtype).reshape(shape)
        at += size
    return state


def params_dict(params: SamplingParams) -> dict[str, Any]:
    """``params``' fields as a JSON-able dict that ``SamplingParams.from_dict`` takes back
    (logit_bias keys as decimal strings, the prediction as a list)."""
    out: dict[str, Any] = {}
    for f in fields(params):
        value = getattr(params, f.name)
        if f.name == "logit_bias" and value is not None:
            value = {str(k): float(v) for k, v in value.items()}
        elif f.name == "prediction" and value is not None:
            value = list(value)
        elif isinstance(value, Mapping):
            value = dict(value)
        out[f.name] = value
    return out
