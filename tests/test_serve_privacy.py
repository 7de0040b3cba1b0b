"""Issue 43, point 10: `GET /v1/privacy` shows each key its own figures, and every key the
deployment's live totals only coarsely (no key can follow another's usage by difference).

A real curator behind the real FastAPI app; no model (``/v1/privacy`` reads the curator only),
so the private tokens are charged through the curator's own step with votes that disagree.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from serve_support import TEST_KEY, asgi_call, limits

from privcode.serve.ensemble import PacService, build_api, new_curator, parse_args
from privcode.serve.pac_service import TOTAL_STEPS

M = 4
OTHER = "other-client-key-0123456789abcdef012"
DISAGREE = np.array([0, 1, 0, 1])  # a non-unanimous vote: one private token


@pytest.fixture
def svc(tmp_path):
    cfg = parse_args({"worlds": "/unused", "max_sessions": 40})
    curator = new_curator(cfg, M, state_dir=tmp_path, rng_seed=0)
    service = PacService(SimpleNamespace(m=M), curator, cfg)
    service.api = build_api(service, limits(TEST_KEY, other=OTHER))
    yield service
    service.close()


def _privacy(svc, key):
    status, body, _ = asgi_call(svc.api, "GET", "/v1/privacy", key=key)
    assert status == 200, body
    return body


def _spend(svc, sid, tokens):
    for _ in range(tokens):
        assert svc.curator.step(sid, DISAGREE).kind == "private"


def test_each_key_sees_its_own_figures_and_only_coarse_totals(svc):
    b, budget = svc.curator.b, svc.curator.deployment_budget
    step_nats = budget / TOTAL_STEPS
    step_tokens = math.ceil(step_nats / b)
    status, opened, _ = asgi_call(svc.api, "POST", "/v1/sessions", key=TEST_KEY)
    assert status == 200
    _spend(svc, opened["id"], 3)

    mine = _privacy(svc, TEST_KEY)
    assert (mine["key_charged_nats"], mine["key_private_tokens"]) == (3 * b, 3)
    assert mine["key_sessions_open"] == 1
    assert mine["key_remaining_nats"] == pytest.approx(svc.curator.owner_budget - 3 * b)
    theirs = _privacy(svc, OTHER)
    assert (theirs["key_charged_nats"], theirs["key_private_tokens"]) == (0.0, 0)
    assert theirs["key_sessions_open"] == 0
    assert theirs["key_remaining_nats"] == svc.curator.owner_budget

    # The totals every key sees: rounded up to steps, not the exact 3 tokens and 1 session.
    assert theirs["totals_step"] == {
        "nats": step_nats,
        "private_tokens": step_tokens,
        "sessions": 4,
    }
    assert theirs["deployment_charged_nats"] == step_nats > 3 * b
    assert theirs["private_tokens"] == step_tokens and theirs["sessions_open"] == 4
    assert theirs["deployment_remaining_nats"] == pytest.approx(budget - step_nats)
    # The bound is taken at the rounded-up charge: still an upper bound.
    assert theirs["bounds"]["current"]["mutual_information_nats"] == step_nats

    # More spending inside the same step changes nothing another key can see.
    before = {k: v for k, v in theirs.items() if not k.startswith("key_")}
    _spend(svc, opened["id"], 5)
    after = _privacy(svc, OTHER)
    assert {k: v for k, v in after.items() if not k.startswith("key_")} == before
    assert svc.curator.deployment_info()["deployment_charged"] == 8 * b  # the exact total moved
    assert _privacy(svc, TEST_KEY)["key_private_tokens"] == 8


def test_totals_never_understate_the_charge_nor_overstate_what_is_left(svc):
    from privcode.serve.pac_service import coarse_totals

    info = {"deployment_budget": 1.0, "b": 0.001, "private_tokens": 0, "sessions_open": 0}
    for charged in (0.0, 0.001, 0.01, 0.0100001, 0.5, 0.999, 1.0):
        totals = coarse_totals({**info, "deployment_charged": charged}, max_sessions=64)
        assert charged <= totals["deployment_charged_nats"] <= min(charged + 0.01, 1.0) + 1e-12
        assert totals["deployment_remaining_nats"] <= 1.0 - charged + 1e-12
    assert coarse_totals({**info, "deployment_charged": 0.0}, 64)["deployment_charged_nats"] == 0
