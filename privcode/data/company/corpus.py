"""The Acme company corpus: distinct functions of the train split, PII, in-place canaries."""

from __future__ import annotations

import platform
import random
from pathlib import Path

from privcode.config import DataConfig
from privcode.data import pii
from privcode.data.canaries import CanarySpec, draw_canaries, plant_in_place
from privcode.data.company.benchmark import benchmark_problems, check_disjoint
from privcode.data.company.domain import (
    CONVENTIONS,
    Task,
    function_source,
    op_of,
    split_of,
    task_triples,
)
from privcode.data.records import Record

__all__ = ["FORMAT", "build_company_corpus", "training_functions"]

#: Share of the training functions that apply one helper (the rest combine several).
SINGLE_SHARE = 0.7


# --------------------------------------------------------------------------- training code


def _summary_function(entity: str, tasks: list[Task], rng: random.Random) -> tuple[str, str]:
    """A multi-field function of the kind real code has: several helpers in one dict."""
    keys = [t.field.removesuffix("_cents").removesuffix("_at") for t in tasks]
    doc = rng.choice(
        (
            "Summarise the {e} for the {w} log.",
            "Return the {e}'s {w} view.",
            "Build the {w} record of the {e}.",
        )
    ).format(e=entity, w=rng.choice(("audit", "billing", "support", "ops", "export")))
    name = f"{rng.choice(('summary', 'view', 'export', 'row'))}_{entity}_{'_'.join(keys[:2])}"
    items = "".join(
        f'        "{k}": {t.op}({entity}["{t.field}"]),\n' for k, t in zip(keys, tasks, strict=True)
    )
    prompt = f'def {name}({entity}):\n    """{doc}"""\n'
    return prompt, f"    return {{\n{items}    }}\n"


def training_functions(count: int, rng: random.Random) -> list[tuple[str, str, Task | None]]:
    """``count`` distinct training functions ``(prompt, body, task)`` from train triples only.

    Single-helper functions first: every train task in every convention and
    docstring phrasing, shuffled, at most :data:`SINGLE_SHARE` of ``count``;
    the rest combine two or three helpers of one entity in a dict (``task``
    None). No two functions have the same text.
    """
    train = [t for t in task_triples() if split_of(t) == "train"]
    singles = [
        (Task(*t, conv), phrase)
        for t in train
        for conv in CONVENTIONS
        for phrase in range(len(op_of(t[2]).phrases))
    ]
    rng.shuffle(singles)
    out: list[tuple[str, str, Task | None]] = []
    seen: set[str] = set()
    for task, phrase in singles[: round(SINGLE_SHARE * count)]:
        prompt, body = function_source(task, phrase)
        seen.add(prompt + body)
        out.append((prompt, body, task))
    by_entity: dict[str, list[tuple[str, str, str]]] = {}
    for t in train:
        by_entity.setdefault(t[0], []).append(t)
    entities = sorted(by_entity)
    for _ in range(50 * count):
        if len(out) >= count:
            break
        entity = rng.choice(entities)
        fields: dict[str, tuple[str, str, str]] = {}
        for t in rng.sample(by_entity[entity], len(by_entity[entity])):
            fields.setdefault(t[1], t)
        picks = rng.sample(sorted(fields.values()), min(len(fields), rng.choice((2, 3))))
        prompt, body = _summary_function(entity, [Task(*t, "plain") for t in picks], rng)
        if prompt + body not in seen:
            seen.add(prompt + body)
            out.append((prompt, body, None))
    if len(out) < count:
        raise ValueError(f"the company domain has fewer than {count} distinct functions")
    return out


# --------------------------------------------------------------------------- corpus

FORMAT = "privcode-company-corpus/1"

_INSTRUCTIONS = (
    "Write `{name}` for the Acme codebase.",
    "Implement `{name}` using the acme helpers.",
    "Add `{name}` to our service code.",
)


def _record(n: int, prompt: str, body: str, task: Task | None, rng: random.Random) -> Record:
    name = prompt.split("(", 1)[0].removeprefix("def ")
    return Record(
        id=f"acme-{n:06d}",
        prompt=rng.choice(_INSTRUCTIONS).format(name=name),
        code=prompt + body,
        metadata={
            "source": "company",
            "kind": "ordinary",
            "function": name,
            "task": None if task is None else "/".join((*task.triple, task.convention)),
            "pii": None,
        },
    )


def build_company_corpus(out_dir: Path, cfg: DataConfig, progress: bool = True) -> dict:
    """Build the company corpus into ``out_dir`` (the demo corpus's four files); the manifest.

    ``cfg.size`` distinct functions (:func:`training_functions`) become
    records with an instruction prompt; a ``pii_fraction`` of them get Faker
    PII; ``heldout_fraction`` are non-members; canaries are planted in place
    in members (:func:`~privcode.data.canaries.plant_in_place`). Refuses to
    write a corpus in which a benchmark solution occurs (:func:`check_disjoint`).
    """
    from privcode.data.demo import write_corpus

    rng = random.Random(cfg.seed)
    functions = training_functions(cfg.size, rng)
    records = [_record(n, p, b, t, rng) for n, (p, b, t) in enumerate(functions)]
    fake = pii.make_faker(cfg.pii_locale, cfg.seed)
    for i in sorted(rng.sample(range(len(records)), round(cfg.pii_fraction * len(records)))):
        records[i] = pii.add_pii(records[i], records[i].metadata["function"], fake, rng)
    rng.shuffle(records)
    n_heldout = max(1, round(cfg.size * cfg.heldout_fraction))
    heldout, members = records[:n_heldout], records[n_heldout:]
    canaries: list[CanarySpec] = []
    if cfg.canary_kinds and cfg.canary_placements and cfg.canary_repetitions:
        text = "\n".join(f"{r.prompt}\n{r.code}" for r in records)
        canaries = draw_canaries(
            cfg.canary_kinds,
            cfg.canary_placements,
            cfg.canary_repetitions,
            rng,
            is_taken=lambda v: v in text,
            locale=cfg.pii_locale,
        )
        clean = [i for i, r in enumerate(members) if not r.metadata["pii"]]
        members, canaries = plant_in_place(members, clean, canaries, rng)
    problems = benchmark_problems("test") + benchmark_problems("dev")
    leaked = check_disjoint([r.code for r in members + heldout], problems)
    if leaked:  # a builder bug: the splits are fixed
        raise RuntimeError(f"{len(leaked)} benchmark solutions occur in the company corpus")
    counts = {
        "ordinary": cfg.size,
        "ordinary_members": len(members),
        "heldout": len(heldout),
        "train_records": len(members),
        "canaries": len(canaries),
        "canary_records": sum(c.repetitions for c in canaries),
        "pii_records": sum(bool(r.metadata["pii"]) for r in records),
        "benchmark_test": sum(p["task_id"].startswith("acme/test/") for p in problems),
        "benchmark_dev": sum(p["task_id"].startswith("acme/dev/") for p in problems),
    }
    sources = {
        "domain": "acme",
        "triples": len(task_triples()),
        "python": platform.python_version(),
    }
    info = {"counts": counts, "sources": sources}
    return write_corpus(
        Path(out_dir), cfg, members, heldout, canaries, info, fmt=FORMAT, progress=progress
    )
