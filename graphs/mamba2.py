"""Mamba2's selective scan (SSD) as kvforge exports it, swapped in for transformers' own.

transformers runs every Mamba2 layer (Mamba2, Granite 4's ``granitemoehybrid``, Bamba,
Nemotron-H, Falcon-H1) through one kernel-hub extension point, ``mamba2_scan_forward(module,
hidden_states, B, C, dt, cache)``, attached to each mixer with ``use_kernelized_func``.
:func:`kernelize` maps that name to :class:`Mamba2Scan` through the ``kernels`` package's own
mapping (``use_kernel_mapping`` + ``kernelize``; a repository is anything with ``load()``), so no
transformers global is patched. Outside an export wrapper's trace (no
:func:`kvforge.graphs.state.current`) the swapped-in forward hands the call back to transformers'
own function: compile's parity reference stays transformers' code.

Why kvforge needs its own: transformers' chunked scan takes no per-row lengths, so in a ragged
prefill (rows right-padded to one length) the padding would run through each shorter row's state;
its one-token recurrent branch (``seq_len == 1``) is a Python branch that one trace of a dynamic
sequence length cannot keep; and its padding to a multiple of ``chunk_size`` would make every
decode step compute a whole chunk. :func:`ssd_scan` is the SSD algorithm with the graph call as
its one chunk (decayed ``C·B`` scores times the inputs, matmuls; the state carried in and out by
sums over positions; no loop, no reshape of the dynamic length, so ``torch.export`` keeps it
symbolic), with

* ``dt = 0`` at every position ``>= lengths[b]`` (after softplus and the clamp): the decay there
  is ``exp(0) = 1`` and the input ``dt·x·B`` is 0, so the state written is each row's state
  after its last real token;
* at ``S = 1`` (decode) the scores are ``1 x 1``: the recurrent step (``reference.mamba2_step``);
  a prefill's cost is quadratic in its length like attention's (the runtime's prefill chunk
  bounds it), and linear in the state it carries;
* the initial state the graph's ``past_state.{l}.recurrent`` input gives (zeros for a row that
  starts a sequence, :class:`kvforge.graphs.state.ExportStateCache`), float32 throughout.

The ``gqa`` lowering (ONNX Runtime only) traces the scan as the custom op ``kvforge::mamba2_scan``
instead (:func:`linear_attention` says when), which :mod:`kvforge.graphs.gated_delta_onnx` lowers
to ONNX Runtime's ``com.microsoft.LinearAttention`` with ``update_rule="gated"``: the SSD step
``h = exp(dt·A) h + B ⊗ (dt·x)``, ``y = Cᵀ h + D·x`` is that rule with ``k = B``, ``v = dt·x``,
``q = C`` and the log decay ``dt·A`` per head, its state ``[Dk, Dv] = [N, P]``: kvforge's layout of
the state, so the graph binds it in place with no transpose. One layer of Granite 4's shape (64
heads of 64, state 128, batch 1, 2 threads): 0.3–0.5 against 3.4 ms a token, 23 against 232 ms at
512 tokens, 0.11 against 5.2 s at 2048 (this scan is quadratic in the call's length; the op's
chunked form is not) (benchmarks/FINDINGS.md).

Shapes: b batch, s/t positions, h heads, p head dim, g groups, n state size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch
import torch.nn.functional as F

from kvforge.graphs import kernel_swap, state
from kvforge.graphs.gated_delta import fresh

SCAN_FUNCTION = "mamba2_scan_forward"  # transformers' kernel-hub name of the Mamba2 scan

_AS_OP: ContextVar[bool] = ContextVar("kvforge_mamba2_as_op", default=False)


@contextlib.contextmanager
def linear_attention(on: bool) -> Iterator[None]:
    """While this is on (``on``: the export is for the ``gqa`` lowering), :func:`scan_forward`
    traces the scan as one ``kvforge::mamba2_scan`` op, which the lowering turns into ONNX
    Runtime's ``LinearAttention``; otherwise as :func:`ssd_scan`'s standard ops."""
    token = _AS_OP.set(on)
    try:
        yield
    finally:
        _AS_OP.reset(token)


def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    """``x [..., q]`` -> ``[..., q, q]`` with ``out[..., i, j] = sum(x[..., j+1 : i+1])`` for
    ``j <= i`` and ``-inf`` above the diagonal (transformers' ``segment_sum``)."""
    q = x.size(-1)
    x = x[..., None].expand(*x.size(), q)  # (..., q, q): x[i] in column j
    strict = torch.tril(torch.ones(q, q, dtype=torch.bool, device=x.device), diagonal=-1)
    sums = torch.cumsum(x.masked_fill(~strict, 0), dim=-2)
    lower = torch.tril(torch.ones(q, q, dtype=torch.bool, device=x.device), diagonal=0)
    return sums.masked_fill(~lower, -torch.inf)


def _real_steps(dt: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """``dt [b, s, h]`` with 0 at every position ``>= lengths[b]``: padding after a row's last
    real token leaves its state unchanged (decay ``exp(0) = 1``, input ``0·x``)."""
    if lengths is None:
        return dt
    real = torch.arange(dt.shape[1], device=dt.device)[None, :] < lengths[:, None]  # (b, s)
    return torch.where(real[..., None], dt, torch.zeros((), dtype=dt.dtype))


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    initial_state: torch.Tensor | None,
    lengths: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan over ``x [b, s, h, p]`` from ``initial_state [b, h, n, p]`` (None: zeros;
    kvforge's layout, transformers' ``[b, h, p, n]`` transposed), the whole call as one chunk of the
    chunked algorithm.

    ``dt [b, s, h]`` is already discretized (bias, softplus, clamp); ``a [h]`` negative; ``b``,
    ``c [b, s, g, n]``; ``d [h]``; ``lengths [b]`` int64 real positions per row (None: all ``s``).
    Returns ``(y [b, s, h, p], final_state [b, h, n, p])`` in float32: ``y`` includes the ``D``
    skip, and ``final_state`` is the state after each row's ``lengths[b]``-th position, as if
    ``reference.mamba2_step`` ran token by token:

    ``y_t = sum_{s<=t} (C_t·B_s) exp(A·(dt_{s+1} + ... + dt_t)) dt_s x_s + C_t·(exp(A·(dt_1 + ... +
    dt_t)) h_0) + D x_t``, and ``h_S = sum_s exp(A·(dt_{s+1} + ... + dt_S)) B_s ⊗ dt_s x_s +
    exp(A·(dt_1 + ... + dt_S)) h_0``: matmuls over ``[s, s]`` decayed scores and sums over
    positions, no loop."""
    batch, seq, heads, _ = x.shape
    groups = b.shape[2]
    x = x.float()
    dt = _real_steps(dt.float(), lengths)
    b, c = b.float(), c.float()
    xdt = x * dt[..., None]  # (b, s, h, p): the discretized input
    adt = (a.float()[None, None, :] * dt).transpose(1, 2)  # (b, h, s): log decay of each step
    a_cumsum = torch.cumsum(adt, dim=-1)  # (b, h, s)

    # positions to positions: C_t·B_s per group, decayed from s to t (causal), per head
    decay = torch.exp(_segment_sum(adt))  # (b, h, t, s)
    scores = torch.einsum("btgn,bsgn->bgts", c, b)  # (b, g, t, s)
    scores = (decay.view(batch, groups, heads // groups, seq, seq) * scores[:, :, None]).view(batch, heads, seq, seq)
    y = torch.einsum("bhts,bshp->bthp", scores, xdt)  # (b, t, h, p)

    # each head's group of B and C, as transformers repeats them
    b = b.repeat_interleave(heads // groups, dim=2)  # (b, s, h, n)
    c = c.repeat_interleave(heads // groups, dim=2)
    to_end = torch.exp(a_cumsum[..., -1:] - a_cumsum)  # (b, h, s): decay from each position to the last
    final_state = torch.einsum("bshn,bhs,bshp->bhnp", b, to_end, xdt)  # (b, h, n, p)
    if initial_state is not None:  # the state before the call, read at each position and carried to the end
        initial_state = initial_state.float()
        y = y + torch.einsum("bthn,bhnp,bht->bthp", c, initial_state, torch.exp(a_cumsum))
        final_state = final_state + torch.exp(a_cumsum[..., -1])[..., None, None] * initial_state
    return y + d.float()[:, None] * x, final_state


@torch.library.custom_op("kvforge::mamba2_scan", mutates_args=())
def mamba2_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    state: torch.Tensor,
    continues: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ssd_scan` as one op for the exporter (the ``gqa`` lowering), float32 in and out:
    ``dt`` already 0 past each row's last real token; ``continues [B]`` (1 or 0; optional): rows
    whose 0 start a new sequence, from a zero state. Returns ``(y [b, s, h, p], final_state [b, h,
    n, p])``."""
    y, final_state = ssd_scan(x, dt, a, b, c, d, fresh(state, continues), None)
    return y.contiguous(), final_state.contiguous()


@mamba2_scan.register_fake
def _(x, dt, a, b, c, d, state, continues=None):
    return x.new_empty(x.shape), state.new_empty(state.shape)


def scan_forward(module, hidden_states, b, c, dt, cache) -> torch.Tensor:
    """``mamba2_scan_forward`` over one graph call of an export wrapper: ``hidden_states [b, s,
    h*p]``, ``b``/``c [b, s, g*n]``, ``dt [b, s, h]`` before its bias and softplus. Reads the
    layer's recurrent state from ``cache`` (the wrapper's :class:`ExportStateCache`) and records
    the new one there. Returns ``[b, s, h*p]`` float32, the D skip included."""
    batch, seq, _ = hidden_states.shape
    active = state.current()
    dt = F.softplus(dt.float() + module.dt_bias.float())
    low, high = module.time_step_limit or (0.0, float("inf"))
    if low > 0.0 or high != float("inf"):
        dt = torch.clamp(dt, min=low, max=high)
    initial = cache.get_recurrent_state(module.layer_idx) if cache is not None else None
    x = hidden_states.view(batch, seq, module.num_heads, module.head_dim)
    b = b.view(batch, seq, module.n_groups, module.ssm_state_size)
    c = c.view(batch, seq, module.n_groups, module.ssm_state_size)
    a = -torch.exp(module.A_log.float())
    lengths = active.lengths if active is not None else None
    past = cache.unmasked(initial) if _AS_OP.get() and active is not None and initial is not None else None
    if past is not None:  # the op zeroes new sequences' states itself (the Where over the state goes unread)
        y, final_state = torch.ops.kvforge.mamba2_scan(
            x.float(), _real_steps(dt, lengths), a, b.float(), c.float(), module.D.float(), past.float(),
            active.continues.to(torch.float32),
        )  # fmt: skip
    else:
        y, final_state = ssd_scan(x, dt, a, b, c, module.D, initial, lengths)
    if cache is not None:
        cache.update_recurrent_state(final_state, module.layer_idx)
    return y.reshape(batch, seq, module.num_heads * module.head_dim)


class Mamba2Scan(torch.nn.Module):
    """The forward the ``kernels`` package puts in place of ``mamba2_scan_forward`` on each mixer
    (stateless, as it requires): :func:`scan_forward` inside an export wrapper's trace, else
    transformers' own function, unchanged."""

    can_torch_compile = True
    has_backward = False

    def forward(self, module, hidden_states, B, C, dt, cache, **kwargs):  # transformers' signature (kernels checks it)
        if state.current() is None:  # not exporting: transformers' function, as if never swapped
            return type(self).forward(self, module, hidden_states, B, C, dt, cache, **kwargs)
        return scan_forward(module, hidden_states, B, C, dt, cache)


def kernelize(model: torch.nn.Module) -> int:
    """Put :class:`Mamba2Scan` in place of ``mamba2_scan_forward`` in every Mamba2 mixer of
    ``model``, and :class:`kvforge.graphs.state.ExportCausalConv1dForward` in place of its causal
    convolution, ``causal_conv1d_forward``, where the family calls it (in place, through the
    ``kernels`` package's mapping; every other kernel-hub function keeps transformers' own
    forward). The convolution then exports as one node whose one-token branch is ``K`` products
    and a sum per channel, where ORT's depthwise ``Conv`` runs a channel at a time: 10.3 ms of a
    116 ms one-token call of a random Zamba2-1.2B outline's 38 mixers (benchmarks/FINDINGS.md).
    Returns how many mixers took the scan."""
    return kernel_swap.kernelize(model, {SCAN_FUNCTION: Mamba2Scan, **state.CONV_KERNELS})[SCAN_FUNCTION]
