"""What an engine needs to set drafting up: the artifact check at load, and each request's drafter."""

from __future__ import annotations

from kvforge.graphs import manifest as mf
from kvforge.runtime.speculative.config import SpeculativeConfig
from kvforge.runtime.speculative.cost import WIDTH_COST
from kvforge.runtime.speculative.drafters import NgramDrafter, PredictionDrafter, RowDrafting


def check_artifact(manifest: mf.Manifest, device: str, one_session: bool) -> None:
    """Speculative decoding needs the verify graph (schema 2), the CPU backend and one session."""
    if "verify" not in manifest.graphs:
        raise mf.ArtifactError(
            f"this artifact (manifest schema {manifest.schema_version}) has no verify graph, which speculative "
            "decoding runs on; recompile the model with this kvforge (kvforge compile MODEL_DIR -o OUT), or load "
            "it without speculative"
        )
    if device != "cpu":
        raise ValueError("speculative decoding runs on ONNX Runtime's CPU provider for now; load with device='cpu'")
    if not one_session:
        raise ValueError("speculative decoding runs every step through one session; load with one_session=True")


def drafting(
    gen,
    params,
    spec: SpeculativeConfig | None,
    draft_model,
    vocab_size: int,
    width_cost: float = WIDTH_COST,
    rerun: bool = False,
) -> RowDrafting | None:
    """The request's drafting: its prediction, else the engine's method; None when it does not draft
    (no speculative config, ``speculative=False``, or method ``"prediction"`` without a prediction).
    Without speculative decoding a prediction is ignored: it would change nothing in the output.
    ``rerun``: the artifact's layers keep a state (a rejection costs a second call, :mod:`.states`)."""
    if params.prediction is not None and spec is not None:
        bad = [t for t in params.prediction if t >= vocab_size]
        if bad:
            raise ValueError(f"prediction has token id {bad[0]} outside the vocabulary [0, {vocab_size})")
        if params.speculative:
            return RowDrafting(PredictionDrafter(params.prediction), spec.prediction_k, spec.adaptive, True)
    if spec is None or not params.speculative or spec.method == "prediction":
        return None
    if spec.method == "draft":
        drafter = draft_model.drafter(gen.prompt_ids, lambda: gen.done)
        return RowDrafting(drafter, spec.k, spec.adaptive, token_cost=draft_model.token_cost, rerun=rerun)
    drafter = NgramDrafter(gen.prompt_ids, spec.ngram_max, spec.ngram_min)
    return RowDrafting(drafter, spec.k, spec.adaptive, width_cost=width_cost, rerun=rerun)
