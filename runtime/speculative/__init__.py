"""Speculative decoding: drafters propose tokens, the engine's verify step checks them in one call.

* :mod:`.config`: :class:`SpeculativeConfig` and the ``"ngram[:k]"`` / ``"draft[:k]"`` spellings;
* :mod:`.drafters`: the drafters (n-gram prompt lookup, an explicit prediction, a draft model), each
  with ``propose(generated, k)`` and nothing else, and :class:`RowDrafting`, one request's adaptive
  draft length and its drafted/accepted counts;
* :mod:`.draft_model`: a second kvforge artifact proposing greedily on its own cache;
* :mod:`.setup`: the load-time artifact check and each request's drafter;
* :mod:`.verify`: the batch loop's verify step (per-row drafts in one engine call, the acceptance
  rule, the rows shortened back after a rejection);
* :mod:`.states`: a hybrid artifact's rows keep the state of their accepted tokens after verify.

None of these imports the engine; the batch loop hands them what they need.
"""

from kvforge.runtime.speculative import setup
from kvforge.runtime.speculative.config import SpeculativeConfig, parse_speculative
from kvforge.runtime.speculative.drafters import NgramDrafter, PredictionDrafter, RowDrafting

__all__ = ["NgramDrafter", "PredictionDrafter", "RowDrafting", "SpeculativeConfig", "parse_speculative", "setup"]
