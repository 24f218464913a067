"""The binding plan: every graph input and output name -> (buffer, byte offset, shape, dtype).

Pure arithmetic, tested on CPU; the GPU backends allocate what the plan says and bind what it
lists. Two device buffers hold everything a step touches, each allocated once:

- ``cache`` (and ``cache_b`` in alternating mode): the KV cache of the contract. Layer ``l``'s key
  cache ``[B_max, H_kv, S_max, D]`` starts at slot ``2l``, its value cache at slot ``2l + 1``;
  slots are ``slot_bytes`` apart, the slice's size rounded up to 256 bytes (TensorRT's alignment
  rule for bound addresses). Where ``B * H * S * D * bytes`` is already a multiple of 256 the
  buffer is exactly the contract's ``[L, 2, B_max, H_kv, S_max, D]``; otherwise each slice is
  followed by padding, and each slice is still the contiguous ``[B_max, H_kv, S_max, D]`` the
  graphs see, whose first ``B`` rows are the contiguous ``[B, H_kv, S_max, D]`` view of a batch.
- ``io``: the step's small tensors (``input_ids``, ``position_ids``, ``write_indices``,
  ``input_lengths``, ``logits``, ``next_token_ids``), each at a 256-aligned offset, sized for
  the largest shape the engine accepts.

Cache modes. ``alias``: each ``present.*`` output is bound to its ``past_key_values.*`` input's
address, and the graph writes the new rows in place (TensorRT reports it through
``get_aliased_input_tensor``; ORT's CPU and CUDA providers accept it). ``alternate``: the engine
does not alias, so one address must not be both; the runtime keeps two caches and swaps them
each step: step ``n`` reads the cache it last wrote and writes the whole other one. No copy,
twice the memory. A captured CUDA graph has fixed addresses, so alternating mode captures two
graphs per batch size (one per parity).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from kvforge.graphs import contract

ALIGNMENT = 256  # bytes: TensorRT's rule for every bound address; cudaMalloc returns at least this
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4}
ALIAS, ALTERNATE = "alias", "alternate"
CACHE, CACHE_B, IO = "cache", "cache_b", "io"
NEXT_TOKEN_IDS = "next_token_ids"


def align(n: int, alignment: int = ALIGNMENT) -> int:
    """``n`` rounded up to a multiple of ``alignment``."""
    return -(-n // alignment) * alignment


@dataclass(frozen=True)
class Slice:
    """One bound tensor: ``shape`` elements of ``dtype`` at ``offset`` bytes into ``buffer``."""

    buffer: str  # "cache" | "cache_b" | "io"
    offset: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        n = ITEMSIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class CacheLayout:
    """The device KV cache: ``2 L`` slots of ``[B_max, H_kv, S_max, D]``, ``slot_bytes`` apart."""

    num_layers: int
    max_batch: int
    num_kv_heads: int
    max_seq: int
    head_dim: int
    dtype: str

    @property
    def slice_bytes(self) -> int:
        """Bytes of one layer's key (or value) cache, ``B_max * H_kv * S_max * D * itemsize``."""
        return self.max_batch * self.row_bytes

    @property
    def row_bytes(self) -> int:
        """Bytes of one batch row of a slice, ``H_kv * S_max * D * itemsize``."""
        return self.num_kv_heads * self.max_seq * self.head_dim * ITEMSIZE[self.dtype]

    @property
    def slot_bytes(self) -> int:
        return align(self.slice_bytes)

    @property
    def padding_bytes(self) -> int:
        return self.slot_bytes - self.slice_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of one cache allocation (the contract's size plus any padding)."""
        return 2 * self.num_layers * self.slot_bytes

    def offset(self, layer: int, kind: int) -> int:
        """Byte offset of layer ``layer``'s key (``kind`` 0) or value (``kind`` 1) cache."""
        if not (0 <= layer < self.num_layers and kind in (0, 1)):
            raise IndexError(f"no cache slot for layer {layer}, kind {kind}")
        return (2 * layer + kind) * self.slot_bytes

    def slices(self, batch: int, buffer: str = CACHE, first: int = 0) -> dict[str, Slice]:
        """Rows ``[first, first + batch)`` of every layer's cache, by past-input name: each the
        contiguous ``[batch, H_kv, S_max, D]`` at ``first * row_bytes`` into its slot. A row range
        that starts at a row whose offset is not a multiple of 256 bytes is refused by
        :func:`check_plan` (``row_bytes`` is a multiple of 256 for any even ``H_kv * S_max`` with
        ``D * itemsize`` >= 128, i.e. for every real model)."""
        if not 1 <= batch <= self.max_batch or not 0 <= first <= self.max_batch - batch:
            raise ValueError(
                f"cache rows [{first}, {first + batch}) are outside [0, {self.max_batch}) (the artifact's max_batch)"
            )
        shape = (batch, self.num_kv_heads, self.max_seq, self.head_dim)
        skip = first * self.row_bytes
        out = {}
        for layer in range(self.num_layers):
            out[contract.past_key_name(layer)] = Slice(buffer, self.offset(layer, 0) + skip, shape, self.dtype)
            out[contract.past_value_name(layer)] = Slice(buffer, self.offset(layer, 1) + skip, shape, self.dtype)
        return out


@dataclass(frozen=True)
class IoLayout:
    """Offsets of the step tensors in the ``io`` buffer, each sized for its largest shape."""

    offsets: dict[str, Slice]  # name -> slice at the largest shape
    nbytes: int

    def slice(self, name: str, shape: tuple[int, ...]) -> Slice:
        full = self.offsets[name]
        want = Slice(full.buffer, full.offset, shape, full.dtype)
        if want.nbytes > full.nbytes:
            raise ValueError(f"{name} of shape {shape} exceeds its buffer (planned for {full.shape})")
        return want


def io_layout(max_batch: int, max_prompt: int, vocab_size: int, logits_dtype: str) -> IoLayout:
    """The ``io`` buffer: every step tensor at a 256-aligned offset."""
    tensors = [
        (contract.INPUT_IDS, (max_batch, max_prompt), "int64"),
        (contract.POSITION_IDS, (max_batch, max_prompt), "int64"),
        (contract.WRITE_INDICES, (max_batch,), "int64"),
        (contract.INPUT_LENGTHS, (max_batch,), "int64"),
        (contract.LOGITS, (max_batch, vocab_size), logits_dtype),
        (NEXT_TOKEN_IDS, (max_batch,), "int32"),
    ]
    offsets, cursor = {}, 0
    for name, shape, dtype in tensors:
        s = Slice(IO, cursor, shape, dtype)
        offsets[name] = s
        cursor = align(cursor + s.nbytes)
    return IoLayout(offsets, cursor)


@dataclass(frozen=True)
class BindingPlan:
    """What one run binds: name -> slice, for a batch of ``batch`` rows of ``seq`` tokens."""

    mode: str  # "alias" | "alternate"
    parity: int  # alternate mode: 0 reads "cache" and writes "cache_b", 1 the reverse; always 0 in alias mode
    inputs: dict[str, Slice]
    outputs: dict[str, Slice]

    def all(self) -> dict[str, Slice]:
        return {**self.inputs, **self.outputs}


def plan_bindings(
    cache: CacheLayout,
    io: IoLayout,
    *,
    graph_inputs: list[str],
    graph_outputs: list[str],
    batch: int,
    seq: int,
    mode: str,
    parity: int = 0,
    first: int = 0,
) -> BindingPlan:
    """Bind every name the graph has, and only those: ``graph_inputs``/``graph_outputs`` are the
    engine's own I/O names (checked against the KV contract); the cache views are rows
    ``[first, first + batch)``. Raises ``ValueError`` for a name the plan cannot place or an
    address that breaks the 256-byte rule."""
    if mode not in (ALIAS, ALTERNATE):
        raise ValueError(f"unknown cache mode {mode!r}; expected {ALIAS!r} or {ALTERNATE!r}")
    if mode == ALIAS and parity != 0:
        raise ValueError("alias mode has one cache: parity must be 0")
    read, write = (CACHE, CACHE_B) if parity == 0 else (CACHE_B, CACHE)
    if mode == ALIAS:
        write = CACHE
    past = cache.slices(batch, read, first)
    present_of = dict(zip(contract.present_names(cache.num_layers), contract.past_names(cache.num_layers)))
    step_shapes = {
        contract.INPUT_IDS: (batch, seq),
        contract.POSITION_IDS: (batch, seq),
        contract.WRITE_INDICES: (batch,),
        contract.INPUT_LENGTHS: (batch,),
        contract.LOGITS: (batch, io.offsets[contract.LOGITS].shape[1]),
        NEXT_TOKEN_IDS: (batch,),
    }
    inputs, outputs = {}, {}
    for name in graph_inputs:
        if name in past:
            inputs[name] = past[name]
        elif name in step_shapes:
            inputs[name] = io.slice(name, step_shapes[name])
        else:
            raise ValueError(f"the binding plan has no place for input {name!r}; recompile or rebuild the artifact")
    for name in graph_outputs:
        if name in present_of:
            s = past[present_of[name]]
            outputs[name] = Slice(write, s.offset, s.shape, s.dtype)
        elif name in step_shapes:
            outputs[name] = io.slice(name, step_shapes[name])
        else:
            raise ValueError(f"the binding plan has no place for output {name!r}; recompile or rebuild the artifact")
    plan = BindingPlan(mode, parity, inputs, outputs)
    check_plan(plan)
    return plan


def check_plan(plan: BindingPlan) -> None:
    """Every address 256-byte aligned; in alias mode each present on its past's address, in
    alternate mode never on it; no two tensors of the step overlapping otherwise."""
    for name, s in plan.all().items():
        if s.offset % ALIGNMENT:
            raise ValueError(
                f"{name} is bound at offset {s.offset}, not a multiple of {ALIGNMENT} bytes (TensorRT's rule); "
                "a cache row range must start at a 256-byte row boundary: compile with an even --max-seq"
            )
    n = len([k for k in plan.inputs if k.startswith("past_key_values.")]) // 2
    for past, present in zip(contract.past_names(n), contract.present_names(n)):
        if past not in plan.inputs or present not in plan.outputs:
            continue
        a, b = plan.inputs[past], plan.outputs[present]
        same = (a.buffer, a.offset) == (b.buffer, b.offset)
        if plan.mode == ALIAS and not same:
            raise ValueError(f"alias mode: {present} must be bound to {past}'s address")
        if plan.mode == ALTERNATE and a.buffer == b.buffer:
            raise ValueError(f"alternate mode: {present} must not be bound to the cache {past} reads")
    spans = sorted(
        (s.buffer, s.offset, s.offset + s.nbytes, name)
        for name, s in plan.all().items()
        if not (plan.mode == ALIAS and name.startswith("present."))
    )
    for (buf_a, _, end_a, name_a), (buf_b, start_b, _, name_b) in itertools.pairwise(spans):
        if buf_a == buf_b and start_b < end_a:
            raise ValueError(f"{name_a} and {name_b} overlap in buffer {buf_a}")


def cache_mode(aliases: dict[str, str | None], num_layers: int) -> str:
    """``alias`` when the engine reports every ``present.*`` output aliasing its own past input
    (``aliases``: output name -> ``get_aliased_input_tensor``'s answer), else ``alternate``."""
    pairs = zip(contract.past_names(num_layers), contract.present_names(num_layers))
    return ALIAS if all(aliases.get(present) == past for past, present in pairs) else ALTERNATE


def load_message(mode: str, layout: CacheLayout, backend: str) -> str:
    """What the runtime prints at load about the cache."""
    size = layout.nbytes / 2**20
    if mode == ALIAS:
        return (
            f"{backend}: each present.* output aliases its past input: one KV cache of {size:.1f} MiB on the device, "
            "updated in place"
        )
    return (
        f"{backend}: the engine does not alias present.* to past inputs: keeping two KV caches "
        f"(2 x {size:.1f} MiB) and alternating them each step (no copy, twice the memory)"
    )
