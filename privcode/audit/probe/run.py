"""``run_probe``: the whole leak-probing pipeline of seed 003 against one audited model.
Design notes: docs/audits.md, "privcode/audit/probe/run.py".

Per round: questions ``T(s, a)`` -> the code prompt's privacy-handling functions ``G(c)`` (a
stub when none) -> ``n_tests`` test-generation responses per function -> ExtractPII -> judge
-> verification (1 <= hits <= 100 records) -> confirmed leaks (*confirmed* = judged and
verified; no human review) -> a library update used by the next round's prompts. Metrics:
LP-L / IL-L over all rounds' responses (:mod:`privcode.audit.probe.metrics`); settings:
:class:`~privcode.audit.probe.options.ProbeOptions`; the steps are ``_Prober``'s methods.

PRIVACY: the returned summary (also ``probe_summary.json``) holds counts, rates, settings and
file paths only. Confirmed leaks (values, contexts, record ids) go to ``probe_leaks.json`` and
the updated library to ``feature_library.yaml``, both mode 0600 in ``out_dir``: the caller puts
``out_dir`` inside the run directory. All files are written atomically.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from privcode.audit.probe.backends import Backend
from privcode.audit.probe.extract import Candidate, extract_pii
from privcode.audit.probe.judge import REASONS, judge_candidate
from privcode.audit.probe.library import FeatureLibrary, Hint
from privcode.audit.probe.metrics import (
    IL_LEVELS,
    LP_LEVELS,
    LeakElement,
    ResponseLeaks,
    leakage_metrics,
)
from privcode.audit.probe.options import ProbeError, ProbeOptions
from privcode.audit.probe.questions import (
    Function,
    Question,
    build_questions,
    code_prompt,
    is_refusal,
    select_functions,
    test_prompt,
)
from privcode.audit.probe.taxonomy import ATTRIBUTES, CATEGORIES
from privcode.audit.probe.update import Leak, load_scorer, update_library
from privcode.audit.probe.verify import ReferenceIndex
from privcode.utils import atomic_write_json

log = logging.getLogger("privcode.audit.probe")

__all__ = ["DETAILS_FILE", "LIBRARY_FILE", "SUMMARY_FILE", "run_probe"]

DETAILS_FILE = "probe_leaks.json"
LIBRARY_FILE = "feature_library.yaml"
SUMMARY_FILE = "probe_summary.json"

#: Offsets the seed by round (and by step within a round: +0 questions, +1 code, +2 tests).
ROUND_STRIDE = 7919

LLMJudgeFn = Callable[[list[Candidate]], list[bool]]


def run_probe(
    backend: Backend,
    reference_records: Sequence | ReferenceIndex,
    *,
    out_dir: str | Path,
    options: ProbeOptions | None = None,
    public_model: Any = None,
    library: FeatureLibrary | None = None,
    question_backend: Backend | None = None,
    llm_judge: LLMJudgeFn | None = None,
    **settings: Any,
) -> dict[str, Any]:
    """Probe ``backend`` for leaks of ``reference_records``; return the counts-only summary.

    ``options``: the settings (:class:`ProbeOptions`); ``settings``: its fields as
    keywords (``n_questions=2``, ...), applied over ``options``.
    ``public_model``: a model path / preset for the pseudo-NLL scorer, a
    scorer object, or None (span fallback); see :mod:`privcode.audit.probe.update`.
    ``library``: the starting library (default: the prior-knowledge file).
    ``llm_judge``: a callable ``list[Candidate] -> list[bool]`` applied after
    the deterministic judge (e.g. :class:`~privcode.audit.probe.judge.LLMJudge`).
    """
    started = time.time()
    opts = ProbeOptions.of(options, **settings)
    index = (
        reference_records
        if isinstance(reference_records, ReferenceIndex)
        else ReferenceIndex.from_records(reference_records, hit_range=opts.hit_range)
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prober = _Prober(
        backend,
        index,
        (library or FeatureLibrary.prior()).copy(),
        opts,
        question_backend=question_backend,
        llm_judge=llm_judge,
        public_model=public_model,
    )
    initial_library = prober.library.counts()
    for rnd in range(opts.rounds):
        prober.run_round(rnd)
    files = _write_private(out, prober)
    summary = {
        **_summary(prober, initial_library),
        "files": {**files, "summary": str(out / SUMMARY_FILE)},
        "seconds": round(time.time() - started, 2),
    }
    atomic_write_json(out / SUMMARY_FILE, summary)
    return summary


class _Job(NamedTuple):
    """One test-generation prompt: the question, the model's function and the library hint."""

    question: Question
    function: Function
    hint: Hint


@dataclass
class _Tally:
    """What the rounds count; only ``details`` (the confirmed leaks) holds private values."""

    responses: list[ResponseLeaks] = field(default_factory=list)
    details: list[dict[str, Any]] = field(default_factory=list)
    asked: defaultdict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    found: defaultdict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    distinct: defaultdict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    rejections: Counter = field(default_factory=Counter)
    verification: Counter = field(default_factory=Counter)
    code: Counter = field(default_factory=Counter)
    updates: list[dict[str, Any]] = field(default_factory=list)


class _Prober:
    """The rounds of one probe: questions -> functions -> tests -> judged, verified leaks."""

    def __init__(
        self,
        backend: Backend,
        index: ReferenceIndex,
        library: FeatureLibrary,
        opts: ProbeOptions,
        question_backend: Backend | None,
        llm_judge: LLMJudgeFn | None,
        public_model: Any,
    ) -> None:
        self.backend, self.index, self.library, self.opts = backend, index, library, opts
        self.question_backend, self.llm_judge = question_backend, llm_judge
        self.public_model, self.scorer = public_model, None
        self.rng = random.Random(opts.seed)
        self.tally = _Tally()
        self.verified: dict[tuple[str, str], Any] = {}

    def run_round(self, rnd: int) -> None:
        questions = self._questions(rnd)
        jobs = self._functions(questions, rnd)
        texts = self.backend.complete(
            [test_prompt(j.function, j.hint.text, self.opts.cases) for j in jobs],
            max_tokens=self.opts.test_max_tokens,
            temperature=self.opts.temperature,
            n=self.opts.n_tests,
            seed=self.opts.seed + ROUND_STRIDE * rnd + 2,
        )
        leaks: list[Leak] = []
        for job_no, (job, samples) in enumerate(zip(jobs, texts, strict=True)):
            for sample_no, text in enumerate(samples):
                leaks += self._response(job, text, where=(rnd, job_no, sample_no))
        log.info(
            "leak probe round %d/%d: %d questions, %d responses so far, %d confirmed "
            "instances so far",
            rnd + 1,
            self.opts.rounds,
            len(questions),
            len(self.tally.responses),
            len(self.tally.details),
        )
        if self.opts.update and leaks:
            self._update_library(rnd, leaks)

    def _questions(self, rnd: int) -> list[Question]:
        """Step 1: ``T(s, a)`` for the selected scenarios x attributes."""
        opts = self.opts
        scenarios, attributes = opts.scenarios or (), opts.attributes or ()  # resolved: never None
        questions = build_questions(
            scenarios,
            attributes,
            opts.n_questions,
            self.rng,
            question_backend=self.question_backend,
            prefix=f"r{rnd}",
            seed=opts.seed + ROUND_STRIDE * rnd,
        )
        if not questions:
            raise ProbeError(
                "no (scenario, attribute) pair selected: none of the attributes "
                f"{', '.join(attributes)} occurs in scenarios {', '.join(scenarios)}"
            )
        return questions

    def _functions(self, questions: list[Question], rnd: int) -> list[_Job]:
        """Step 2: the model answers each code prompt; ``G(c)`` (or a stub) with a hint each."""
        answers = self.backend.complete(
            [code_prompt(q) for q in questions],
            max_tokens=self.opts.code_max_tokens,
            temperature=self.opts.temperature,
            n=1,
            seed=self.opts.seed + ROUND_STRIDE * rnd + 1,
        )
        code, jobs = self.tally.code, []
        for q, (answer,) in zip(questions, answers, strict=True):
            code["answers"] += 1
            code["refused"] += is_refusal(answer)
            functions = select_functions(answer, q, self.opts.max_functions)
            code["fallback_stub"] += functions[0].fallback
            code["functions"] += 0 if functions[0].fallback else len(functions)
            jobs += [_Job(q, g, self.library.hint(q.attribute, self.rng)) for g in functions]
        return jobs

    def _response(self, job: _Job, text: str, where: tuple[int, int, int]) -> list[Leak]:
        """Steps 3-4 for one test response: extract, judge, verify; its confirmed leaks."""
        q = job.question
        stats = self.tally.asked[q.attribute]
        stats["responses"] += 1
        if is_refusal(text):
            self.tally.responses.append(ResponseLeaks(q.category))
            return []
        stats["accepted"] += 1
        elements, leaks = [], []
        for c in self._judged(job, text):
            element = self._confirm(c, job, where)
            if element is not None:
                elements.append(element)
                leaks.append(Leak(c.attribute, c.value, c.context))
        self.tally.responses.append(ResponseLeaks(q.category, tuple(elements)))
        return leaks

    def _judged(self, job: _Job, text: str) -> list[Candidate]:
        """The candidates of ``text`` the judge (and the optional LLM judge) keep."""
        tally, echo_text = self.tally, f"{job.question.text}\n{job.hint.text}"
        judged = []
        for c in extract_pii(text, [job.function.sig]):
            tally.found[c.attribute]["candidates"] += 1
            verdict = judge_candidate(c, library=self.library, prompt_text=echo_text)
            tally.rejections[verdict.reason] += 1
            if verdict.ok:
                judged.append(c)
        if judged and self.llm_judge is not None:
            keep = self.llm_judge(judged)
            tally.rejections["llm_judge"] += sum(not k for k in keep)
            tally.rejections["ok"] -= sum(not k for k in keep)
            judged = [c for c, k in zip(judged, keep, strict=True) if k]
        return judged

    def _confirm(self, c: Candidate, job: _Job, where: tuple[int, int, int]) -> LeakElement | None:
        """Verify a judged candidate against the reference corpus; record it if confirmed."""
        tally = self.tally
        tally.found[c.attribute]["judged"] += 1
        key = (c.attribute, c.value)
        if key not in self.verified:
            self.verified[key] = self.index.verify(c.value, c.attribute)
        v = self.verified[key]
        lo = self.index.hit_range[0]
        tally.verification[
            "in_range" if v.ok else ("not_found" if v.hits < lo else "too_common")
        ] += 1
        if not v.ok:
            return None
        tally.found[c.attribute]["confirmed"] += 1
        tally.distinct[c.attribute].add(c.value)
        tally.details.append(_detail(c, job, where, v))
        return LeakElement(c.attribute, c.value, frozenset(v.record_ids))

    def _update_library(self, rnd: int, leaks: list[Leak]) -> None:
        """Step 5: the round's confirmed leaks update the feature library."""
        if self.scorer is None:
            pm = self.public_model
            self.scorer = (
                pm
                if hasattr(pm, "score")
                else load_scorer(pm, device=self.opts.device, dtype=self.opts.dtype)
            )
        upd = update_library(
            self.library, leaks, self.scorer, eps=self.opts.eps, min_samples=self.opts.min_samples
        )
        self.tally.updates.append({"round": rnd, **upd})


def _detail(c: Candidate, job: _Job, where: tuple[int, int, int], v: Any) -> dict[str, Any]:
    """One confirmed leak as written to ``probe_leaks.json`` (PRIVATE: holds the value)."""
    rnd, job_no, sample_no = where
    q = job.question
    return {
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


def _funnel(tally: _Tally, attributes: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per attribute: responses asked -> accepted -> candidates -> judged -> confirmed."""
    funnel = {}
    # The attributes asked about first, then leaks of attributes that were not asked for.
    for a in [*attributes, *(a for a in tally.found if a not in attributes)]:
        if a not in tally.asked and a not in tally.found:
            continue  # not asked in the selected scenarios, never extracted
        q, c = tally.asked.get(a, Counter()), tally.found.get(a, Counter())
        funnel[a] = {
            "category": ATTRIBUTES[a].category,
            "responses": q["responses"],
            "accepted": q["accepted"],
            "candidates": c["candidates"],
            "judged": c["judged"],
            "confirmed": c["confirmed"],
            "distinct_confirmed": len(tally.distinct.get(a, ())),
        }
    return funnel


def _settings(prober: _Prober) -> dict[str, Any]:
    """The summary's ``settings``: the options as run (the index's hit range), no placement."""
    o = prober.opts
    return {
        "scenarios": list(o.scenarios or ()),
        "attributes": list(o.attributes or ()),
        "n_questions": o.n_questions,
        "rounds": o.rounds,
        "n_tests": o.n_tests,
        "cases": o.cases,
        "max_functions": o.max_functions,
        "seed": o.seed,
        "temperature": o.temperature,
        "hit_range": list(prober.index.hit_range),
        "code_max_tokens": o.code_max_tokens,
        "test_max_tokens": o.test_max_tokens,
        "update": o.update,
        "eps": o.eps,
        "min_samples": o.min_samples,
        "llm_judge": prober.llm_judge is not None,
        "question_model": prober.question_backend is not None,
    }


def _summary(prober: _Prober, initial_library: dict[str, Any]) -> dict[str, Any]:
    """The counts-only summary (no value, context or record id)."""
    t = prober.tally
    total = len(t.responses)
    accepted = sum(c["accepted"] for c in t.asked.values())
    by_cat = {
        cat: sum(len(v) for a, v in t.distinct.items() if ATTRIBUTES[a].category == cat)
        for cat in CATEGORIES
    }
    return {
        "backend": prober.backend.describe(),
        "settings": _settings(prober),
        "reference_records": len(prober.index),
        "code_answers": dict(t.code),
        "responses": total,
        "accepted": accepted,
        "refusal_rate": None if total == 0 else round(1 - accepted / total, 6),
        "funnel": _funnel(t, prober.opts.attributes or ()),
        "judge": {r: t.rejections.get(r, 0) for r in REASONS},
        "verification": {
            k: t.verification.get(k, 0) for k in ("in_range", "not_found", "too_common")
        },
        "confirmed": {
            "instances": len(t.details),
            "distinct": sum(len(v) for v in t.distinct.values()),
            "distinct_per_category": by_cat,
        },
        "metrics": leakage_metrics(t.responses, lp_levels=LP_LEVELS, il_levels=IL_LEVELS),
        "library": {
            "initial": initial_library,
            "final": prober.library.counts(),
            "updates": t.updates,
        },
    }


def _write_private(out: Path, prober: _Prober) -> dict[str, str]:
    """The confirmed leaks and the updated library, both mode 0600; their paths."""
    details_path, library_path = out / DETAILS_FILE, out / LIBRARY_FILE
    atomic_write_json(
        details_path,
        {
            "note": "PRIVATE: confirmed leaks of private values; keep inside the run directory",
            "leaks": prober.tally.details,
        },
    )
    details_path.chmod(0o600)
    prober.library.save(library_path)
    return {"details": str(details_path), "library": str(library_path)}
