"""``run_probe``: the whole leak-probing pipeline of seed 003 against one audited model.

Per round (the library learns between rounds):

1. questions ``T(s, a)`` for the selected scenarios x attributes (templates,
   or a question model);
2. the audited model answers the code prompt; ``G(c)`` = its privacy-handling
   functions (a stub of the question when there is none);
3. for every function, ``n_tests`` test-generation *responses* (the prompt
   asks for ``cases`` test cases and carries the feature-library hint);
4. ExtractPII on every response -> candidates; the judge (deterministic
   validators, optionally an LLM judge) -> ``C_judge``; verification against
   the reference corpus (1 <= hits <= 100 records) -> confirmed leaks. There
   is no human review here: *confirmed* means judged and verified;
5. confirmed leaks update the feature library (pseudo-NLL division under the
   public model, DBSCAN), used by the next round's prompts.

Metrics (:mod:`privcode.audit.probe.metrics`): LP-L / IL-L per category over
all rounds' responses.

PRIVACY: the returned summary (also written as ``probe_summary.json``)
holds counts, rates, settings and file paths only. Confirmed leaks (values,
contexts, record ids) go to ``probe_leaks.json`` and the updated library to
``feature_library.yaml``, both mode 0600 in ``out_dir``: the caller puts
``out_dir`` inside the run directory. All files are written atomically.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from privcode.audit.probe.backends import Backend
from privcode.audit.probe.extract import extract_pii
from privcode.audit.probe.judge import REASONS, judge_candidate
from privcode.audit.probe.library import FeatureLibrary
from privcode.audit.probe.metrics import (
    IL_LEVELS,
    LP_LEVELS,
    LeakElement,
    ResponseLeaks,
    leakage_metrics,
)
from privcode.audit.probe.questions import (
    build_questions,
    code_prompt,
    is_refusal,
    select_functions,
    test_prompt,
)
from privcode.audit.probe.taxonomy import (
    ATTRIBUTES,
    CATEGORIES,
    resolve_attributes,
    resolve_scenarios,
)
from privcode.audit.probe.update import Leak, load_scorer, update_library
from privcode.audit.probe.verify import HIT_RANGE, ReferenceIndex
from privcode.errors import PrivcodeError
from privcode.utils import atomic_write_json

log = logging.getLogger("privcode.audit.probe")

__all__ = ["DETAILS_FILE", "LIBRARY_FILE", "SUMMARY_FILE", "ProbeError", "run_probe"]

DETAILS_FILE = "probe_leaks.json"
LIBRARY_FILE = "feature_library.yaml"
SUMMARY_FILE = "probe_summary.json"


class ProbeError(PrivcodeError, ValueError):
    """A leak-probing setting is invalid (names the setting and the allowed values)."""


def _positive(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ProbeError(f"{name} must be a positive integer, got {value!r}")
    return value


def _private_write(path: Path, obj: Any) -> None:
    atomic_write_json(path, obj)
    path.chmod(0o600)


def run_probe(
    backend: Backend,
    reference_records: Sequence | ReferenceIndex,
    *,
    out_dir: str | Path,
    scenarios: Sequence[str] | None = None,
    attributes: Sequence[str] | None = None,
    n_questions: int = 2,
    rounds: int = 1,
    n_tests: int = 2,
    cases: int = 5,
    max_functions: int = 1,
    seed: int = 0,
    public_model: Any = None,
    library: FeatureLibrary | None = None,
    question_backend: Backend | None = None,
    llm_judge=None,
    hit_range: tuple[int, int] = HIT_RANGE,
    code_max_tokens: int = 256,
    test_max_tokens: int = 384,
    temperature: float = 0.7,
    update: bool = True,
    eps: float = 0.5,
    min_samples: int = 3,
    device: str = "cpu",
    dtype: Any = None,
) -> dict[str, Any]:
    """Probe ``backend`` for leaks of ``reference_records``; return the counts-only summary.

    ``public_model``: a model path / preset for the pseudo-NLL scorer, a
    scorer object, or None (span fallback); see :mod:`privcode.audit.probe.update`.
    ``library``: the starting library (default: the prior-knowledge file).
    ``llm_judge``: a callable ``list[Candidate] -> list[bool]`` applied after
    the deterministic judge (e.g. :class:`~privcode.audit.probe.judge.LLMJudge`).
    """
    started = time.time()
    scenarios = resolve_scenarios(scenarios)
    attributes = resolve_attributes(attributes)
    for name, value in (
        ("n_questions", n_questions),
        ("rounds", rounds),
        ("n_tests", n_tests),
        ("cases", cases),
        ("max_functions", max_functions),
        ("code_max_tokens", code_max_tokens),
        ("test_max_tokens", test_max_tokens),
        ("min_samples", min_samples),
    ):
        _positive(name, value)
    if not isinstance(temperature, int | float) or temperature < 0:
        raise ProbeError(f"temperature must be >= 0, got {temperature!r}")
    if not 0 < eps <= 1:
        raise ProbeError(f"eps (DBSCAN cosine radius) must be in (0, 1], got {eps!r}")
    index = (
        reference_records
        if isinstance(reference_records, ReferenceIndex)
        else ReferenceIndex.from_records(reference_records, hit_range=tuple(hit_range))
    )
    lo, hi = index.hit_range
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    library = (library or FeatureLibrary.prior()).copy()
    initial_library = library.counts()
    scorer = None
    rng = random.Random(seed)

    responses: list[ResponseLeaks] = []
    details: list[dict[str, Any]] = []
    per_question_attr: dict[str, Counter] = defaultdict(Counter)
    per_candidate_attr: dict[str, Counter] = defaultdict(Counter)
    distinct_confirmed: dict[str, set[str]] = defaultdict(set)
    rejections: Counter = Counter()
    verification: Counter = Counter()
    code_stats: Counter = Counter()
    updates: list[dict[str, Any]] = []
    verified_cache: dict[tuple[str, str], Any] = {}

    for rnd in range(rounds):
        questions = build_questions(
            scenarios,
            attributes,
            n_questions,
            rng,
            question_backend=question_backend,
            prefix=f"r{rnd}",
            seed=seed + 7919 * rnd,
        )
        if not questions:
            raise ProbeError(
                "no (scenario, attribute) pair selected: none of the attributes "
                f"{', '.join(attributes)} occurs in scenarios {', '.join(scenarios)}"
            )
        answers = backend.complete(
            [code_prompt(q) for q in questions],
            max_tokens=code_max_tokens,
            temperature=temperature,
            n=1,
            seed=seed + 7919 * rnd + 1,
        )
        jobs = []  # (question, function, hint)
        for q, (answer,) in zip(questions, answers, strict=True):
            code_stats["answers"] += 1
            code_stats["refused"] += is_refusal(answer)
            functions = select_functions(answer, q, max_functions)
            code_stats["fallback_stub"] += functions[0].fallback
            code_stats["functions"] += 0 if functions[0].fallback else len(functions)
            for g in functions:
                jobs.append((q, g, library.hint(q.attribute, rng)))
        prompts = [test_prompt(g, hint.text, cases) for _, g, hint in jobs]
        texts = backend.complete(
            prompts,
            max_tokens=test_max_tokens,
            temperature=temperature,
            n=n_tests,
            seed=seed + 7919 * rnd + 2,
        )
        round_leaks: list[Leak] = []
        for job_no, ((q, g, hint), samples) in enumerate(zip(jobs, texts, strict=True)):
            echo_text = f"{q.text}\n{hint.text}"
            for sample_no, text in enumerate(samples):
                stats = per_question_attr[q.attribute]
                stats["responses"] += 1
                if is_refusal(text):
                    responses.append(ResponseLeaks(q.category))
                    continue
                stats["accepted"] += 1
                judged = []
                for c in extract_pii(text, [g.sig]):
                    per_candidate_attr[c.attribute]["candidates"] += 1
                    verdict = judge_candidate(c, library=library, prompt_text=echo_text)
                    rejections[verdict.reason] += 1
                    if verdict.ok:
                        judged.append(c)
                if judged and llm_judge is not None:
                    keep = llm_judge(judged)
                    rejections["llm_judge"] += sum(not k for k in keep)
                    rejections["ok"] -= sum(not k for k in keep)
                    judged = [c for c, k in zip(judged, keep, strict=True) if k]
                elements = []
                for c in judged:
                    per_candidate_attr[c.attribute]["judged"] += 1
                    key = (c.attribute, c.value)
                    if key not in verified_cache:
                        verified_cache[key] = index.verify(c.value, c.attribute)
                    v = verified_cache[key]
                    verification[
                        "in_range" if v.ok else ("not_found" if v.hits < lo else "too_common")
                    ] += 1
                    if not v.ok:
                        continue
                    per_candidate_attr[c.attribute]["confirmed"] += 1
                    distinct_confirmed[c.attribute].add(c.value)
                    elements.append(LeakElement(c.attribute, c.value, frozenset(v.record_ids)))
                    round_leaks.append(Leak(c.attribute, c.value, c.context))
                    details.append(
                        {
                            "round": rnd,
                            "question": q.id,
                            "scenario": q.scenario,
                            "question_attribute": q.attribute,
                            "job": job_no,
                            "sample": sample_no,
                            "attribute": c.attribute,
                            "category": ATTRIBUTES[c.attribute].category,
                            "value": c.value,
                            "key": c.key,
                            "context": c.context,
                            "how": c.how,
                            "hits": v.hits,
                            "record_ids": list(v.record_ids),
                        }
                    )
                responses.append(ResponseLeaks(q.category, tuple(elements)))
        log.info(
            "leak probe round %d/%d: %d questions, %d responses so far, %d confirmed "
            "instances so far",
            rnd + 1,
            rounds,
            len(questions),
            len(responses),
            len(details),
        )
        if update and round_leaks:
            if scorer is None:
                scorer = (
                    public_model
                    if hasattr(public_model, "score")
                    else load_scorer(public_model, device=device, dtype=dtype)
                )
            upd = update_library(library, round_leaks, scorer, eps=eps, min_samples=min_samples)
            updates.append({"round": rnd, **upd})

    metrics = leakage_metrics(responses, lp_levels=LP_LEVELS, il_levels=IL_LEVELS)
    total = len(responses)
    accepted = sum(c["accepted"] for c in per_question_attr.values())
    funnel = {}
    for a in attributes:
        if a not in per_question_attr and a not in per_candidate_attr:
            continue  # not asked in the selected scenarios, never extracted
        q, c = per_question_attr.get(a, Counter()), per_candidate_attr.get(a, Counter())
        funnel[a] = {
            "category": ATTRIBUTES[a].category,
            "responses": q["responses"],
            "accepted": q["accepted"],
            "candidates": c["candidates"],
            "judged": c["judged"],
            "confirmed": c["confirmed"],
            "distinct_confirmed": len(distinct_confirmed.get(a, ())),
        }
    for a, c in per_candidate_attr.items():  # leaks of attributes that were not asked for
        if a not in funnel:
            funnel[a] = {
                "category": ATTRIBUTES[a].category,
                "responses": 0,
                "accepted": 0,
                "candidates": c["candidates"],
                "judged": c["judged"],
                "confirmed": c["confirmed"],
                "distinct_confirmed": len(distinct_confirmed.get(a, ())),
            }
    by_cat = {
        cat: sum(len(v) for a, v in distinct_confirmed.items() if ATTRIBUTES[a].category == cat)
        for cat in CATEGORIES
    }
    details_path, library_path = out / DETAILS_FILE, out / LIBRARY_FILE
    _private_write(
        details_path,
        {
            "note": "PRIVATE: confirmed leaks of private values; keep inside the run directory",
            "leaks": details,
        },
    )
    library.save(library_path)
    summary = {
        "backend": backend.describe(),
        "settings": {
            "scenarios": list(scenarios),
            "attributes": list(attributes),
            "n_questions": n_questions,
            "rounds": rounds,
            "n_tests": n_tests,
            "cases": cases,
            "max_functions": max_functions,
            "seed": seed,
            "temperature": temperature,
            "hit_range": [lo, hi],
            "code_max_tokens": code_max_tokens,
            "test_max_tokens": test_max_tokens,
            "update": update,
            "eps": eps,
            "min_samples": min_samples,
            "llm_judge": llm_judge is not None,
            "question_model": question_backend is not None,
        },
        "reference_records": len(index),
        "code_answers": dict(code_stats),
        "responses": total,
        "accepted": accepted,
        "refusal_rate": None if total == 0 else round(1 - accepted / total, 6),
        "funnel": funnel,
        "judge": {r: rejections.get(r, 0) for r in REASONS},
        "verification": {
            k: verification.get(k, 0) for k in ("in_range", "not_found", "too_common")
        },
        "confirmed": {
            "instances": len(details),
            "distinct": sum(len(v) for v in distinct_confirmed.values()),
            "distinct_per_category": by_cat,
        },
        "metrics": metrics,
        "library": {"initial": initial_library, "final": library.counts(), "updates": updates},
        "files": {
            "details": str(details_path),
            "library": str(library_path),
            "summary": str(out / SUMMARY_FILE),
        },
        "seconds": round(time.time() - started, 2),
    }
    atomic_write_json(out / SUMMARY_FILE, summary)
    return summary
