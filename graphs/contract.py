"""The KV-cache contract shared by the compiler, the graphs and the runtime.

Names and shapes only, with no imports beyond the standard library: the runtime imports this
module, and loading an engine must not pull in torch. The reference semantics of the contract (one
layer's cache update and attention, in plain torch) are in :mod:`kvforge.graphs.reference`.

Layout. One allocation per engine, ``[L, 2, B_max, H_kv, S_max, D]`` in the model's dtype. Layer
``l``'s key cache is the contiguous view ``cache[l, 0]`` = ``[B_max, H_kv, S_max, D]``, its value cache
``cache[l, 1]``. The first ``B`` rows of a layer's cache, ``cache[l, 0, :B]``, are contiguous too,
which is how a batch smaller than ``B_max`` is bound without a copy.

Rows. Row ``b`` holds its tokens at cache indices ``[0, len_b)``: no left padding inside the cache.
A graph call writes its ``S`` new tokens of row ``b`` at ``[write_indices[b], write_indices[b] + S)``
and the query at cache index ``i`` attends keys ``[0, i]`` of its own row (``[i - window + 1, i]``
for a sliding-window layer). Padding tokens of a ragged prefill are written but never attended by
a real token, and the next call overwrites them.

Model state (schema 3). A model's state is a list of per-layer :class:`StateEntry` of known kinds
(:data:`STATE_KINDS`), described by a :class:`Layout`: attention KV only for the layers that
attend (the KV allocation is ``[L_attn, 2, B_max, H_kv, S_max, D]`` over ``Layout.attention``, in
that order), and for every other layer its state tensors, each ``[B_max, *shape]`` in its own
dtype, allocated once per engine and bound by pointer like the KV views. A state is valid at
exactly one position (the row's length), unlike KV rows, which are indexed by position:

* ``conv`` (LFM2's short convolution): ``conv [C, K-1]`` in the model's dtype, the last ``K-1``
  inputs of the layer's depthwise convolution (``reference.conv_update``);
* ``gated_delta`` (Qwen3.5, Qwen3-Next): ``conv [C, K-1]`` and ``recurrent [H, Dk, Dv]`` float32
  (``reference.gated_delta_step``);
* ``mamba2``: ``conv [C, K-1]`` and ``recurrent [H, N, P]`` float32 (``reference.mamba2_step``;
  transformers keeps ``[H, P, N]``: kvforge's is the layout ONNX Runtime's ``LinearAttention``
  updates in place, ``[Dk, Dv]`` with ``k = B``; artifacts compiled before it recorded ``[H, P, N]``
  and no ``axes``, and still run, since only the graphs read the state);
* ``mamba``: ``conv [D, K-1]`` and ``recurrent [D, N]`` float32 (``reference.mamba_step``).

Graph names: input ``past_state.{l}.{part}``, output ``present_state.{l}.{part}`` (``part`` is
"conv" or "recurrent"), after the KV names, in layer order.

A graph call reads each row's state as the state after its first ``write_indices[b]`` tokens,
except that a row with ``write_indices[b] == 0`` starts from zeros (the graph masks the input),
so a new sequence needs no reset copy. It writes the state after the row's last real token (the
last position that gets logits: ``input_lengths - 1`` in prefill). The runtime binds a past
state input and its present output to the same buffer: every reader of the past state in the
graph precedes the node that writes the present (the present is computed from it), so the update
is in place.

8-bit KV (``kvforge compile --kv-dtype int8``, :attr:`Layout.kv_dtype` "int8"). The KV allocation
is ``[L_attn, 2, B_max, H_kv, S_max, D]`` int8, and a second allocation ``[L_attn, 2, B_max, H_kv,
S_max]`` float32 (:func:`scale_shape`) holds one scale per cached row of each head: the row's
values are ``int8 · scale``, ``scale = max|x| / 127`` over the row's ``D`` values (symmetric,
per token and head; :func:`kvforge.graphs.reference.quantize_rows`). The graph quantizes the new
rows it writes and dequantizes the rows it reads; each layer's scales are graph inputs
``past_key_values.{l}.key_scale|value_scale`` ``[B, H_kv, S_max, 1]`` and outputs
``present.{l}.key_scale|value_scale``, after every other past/present name (KV, then states,
then scales), bound in place like the KV.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Graph input/output names (the manifest records them too; the runtime binds by these names).
INPUT_IDS = "input_ids"  # [B, S] int64
POSITION_IDS = "position_ids"  # [B, S] int64
WRITE_INDICES = "write_indices"  # [B] int64: cache index of each row's first new token
INPUT_LENGTHS = "input_lengths"  # [B] int64, prefill only: real (unpadded) tokens per row
LOGIT_INDICES = "logit_indices"  # [B, P] int64, verify only: the positions of each row that get logits
LOGITS = "logits"  # [B, V]: logits of each row's last real token ([B, S, V] score, [B, P, V] verify)
# verify (schema 2): the traced general graph itself, logits at ``logit_indices``; prefill, decode and
# speculative verification are all its cases, so the runtime's one session can serve them all.
GRAPHS = ("prefill", "decode", "score", "verify")
# --kv-dtype: "float" = the model's dtype; "int8" = int8 rows with a float32 scale per row and head
KV_DTYPES = ("float", "int8")
KV_SCALE_DTYPE = "float32"


# State kinds: what each per-layer entry is. "attention" is KV; the others are not position-indexed.
STATE_KINDS = ("attention", "conv", "gated_delta", "mamba2", "mamba")
# The named tensors of each kind, in graph order.
STATE_TENSORS = {
    "attention": ("key", "value"),
    "conv": ("conv",),
    "gated_delta": ("conv", "recurrent"),
    "mamba2": ("conv", "recurrent"),
    "mamba": ("conv", "recurrent"),
}


@dataclass(frozen=True)
class StateTensor:
    """One state tensor of a layer: ``part`` ("conv", "recurrent"), its per-row ``shape`` (the
    batch axis excluded) and numpy-style ``dtype``. ``axes`` names the axes where the kind's
    layout changed since its first artifacts (a Mamba2 recurrent state: ``"hnp"``; ``""``, the
    kind's first layout), for the tools that read a state beside transformers' (``compare``)."""

    part: str
    shape: tuple[int, ...]
    dtype: str
    axes: str = ""

    @property
    def row_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class StateEntry:
    """The state of one non-attention layer ``layer`` of kind ``kind`` (see :data:`STATE_KINDS`)."""

    layer: int
    kind: str
    tensors: tuple[StateTensor, ...]

    def to_dict(self) -> dict:
        return {
            "layer": self.layer,
            "kind": self.kind,
            "tensors": [
                {"part": t.part, "shape": list(t.shape), "dtype": t.dtype, **({"axes": t.axes} if t.axes else {})}
                for t in self.tensors
            ],
        }

    @classmethod
    def from_dict(cls, data: dict) -> StateEntry:
        tensors = tuple(
            StateTensor(t["part"], tuple(t["shape"]), t["dtype"], str(t.get("axes", ""))) for t in data["tensors"]
        )
        return cls(int(data["layer"]), str(data["kind"]), tensors)


@dataclass(frozen=True)
class Layout:
    """Which layers keep attention KV (``attention``, ascending) and which keep a state (``states``).
    ``Layout.all_attention(n)`` is every model before schema 3."""

    attention: tuple[int, ...]
    states: tuple[StateEntry, ...] = field(default=())
    kv_dtype: str = "float"  # one of KV_DTYPES: "int8" adds the scale inputs/outputs (module docstring)

    @property
    def quantized_kv(self) -> bool:
        return self.kv_dtype == "int8"

    @classmethod
    def all_attention(cls, num_layers: int) -> Layout:
        return cls(tuple(range(num_layers)))

    @property
    def has_state(self) -> bool:
        return bool(self.states)

    def state_tensors(self) -> list[tuple[StateEntry, StateTensor]]:
        return [(entry, t) for entry in self.states for t in entry.tensors]

    def state_row_bytes(self) -> int:
        """Bytes of one row's state (every state tensor; KV excluded)."""
        return sum(t.row_elements * _ITEMSIZE[t.dtype] for _, t in self.state_tensors())


_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def _layout(layers: int | Layout) -> Layout:
    return layers if isinstance(layers, Layout) else Layout.all_attention(layers)


def past_state_name(layer: int, part: str) -> str:
    return f"past_state.{layer}.{part}"


def present_state_name(layer: int, part: str) -> str:
    return f"present_state.{layer}.{part}"


def past_key_name(layer: int) -> str:
    return f"past_key_values.{layer}.key"


def past_value_name(layer: int) -> str:
    return f"past_key_values.{layer}.value"


def present_key_name(layer: int) -> str:
    return f"present.{layer}.key"


def present_value_name(layer: int) -> str:
    return f"present.{layer}.value"


def past_scale_name(layer: int, kind: str) -> str:
    """``kind`` "key" or "value": the 8-bit KV's scale input of ``layer``."""
    return f"past_key_values.{layer}.{kind}_scale"


def present_scale_name(layer: int, kind: str) -> str:
    return f"present.{layer}.{kind}_scale"


def kv_scale_past_names(layers: int | Layout) -> list[str]:
    """The 8-bit KV's scale inputs (layer a key, layer a value, ...); [] for a float KV cache."""
    layout = _layout(layers)
    if not layout.quantized_kv:
        return []
    return [past_scale_name(layer, kind) for layer in layout.attention for kind in ("key", "value")]


def kv_scale_present_names(layers: int | Layout) -> list[str]:
    layout = _layout(layers)
    if not layout.quantized_kv:
        return []
    return [present_scale_name(layer, kind) for layer in layout.attention for kind in ("key", "value")]


def kv_past_names(layers: int | Layout) -> list[str]:
    """Past KV input names in graph order: layer a key, layer a value, layer b key, ... over the
    attention layers (``layers``: a layer count, every layer attending, or a :class:`Layout`)."""
    return [n for layer in _layout(layers).attention for n in (past_key_name(layer), past_value_name(layer))]


def kv_present_names(layers: int | Layout) -> list[str]:
    """Present KV output names, in the same order as :func:`kv_past_names`."""
    return [n for layer in _layout(layers).attention for n in (present_key_name(layer), present_value_name(layer))]


def past_names(layers: int | Layout) -> list[str]:
    """Every past input in graph order: the attention layers' KV, then each state tensor, then
    (8-bit KV) the KV scales."""
    layout = _layout(layers)
    states = [past_state_name(e.layer, t.part) for e, t in layout.state_tensors()]
    return [*kv_past_names(layout), *states, *kv_scale_past_names(layout)]


def present_names(layers: int | Layout) -> list[str]:
    """Every present output, in the same order as :func:`past_names`."""
    layout = _layout(layers)
    states = [present_state_name(e.layer, t.part) for e, t in layout.state_tensors()]
    return [*kv_present_names(layout), *states, *kv_scale_present_names(layout)]


def prefill_input_names(layers: int | Layout) -> list[str]:
    return [INPUT_IDS, POSITION_IDS, WRITE_INDICES, INPUT_LENGTHS, *past_names(layers)]


def decode_input_names(layers: int | Layout) -> list[str]:
    return [INPUT_IDS, POSITION_IDS, WRITE_INDICES, *past_names(layers)]


def verify_input_names(layers: int | Layout) -> list[str]:
    return [INPUT_IDS, POSITION_IDS, WRITE_INDICES, LOGIT_INDICES, *past_names(layers)]


def input_names(graph: str, layers: int | Layout) -> list[str]:
    """Input names of ``graph`` ("prefill", "decode", "score" or "verify"), in graph order."""
    if graph == "verify":
        return verify_input_names(layers)
    return prefill_input_names(layers) if graph == "prefill" else decode_input_names(layers)


def output_names(layers: int | Layout) -> list[str]:
    return [LOGITS, *present_names(layers)]


def state_shape(max_batch: int, tensor: StateTensor) -> tuple[int, ...]:
    """Shape of one state tensor's allocation: ``[B_max, *tensor.shape]``."""
    return (max_batch, *tensor.shape)


def cache_shape(
    num_layers: int, max_batch: int, num_kv_heads: int, max_seq: int, head_dim: int
) -> tuple[int, int, int, int, int, int]:
    """Shape of the one KV allocation: ``[L, 2, B_max, H_kv, S_max, D]``."""
    return (num_layers, 2, max_batch, num_kv_heads, max_seq, head_dim)


def scale_shape(num_layers: int, max_batch: int, num_kv_heads: int, max_seq: int) -> tuple[int, int, int, int, int]:
    """Shape of the 8-bit KV's scale allocation: ``[L, 2, B_max, H_kv, S_max]`` float32."""
    return (num_layers, 2, max_batch, num_kv_heads, max_seq)


def kv_row_bytes(layout: Layout, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes one position of one row takes in the KV cache, every attention layer's key and value
    (scales included for 8-bit KV; ``dtype_bytes``: the model dtype's item size)."""
    per_head = head_dim + 4 if layout.quantized_kv else head_dim * dtype_bytes
    return len(layout.attention) * 2 * num_kv_heads * per_head
