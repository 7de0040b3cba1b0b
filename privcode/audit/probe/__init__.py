"""Leak probing by test generation (seed 003): ``privcode audit probe``.

scenarios x privacy attributes (Table 1) -> code-generation questions -> the audited model
writes a function, then unit tests with realistic inputs guided by the privacy feature library
-> PII extraction -> judge -> verification against the reference corpus (1 <= hits <= 100)
-> confirmed leaks -> LP-L / IL-L per category and a library update (pseudo-NLL + DBSCAN).

Modules: :mod:`~.taxonomy`, :mod:`~.library` (+ ``prior_knowledge.yaml``),
:mod:`~.questions`, :mod:`~.backends`, :mod:`~.extract` (with
:mod:`~.attribute_keys`), :mod:`~.judge`, :mod:`~.verify`, :mod:`~.metrics`,
:mod:`~.update`, :mod:`~.options`, :mod:`~.run`, :mod:`~.cli`.
Names are re-exported lazily: importing this package (e.g. for the CLI
parser) imports nothing heavy. Design notes: docs/audits.md, "Leak probing internals".
"""

from __future__ import annotations

from privcode.utils import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "backends": (
            "Backend BackendError HFBackend InvalidRequestError OpenAIBackend ScriptedBackend "
            "make_backend"
        ),
        "extract": "Candidate FunctionSig extract_pii",
        "judge": "LLMJudge judge_candidate",
        "library": "FeatureLibrary",
        "metrics": "LeakElement ResponseLeaks leakage_metrics",
        "options": "ProbeError ProbeOptions",
        "run": "run_probe",
        "taxonomy": "ATTRIBUTES CATEGORIES SCENARIOS",
        "verify": "ReferenceIndex",
    },
)
