"""Test prerequisites that CI must not lose to a skip: skip here, fail where required.

A test whose prerequisite is missing (helm, the KubeRay CRDs, the full sandbox) skips
on a developer's machine, but CI sets ``PRIVCODE_REQUIRE_HELM``, ``PRIVCODE_REQUIRE_CRDS``
and ``PRIVCODE_REQUIRE_SANDBOX`` to ``1`` (``.ci/run``): there the same test fails, so a
broken sandbox or a missing tool cannot pass as a row of skips. Its own module so that
conftest.py, chart_support.py and the test modules all import it without a cycle.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

__all__ = ["REQUIRE_CRDS", "REQUIRE_HELM", "REQUIRE_SANDBOX", "require_or_skip"]

REQUIRE_HELM = "PRIVCODE_REQUIRE_HELM"
REQUIRE_CRDS = "PRIVCODE_REQUIRE_CRDS"
REQUIRE_SANDBOX = "PRIVCODE_REQUIRE_SANDBOX"


def require_or_skip(env: str, why: str) -> NoReturn:
    """Skip the test with ``why``; fail it instead when the environment sets ``env=1``."""
    if os.environ.get(env) == "1":
        pytest.fail(f"{why} ({env}=1: required here)", pytrace=False)
    pytest.skip(why)
