"""PUBLIC (instruction, code) pairs from the standard library outside the private modules.
Design notes: docs/methods.md, "data/public.py".

For methods that need public data next to the private corpus: PrivCode++'s alignment
negatives (never other private records of the batch) and ``pc-preemb``'s PrivLC pretraining.
Built like the demo corpus' ordinary records (:mod:`privcode.data.demo`), but only from
:func:`~privcode.data.stdlib.public_source_files` (the base model's pretraining modules, where
no private record comes from); deterministic given ``seed`` and the standard library.
"""

from __future__ import annotations

import random
from functools import lru_cache

from privcode.data.stdlib import public_source_files, stdlib_dir

__all__ = ["public_pairs", "public_prompts"]


@lru_cache(maxsize=8)
def _pairs(limit: int, seed: int, max_record_bytes: int) -> tuple[tuple[str, str], ...]:
    from privcode.data.demo import _file_candidates, make_prompt

    root = stdlib_dir()
    files = public_source_files()
    random.Random(seed).shuffle(files)
    rng = random.Random(seed + 1)
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    for path in files:
        for cand in _file_candidates(path, root, max_record_bytes):
            if cand.code in seen:
                continue
            seen.add(cand.code)
            out.append((make_prompt(cand, rng), cand.code))
            if len(out) >= limit:
                return tuple(out)
    return tuple(out)


def public_pairs(limit: int, seed: int = 0, max_record_bytes: int = 2048) -> list[tuple[str, str]]:
    """Up to ``limit`` public ``(prompt, code)`` pairs (fewer only if the stdlib runs out)."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    return list(_pairs(int(limit), int(seed), int(max_record_bytes)))


def public_prompts(limit: int, seed: int = 0) -> list[str]:
    """The prompts of :func:`public_pairs`: the negative bank of the alignment loss."""
    return [p for p, _ in public_pairs(limit, seed)]
