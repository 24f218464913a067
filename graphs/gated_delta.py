"""Gated DeltaNet layers (Qwen3.5 dense and MoE, Qwen3-Next, OLMo-hybrid, LaraMini) for export.

transformers runs these layers' linear attention through two pure-torch kernels: the chunked
``torch_chunk_gated_delta_rule`` (prefill) and the token-by-token ``torch_recurrent_gated_delta_rule``
(one-token decode). The chunked one loops in Python over a data-dependent number of chunks, so it
cannot be traced with a dynamic sequence length, and neither knows where a row's real tokens end.
Both are registered in transformers' kernel hub (``use_kernel_func_from_hub_with_fallback`` and the
layer's ``use_kernelized_func``); :func:`use_export_kernels` maps both names, through the ``kernels``
package's own mapping and ``kernelize``, to :func:`export_gated_delta_rule`, which runs the torch
custom op ``kvforge::gated_delta_rule`` (opaque to the exporter), lowered in standard ONNX ops by
:mod:`kvforge.graphs.gated_delta_onnx`.

The algorithm (transformers' chunked form, FLA's "WY" representation), per row and value head, for
``S`` tokens in chunks of ``C = min(S, CHUNK)`` (the last one padded with ``g = beta = 0``, which
leaves the state as it is):

* within each chunk, all chunks at once, in MatMuls: the cumulative log decay ``cum``, the decays
  between positions ``exp(cum_i - cum_j)``, the strictly lower ``A = (beta k kᵀ) ⊙ decay`` and
  ``T = (I + A)⁻¹`` by block forward substitution (:func:`unit_lower_inverse`: ``log2(CHUNK)``
  levels of two MatMuls each; ONNX has no triangular solve), the corrected values
  ``T (beta v)`` and the decayed keys that read the previous state ``T (beta k exp(cum))``;
* across chunks, the state passes from one chunk to the next (ONNX ``Scan`` over the chunks:
  the only loop, ``ceil(S / CHUNK)`` iterations). At ``S = 1`` every within-chunk matrix is
  ``1 x 1`` and the chunk step is the recurrent step: the ONNX lowering branches to it (an ``If``
  on the length) and skips the chunk machinery.

Ragged rows: positions at or past a row's ``lengths[b]`` (:func:`kvforge.graphs.state.current`)
get ``g = 0`` and ``beta = 0``: the state decays by ``exp(0) = 1`` and learns nothing there, so each
row's final state is the one after its last real token; their outputs are never read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvforge.graphs import kernel_swap
from kvforge.graphs import state as export_state

CHUNK = 64  # tokens per chunk (transformers' default chunk_size); a power of two
LEVELS = CHUNK.bit_length() - 1  # block forward substitution levels: log2(CHUNK)
# The smallest log decay the rules exponentiate. A gate that forgets hard (g of -10 per token is
# common: A = exp(A_log) up to 16) sums to hundreds within a chunk, and exp of -87.3..-103 is a
# denormal float32, which costs the CPU ~100x a normal operand in every product it enters (torch
# alone: 108 against 52 ms for a 512-token layer of the Qwen3.5-0.8B shape). exp(-60) = 8.7e-27
# stays normal through the products it meets; what the floor adds to a sum is under 1e-20 of
# it, below float32's resolution of any value that moves a logit (tested: outputs bit-equal to
# the unfloored rule on such gates). Masked entries stay -inf, exp 0.
LOG_DECAY_FLOOR = -60.0


def decay(log_decay: torch.Tensor) -> torch.Tensor:
    """``exp(max(log_decay, LOG_DECAY_FLOOR))``: a decay that never underflows to a denormal; -inf
    (a masked entry) stays 0."""
    return torch.where(log_decay == float("-inf"), log_decay, log_decay.clamp(min=LOG_DECAY_FLOOR)).exp()


def unit_lower_inverse(a: torch.Tensor) -> torch.Tensor:
    """``(I + a)⁻¹`` for a strictly lower triangular ``a [..., C, C]`` (``C <= CHUNK``), by block
    forward substitution: level ``l`` merges the diagonal blocks of size ``2^l`` pairwise,
    ``[[T11, 0], [-T22 A21 T11, T22]]``, written over the whole matrix as ``T - T A_l T`` where
    ``A_l`` keeps the entries of ``a`` that lie in one block of ``2^(l+1)`` but in different blocks
    of ``2^l``. Exact like forward substitution (no power series), in MatMuls only."""
    c = a.shape[-1]
    idx = torch.arange(c, device=a.device)
    rows, cols = idx[:, None], idx[None, :]
    t = torch.eye(c, dtype=a.dtype, device=a.device)
    for level in range(LEVELS):
        block = 1 << level
        if block >= c:
            break
        merged = ((rows // (2 * block)) == (cols // (2 * block))) & ((rows // block) != (cols // block))  # (C, C)
        off = torch.where(merged, a, torch.zeros((), dtype=a.dtype))
        t = t - t @ off @ t
    return t


def _chunked(seq: int, size: int, *xs: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    """``chunk = min(seq, size)`` and each ``x (B, H, S, *)`` zero padded to whole chunks and
    reshaped to ``(B, H, N, chunk, *)`` (``[B, H, S]`` to ``(B, H, N, chunk)``)."""
    chunk = min(seq, size)
    chunks = -(-seq // chunk)
    pad = chunks * chunk - seq
    out = []
    for x in xs:
        widths = (0, 0, 0, pad) if x.dim() == 4 else (0, pad)
        out.append(F.pad(x, widths).reshape(*x.shape[:2], chunks, chunk, *x.shape[3:]))
    return chunk, out


def _pass_state(state, new_values, k_cumdecay, q_decayed, intra, k_decayed, chunk_decay, seq: int):
    """The state passing from chunk to chunk that both rules end with (ONNX: one ``Scan``):
    per-chunk tensors ``(B, H, N, C, *)``, ``chunk_decay (B, H, N, 1 or Dk, 1)`` -> ``(output
    [B, H, S, Dv], final state)``."""
    batch, heads, chunks, chunk, dv = new_values.shape
    outputs = []
    for i in range(chunks):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state  # (B, H, C, Dv)
        outputs.append(q_decayed[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k_decayed[:, :, i].transpose(-1, -2) @ v_new
    return torch.stack(outputs, 2).reshape(batch, heads, chunks * chunk, dv)[:, :, :seq], state


def chunked_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over ``S`` tokens, chunked (see the module docstring), float32.

    query/key ``[B, H, S, Dk]`` (L2-normalized, the query scaled by ``Dk**-0.5``, heads already
    repeated to the value heads), value ``[B, H, S, Dv]``, g ``[B, H, S]`` (log decay, <= 0), beta
    ``[B, H, S]``, state ``[B, H, Dk, Dv]``. Returns ``(output [B, H, S, Dv], final state)``."""
    chunk, (q, k, v, g, beta) = _chunked(key.shape[2], CHUNK, query, key, value, g, beta)  # g, beta (B, H, N, C)

    cum = g.cumsum(-1)  # (B, H, N, C): log decay from the chunk's start through each position
    idx = torch.arange(chunk, device=key.device)
    lower = idx[:, None] >= idx[None, :]  # (C, C)
    pairwise = decay(torch.where(lower, cum[..., :, None] - cum[..., None, :], float("-inf")))  # (B, H, N, C, C)
    k_beta = k * beta[..., None]
    strict = torch.where(idx[:, None] > idx[None, :], (k_beta @ k.transpose(-1, -2)) * pairwise, 0.0)
    t = unit_lower_inverse(strict)  # (B, H, N, C, C)
    new_values = t @ (v * beta[..., None])  # (B, H, N, C, Dv)
    k_cumdecay = t @ (k_beta * decay(cum)[..., None])  # (B, H, N, C, Dk)
    intra = (q @ k.transpose(-1, -2)) * pairwise  # (B, H, N, C, C)
    q_decayed = q * decay(cum)[..., None]
    k_decayed = k * decay(cum[..., -1:] - cum)[..., None]
    chunk_decay = decay(cum[..., -1])[..., None, None]  # (B, H, N, 1, 1)
    return _pass_state(state, new_values, k_cumdecay, q_decayed, intra, k_decayed, chunk_decay, key.shape[2])


def fresh(state: torch.Tensor, continues: torch.Tensor | None) -> torch.Tensor:
    """``state [B, ...]`` with the rows whose ``continues [B]`` is 0 (new sequences) zeroed."""
    if continues is None:
        return state
    return torch.where(continues.view(-1, *([1] * (state.dim() - 1))) != 0, state, torch.zeros((), dtype=state.dtype))


@torch.library.custom_op("kvforge::gated_delta_rule", mutates_args=())
def gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    continues: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chunked_rule` as one op for the exporter, which replaces it by its translation
    (:mod:`kvforge.graphs.gated_delta_onnx`). ``continues [B]`` (float, 1 or 0; optional): rows
    whose 0 start a new sequence, from a zero state (:func:`fresh`)."""
    output, final = chunked_rule(query, key, value, g, beta, fresh(state, continues))
    return output.contiguous(), final.contiguous()


@gated_delta_rule.register_fake
def _(query, key, value, g, beta, state, continues=None):
    return value.new_empty(value.shape), state.new_empty(state.shape)


# ---------------------------------------------------------------- KDA: a decay per key channel

KDA_CHUNK = 16  # tokens per chunk of the per-channel rule: its decays are (C, C, Dk) per chunk, not (C, C)
KDA_LEVELS = KDA_CHUNK.bit_length() - 1


def chunked_kda_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kimi Delta Attention (KDA): :func:`chunked_rule` with a log decay per key channel, g
    ``[B, H, S, Dk]`` (Kimi-Linear, Bailing-hybrid). The state ``[B, H, Dk, Dv]`` decays row by row
    (``state[k, :] *= exp(g[k])``), so the decay between positions ``j <= i`` of a chunk is a vector
    ``exp(cum_i - cum_j) [Dk]`` and the within-chunk products ``A`` and ``intra`` weigh each key
    channel by it before summing over channels: a ``(C, C, Dk)`` tensor per chunk, with every
    exponent ``<= 0`` (no ``exp(-cum)`` factor that overflows when a gate forgets hard). Chunks of
    ``min(S, KDA_CHUNK)`` keep that tensor small; across chunks the same state passing as the
    per-head rule's, the chunk's decay a ``[Dk, 1]`` column."""
    chunk, (q, k, v, g, beta) = _chunked(key.shape[2], KDA_CHUNK, query, key, value, g, beta)  # beta (B, H, N, C)

    cum = g.cumsum(-2)  # (B, H, N, C, Dk): per channel, log decay from the chunk's start
    idx = torch.arange(chunk, device=key.device)
    lower = (idx[:, None] >= idx[None, :])[..., None]  # (C, C, 1)
    diff = cum[..., :, None, :] - cum[..., None, :, :]
    between = decay(torch.where(lower, diff, float("-inf")))  # (B, H, N, C, C, Dk)
    k_beta = k * beta[..., None]
    strict = torch.where(
        idx[:, None] > idx[None, :], (k_beta[..., :, None, :] * k[..., None, :, :] * between).sum(-1), 0.0
    )
    t = unit_lower_inverse(strict)  # (B, H, N, C, C)
    new_values = t @ (v * beta[..., None])  # (B, H, N, C, Dv)
    k_cumdecay = t @ (k_beta * decay(cum))  # (B, H, N, C, Dk)
    intra = (q[..., :, None, :] * k[..., None, :, :] * between).sum(-1)  # (B, H, N, C, C), 0 above the diagonal
    q_decayed = q * decay(cum)
    k_decayed = k * decay(cum[..., -1:, :] - cum)
    chunk_decay = decay(cum[..., -1, :])[..., None]  # (B, H, N, Dk, 1)
    return _pass_state(state, new_values, k_cumdecay, q_decayed, intra, k_decayed, chunk_decay, key.shape[2])


@torch.library.custom_op("kvforge::kda_rule", mutates_args=())
def kda_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    continues: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chunked_kda_rule` as one op for the exporter (:mod:`kvforge.graphs.gated_delta_onnx`)."""
    output, final = chunked_kda_rule(query, key, value, g, beta, fresh(state, continues))
    return output.contiguous(), final.contiguous()


@kda_rule.register_fake
def _(query, key, value, g, beta, state, continues=None):
    return value.new_empty(value.shape), state.new_empty(state.shape)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)  # transformers' (and FLA's) l2norm


def export_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = CHUNK,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **_,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``, same
    arguments and results: query/key ``[B, S, Hk, Dk]``, value ``[B, S, Hv, Dv]``, g/beta
    ``[B, S, Hv]``, initial_state ``[B, Hv, Dk, Dv]`` -> ``(output [B, S, Hv, Dv] in the query's
    dtype, final state float32 or None)``. ``chunk_size`` is ignored: :data:`CHUNK`. Inside a
    wrapper's trace (:func:`kvforge.graphs.state.current`), positions at or past each row's
    ``lengths`` get ``g = beta = 0``, so the final state is the one after the row's last real token."""
    dtype = query.dtype
    batch, seq, k_heads, dk = key.shape
    v_heads, dv = value.shape[-2:]
    if k_heads != v_heads:  # each query/key head serves v_heads // k_heads consecutive value heads
        query = query.repeat_interleave(v_heads // k_heads, dim=2)
        key = key.repeat_interleave(v_heads // k_heads, dim=2)
    per_channel = g.dim() == 4  # KDA: g (B, S, H, Dk)
    query, key, value, g, beta = (x.transpose(1, 2).float() for x in (query, key, value, g, beta))  # (B, H, S, ...)
    if use_qk_l2norm_in_kernel:
        query, key = _l2norm(query), _l2norm(key)
    query = query * dk**-0.5
    cache = export_state.current()
    if cache is not None:  # ragged rows: nothing past a row's last real token reaches its state
        real = torch.arange(seq, device=key.device)[None, :] < cache.lengths[:, None]  # (B, S)
        real = real[:, None, :]  # (B, 1, S)
        g = torch.where(real[..., None] if per_channel else real, g, torch.zeros((), dtype=g.dtype))
        beta = torch.where(real, beta, torch.zeros((), dtype=beta.dtype))
    continues = None
    if initial_state is None:
        initial_state = torch.zeros(batch, v_heads, dk, dv, dtype=torch.float32, device=value.device)
    elif cache is not None and (past := cache.unmasked(initial_state)) is not None:
        # the rule zeroes new sequences' states itself: its one-token step scales its per-row
        # factors, where the cache's Where would copy the whole state every step
        initial_state, continues = past, cache.continues.to(torch.float32)
    rule = kda_rule if per_channel else gated_delta_rule
    output, final = rule(query, key, value, g, beta, initial_state.float(), continues)
    output = output.transpose(1, 2).contiguous().to(dtype)  # (B, S, H, Dv)
    return output, (final if output_final_state else None)


# ---------------------------------------------------------------- the kernel swap (transformers' hub)


class ExportChunkGatedDeltaRule(torch.nn.Module):
    """What ``kernels.kernelize`` puts in place of ``torch_chunk_gated_delta_rule``, and of KDA's
    ``chunk_kimi_delta_attention``, whose signature is the same (g per key channel, ``[B, S, H, Dk]``:
    :func:`export_gated_delta_rule` runs :func:`kda_rule` for it): a stateless layer whose ``forward``
    has the signature of the function it replaces (``kernels`` checks it)."""

    can_torch_compile = True

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        chunk_size: int = CHUNK,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return export_gated_delta_rule(
            query, key, value, g, beta, chunk_size, initial_state, output_final_state, use_qk_l2norm_in_kernel
        )


class ExportRecurrentGatedDeltaRule(torch.nn.Module):
    """What ``kernels.kernelize`` puts in place of ``torch_recurrent_gated_delta_rule`` (the same
    op: for one token, the chunk is the token)."""

    can_torch_compile = True

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return export_gated_delta_rule(
            query, key, value, g, beta, CHUNK, initial_state, output_final_state, use_qk_l2norm_in_kernel
        )


class ExportRecurrentKda(torch.nn.Module):
    """What ``kernels.kernelize`` puts in place of KDA's ``recurrent_kimi_delta_attention``."""

    can_torch_compile = True

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        initial_state: torch.Tensor | None,
        output_final_state: bool,
        use_qk_l2norm_in_kernel: bool = False,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return export_gated_delta_rule(
            query, key, value, g, beta, CHUNK, initial_state, output_final_state, use_qk_l2norm_in_kernel
        )


# transformers' hub name of each kernel -> its replacement, in (chunked, recurrent) pairs: a family's
# linear-attention layers register one pair (Gated DeltaNet's, or KDA's: Kimi-Linear, Bailing-hybrid)
_PAIRS = (
    {
        "chunk_gated_delta_rule": ExportChunkGatedDeltaRule,
        "fused_recurrent_gated_delta_rule": ExportRecurrentGatedDeltaRule,
    },
    {"chunk_kda": ExportChunkGatedDeltaRule, "fused_recurrent_kda": ExportRecurrentKda},
)
# the causal convolution: swapped where a family's layers register it; transformers' own runs where not
_CONV = export_state.CONV_KERNELS


def use_export_kernels(model: torch.nn.Module) -> None:
    """Swap the delta rule kernels of every linear-attention layer of ``model`` (a CPU model loaded
    for export, with at least one such layer: Gated DeltaNet's or KDA's) for kvforge's
    (:class:`ExportChunkGatedDeltaRule` for either chunked rule, :class:`ExportRecurrentGatedDeltaRule`
    or :class:`ExportRecurrentKda` for the one-token step), and their causal convolution's
    ``causal_conv1d_forward`` where they register it
    (:class:`kvforge.graphs.state.ExportCausalConv1dForward`), through the ``kernels`` package's
    mapping and ``kernelize`` (the extension point transformers registers them with). Only
    ``model``'s own kernel wrappers change: another instance of the family (the parity reference)
    keeps transformers' kernels."""
    counts = kernel_swap.kernelize(model, {**{name: layer for pair in _PAIRS for name, layer in pair.items()}, **_CONV})
    swapped = [all(counts[name] for name in pair) for pair in _PAIRS]
    partly = [any(counts[name] for name in pair) and not whole for pair, whole in zip(_PAIRS, swapped)]
    if not any(swapped) or any(partly):
        raise RuntimeError(
            f"{type(model).__name__}'s linear-attention layers do not run the delta rule through a pair of kernels "
            "that kernels.kernelize swapped (their transformers modules must register the chunked and the recurrent "
            f"rule with use_kernelized_func: {' or '.join(' and '.join(pair) for pair in _PAIRS)}); swapped: {counts}"
        )
