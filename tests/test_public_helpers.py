"""The public helper-pattern functions the base is tuned on hold nothing of Acme's."""

from __future__ import annotations

import re

from privcode.data.company import benchmark_problems, check_disjoint
from privcode.data.company.domain import ENTITY_NAMES as ACME_ENTITIES
from privcode.data.helpers import ENTITY_NAMES, helper_functions, helper_pairs


def test_public_dialect_names_none_of_acme():
    pairs = helper_pairs(4000)
    assert len({code for _, code in pairs}) == 4000
    text = "\n".join(i + "\n" + c for i, c in pairs)
    assert "acme" not in text.lower()
    params = set(re.findall(r"^def \w+\((\w+)\):", text, re.M))
    assert params <= set(ENTITY_NAMES) and not params & set(ACME_ENTITIES)
    assert "tools.cash.format(" in text and "raise tools.Absent(" in text


def test_no_benchmark_solution_in_public_functions():
    codes = [head + body for head, body in helper_functions(4872)]
    problems = benchmark_problems("test") + benchmark_problems("dev")
    assert check_disjoint(codes, problems) == []


def test_deterministic_and_bounded():
    assert helper_pairs(50, seed=3) == helper_pairs(50, seed=3)
    assert helper_pairs(50, seed=3) != helper_pairs(50, seed=4)
    try:
        helper_functions(10**6)
    except ValueError as exc:
        assert "4872" in str(exc)
    else:
        raise AssertionError("expected a ValueError")
