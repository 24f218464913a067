"""Logit comparison metrics: kvforge's logits against the reference's, position by position.

Every function takes ``ours`` and ``ref`` as ``[N, V]`` tensors (N positions, V vocabulary), of
any float dtype; they are compared in float32. The definitions are the ones documented in
docs/tools.md:

* ``max_abs_diff`` / ``mean_abs_diff``: of ``|ours - ref|`` over every logit;
* ``kl``: KL(reference ‖ kvforge) = sum_v p_ref(v) (log p_ref(v) - log p_ours(v)) per position, in
  nats, from the softmax of each side's logits, in float64 (clamped at 0 against rounding);
* ``top1_agreement``: fraction of positions whose argmax is the same token on both sides;
* ``top5_agreement``: mean over positions of |top5(ours) ∩ top5(ref)| / 5.
"""

from __future__ import annotations

from typing import Any

import torch

TOP_K = 5


def per_position(ours: torch.Tensor, ref: torch.Tensor, chunk: int = 64) -> dict[str, torch.Tensor]:
    """Each metric per position: a dict of ``[N]`` float32 tensors. Computed ``chunk`` positions at
    a time, so a long text on a large vocabulary does not hold N x V float64 temporaries."""
    if ours.shape != ref.shape or ours.dim() != 2:
        raise ValueError(f"logits to compare must both be [N, V]; got {tuple(ours.shape)} and {tuple(ref.shape)}")
    parts = [_per_position(ours[i : i + chunk], ref[i : i + chunk]) for i in range(0, ours.shape[0], chunk)]
    return concat(parts) if parts else {key: torch.zeros(0) for key in KEYS}


KEYS = ("max_abs_diff", "mean_abs_diff", "kl", "top1", "top5")


def _per_position(ours: torch.Tensor, ref: torch.Tensor) -> dict[str, torch.Tensor]:
    ours, ref = ours.float(), ref.float()
    diff = (ours - ref).abs()  # (N, V)
    # KL in float64: in float32 its rounding floor (~1e-8) would hide the differences of an exact artifact.
    log_p_ours = torch.log_softmax(ours.double(), dim=-1)
    log_p_ref = torch.log_softmax(ref.double(), dim=-1)
    kl = (log_p_ref.exp() * (log_p_ref - log_p_ours)).sum(-1).clamp_min(0.0).float()  # (N,)
    k = min(TOP_K, ours.shape[-1])
    top_ours, top_ref = ours.topk(k, dim=-1).indices, ref.topk(k, dim=-1).indices  # (N, k)
    overlap = (top_ours.unsqueeze(-1) == top_ref.unsqueeze(-2)).any(-1).sum(-1).float() / k  # (N,)
    return {
        "max_abs_diff": diff.amax(-1),
        "mean_abs_diff": diff.mean(-1),
        "kl": kl,
        "top1": (ours.argmax(-1) == ref.argmax(-1)).float(),
        "top5": overlap,
    }


def summarize(per: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The metrics block of a report section (``positions``, differences, KL, agreements)."""
    n = int(per["kl"].numel())
    if n == 0:
        return {"positions": 0}
    return {
        "positions": n,
        "max_abs_diff": float(per["max_abs_diff"].max()),
        "mean_abs_diff": float(per["mean_abs_diff"].mean()),
        "kl_mean": float(per["kl"].mean()),
        "kl_max": float(per["kl"].max()),
        "top1_agreement": float(per["top1"].mean()),
        "top5_agreement": float(per["top5"].mean()),
    }


def concat(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per-position metrics of several comparisons, joined along the position axis."""
    if not parts:
        return {key: torch.zeros(0) for key in KEYS}
    return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}


def compare(ours: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    return summarize(per_position(ours, ref))


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood (nats) of each target under the logits that predict it.

    logits ``[N, V]`` (position i predicts ``targets[i]``), targets ``[N]`` int64 -> ``[N]`` float32.
    """
    log_p = torch.log_softmax(logits.float(), dim=-1)
    return -log_p.gather(-1, targets.view(-1, 1)).squeeze(-1)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two greedy continuations differ (a longer one counts as
    differing where the shorter ended), or ``None`` when they are identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
