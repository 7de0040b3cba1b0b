"""Evaluation and privacy audits (docs/audits.md).

* :mod:`privcode.audit.scoring`: model log-likelihoods and per-record losses
  for any model the pipeline produces (plain model, adapter, premium or DP
  junior release), in the format each was trained on;
* :mod:`privcode.audit.canaries`: CanaryLeaks leakage (verbatim canary in a
  sampled continuation of an inducing context);
* :mod:`privcode.audit.exposure`: Carlini et al.'s exposure of each canary;
* :mod:`privcode.audit.mia`: loss-based and reference-calibrated membership
  inference, ROC metrics and the (epsilon, delta)-DP ceiling check.

Names are re-exported lazily (importing this package does not import torch).
"""

from __future__ import annotations

from privcode.utils import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "scoring": (
            "AuditError ScoredModel as_scored load_scored_model record_losses sequence_logprobs"
        ),
        "canaries": (
            "KIND_CONTEXTS canary_leakage inducing_contexts load_canaries "
            "sample_continuations write_private_details"
        ),
        "exposure": "canary_exposure exposure_from_scores extrapolated_exposure",
        "mia": (
            "auc check_against_dp dp_tpr_ceiling mia_metrics pld_tpr_ceiling plot_roc "
            "read_dp_params roc_curve run_mia tpr_at_fpr"
        ),
    },
)
