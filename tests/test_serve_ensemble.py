"""The PAC ensemble's Serve app: args, the API core without Ray (sessions, budgets, errors,
auth, accounting), the state lock and restarts, and one real Ray Serve app over HTTP."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import init_store
from serve_support import TEST_KEY, asgi_call, fuzz_openapi, http_json, limits, scrape_metrics

from privcode.errors import LedgerConflictError
from privcode.pac.bounds import mia_success_bound, world_identification_bound
from privcode.privacy.store import default_store
from privcode.serve.ensemble import (
    Ensemble,
    EnsembleError,
    PacService,
    app,
    build_api,
    build_app,
    new_curator,
    parse_args,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

M = 4
B = 2.0**-16
PROMPT = "def add(a, b):\n"
SECRET = "SECRET-PROMPT-9c2e"
KEY = "pac-key-0123456789abcdef0123456789"
#: Names that must never appear in anything the server returns.
HIDDEN = {"secret", "posterior", "posteriors", "realised_world", "votes", "noise"}


@pytest.fixture(scope="module")
def worlds(pac_worlds):
    return pac_worlds


@pytest.fixture(scope="module")
def ensemble(worlds):
    from privcode.pac.ensemble import PacEnsemble

    return PacEnsemble(worlds, device="cpu")


def _service(ensemble, tmp_path, key=TEST_KEY, keys=None, clock=None, **args):
    """A service over ``ensemble`` with a curator in ``tmp_path``, and ``.api``: its FastAPI
    app, ``key`` the client ``default``'s key plus ``keys`` (principal -> key)."""
    cfg = parse_args({"worlds": "/unused", "max_tokens_limit": 32, **args})
    curator = new_curator(cfg, M, state_dir=tmp_path, rng_seed=0)
    if clock is not None:
        curator._clock = clock
    return _with_api(PacService(ensemble, curator, cfg), key, **(keys or {}))


def _with_api(svc, key=TEST_KEY, **keys):
    svc.api = build_api(svc, limits(key, **keys))
    return svc


@pytest.fixture()
def service(ensemble, tmp_path):
    svc = _service(ensemble, tmp_path / "state")
    yield svc
    svc.close()


def _call(svc, method, path, body=None, key=TEST_KEY):
    return asgi_call(svc.api, method, path, body, key=key)


def _keys(obj):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield k
            yield from _keys(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _keys(v)


def _assert_accounting(body, b=B):
    """The privacy object adds up: b per private token, every token counted once."""
    privacy, usage = body["privacy"], body["usage"]
    assert privacy["charged_nats"] == pytest.approx(b * privacy["private_tokens"], rel=1e-12)
    assert usage["completion_tokens"] == (
        privacy["private_tokens"] + privacy["free_tokens"] + privacy["fallback_tokens"]
    )
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert privacy["per_token_budget_nats"] == b
    assert not HIDDEN & set(_keys(body))


# --------------------------------------------------------------------------- args


@pytest.mark.parametrize(
    "args, key",
    [
        ({}, "worlds"),
        ({"worlds": ""}, "worlds"),
        ({"worlds": 3}, "worlds"),
        ({"worlds": "/w", "wrolds": "/w"}, "wrolds"),
        ({"worlds": "/w", "device": "gpu"}, "device"),
        ({"worlds": "/w", "model": ""}, "model"),
        ({"worlds": "/w", "privacy_store": " "}, "privacy_store"),
        ({"worlds": "/w", "top_k": 0}, "top_k"),
        ({"worlds": "/w", "top_k": True}, "top_k"),
        ({"worlds": "/w", "b": 0}, "b"),
        ({"worlds": "/w", "b": "2**-16"}, "b"),
        ({"worlds": "/w", "b": math.inf}, "b"),
        ({"worlds": "/w", "decoder": "beam"}, "decoder"),
        ({"worlds": "/w", "session_budget": -1.0}, "session_budget"),
        ({"worlds": "/w", "session_budget": 2.0**-20}, "session_budget"),  # below b
        ({"worlds": "/w", "session_budget": 1.0}, "session_budget"),  # above the deployment's
        ({"worlds": "/w", "deployment_budget": None}, "deployment_budget"),
        ({"worlds": "/w", "scope": "world"}, "scope"),
        ({"worlds": "/w", "max_tokens_limit": 0}, "max_tokens_limit"),
        ({"worlds": "/w", "api_key_env": "1-BAD"}, "api_key_env"),
        ({"worlds": "/w", "served_model_name": ""}, "served_model_name"),
    ],
)
def test_bad_app_args_name_the_key(args, key):
    with pytest.raises(EnsembleError, match=f"'{key}'"):
        parse_args(args)
    with pytest.raises(EnsembleError, match=f"'{key}'"):
        app(args)


def test_app_args_defaults_one_replica_and_builder():
    from ray import serve

    cfg = parse_args({"worlds": "/w"})
    assert (
        cfg.b,
        cfg.session_budget,
        cfg.deployment_budget,
        cfg.scope,
        cfg.decoder,
        cfg.top_k,
        cfg.device,
        cfg.served_model_name,
    ) == (2.0**-16, 2.0**-10, 2.0**-4, "deployment", "gumbel", 50, "auto", "privcode-pac")
    assert str(parse_args({"worlds": "/w", "privacy_store": "/s"}).store_path) == "/s"
    worlds = "/data/runs/demo/pac/worlds"  # the store never follows the runs' directory
    assert parse_args({"worlds": worlds}).store_path == default_store()
    with pytest.raises(EnsembleError, match="mapping"):
        parse_args(["worlds"])
    assert isinstance(app({"worlds": "/w"}), serve.Application)  # no Ray needed to build
    with pytest.raises(EnsembleError, match="acknowledge_session_scope"):
        parse_args({"worlds": "/w", "scope": "session"})
    assert parse_args({"worlds": "/w", "scope": "session", "acknowledge_session_scope": True})
    assert Ensemble.name == "Ensemble" and Ensemble.num_replicas == 1
    for bad in ({"num_replicas": 2}, {"autoscaling_config": {"max_replicas": 3}}):
        with pytest.raises(EnsembleError, match="one replica"):
            build_app({"worlds": "/w"}, **bad)


# --------------------------------------------------------------------------- API (no Ray)


def test_sessions_lifecycle_and_budgets(service):
    api = service
    status, opened, _ = _call(api, "POST", "/v1/sessions")  # no body: the default budget
    assert status == 200 and opened["object"] == "pac.session"
    assert opened["budget_nats"] == 2.0**-10 and opened["charged_nats"] == 0
    assert opened["remaining_nats"] == 2.0**-10 and opened["scope"] == "deployment"
    small = _call(api, "POST", "/v1/sessions", {"budget_nats": 3 * B})[1]
    assert small["budget_nats"] == 3 * B
    capped = _call(api, "POST", "/v1/sessions", {"budget_nats": 1.0})[1]
    assert capped["budget_nats"] == 2.0**-10  # capped at session_budget
    assert len({opened["id"], small["id"], capped["id"]}) == 3
    status, got, _ = _call(api, "GET", f"/v1/sessions/{small['id']}")
    assert status == 200 and got == small
    assert _call(api, "GET", "/v1/privacy")[1]["key_sessions_open"] == 3
    status, deleted, _ = _call(api, "DELETE", f"/v1/sessions/{small['id']}")
    assert status == 200 and deleted["deleted"] is True and deleted["id"] == small["id"]
    for method in ("GET", "DELETE"):
        status, body, _ = _call(api, method, f"/v1/sessions/{small['id']}")
        assert status == 404 and body["error"]["code"] == "session_not_found"
        assert small["id"] not in body["error"]["message"]  # ids are capabilities: not echoed
    assert _call(api, "GET", "/v1/sessions/nope")[0] == 404
    for bad, param in (
        ({"budget_nats": -1}, "budget_nats"),
        ({"budget_nats": "x"}, "budget_nats"),
        ({"budget_nats": True}, "budget_nats"),
        ({"budget": 1}, "budget"),
        ([1], None),
        (b"{", None),
    ):
        status, body, _ = _call(api, "POST", "/v1/sessions", bad)
        assert status == 400 and body["error"]["param"] == param, bad
    status, _, headers = _call(api, "PUT", "/v1/sessions/x")
    assert status == 405 and "GET" in headers["Allow"]


def test_completions_in_a_session_add_up(service, caplog):
    api = service
    caplog.set_level(logging.INFO)
    sid = _call(api, "POST", "/v1/sessions")[1]["id"]
    bodies = []
    for extra in ({}, {"temperature": 0.8, "seed": -5}):  # greedy, then coupled Gumbel
        status, body, _ = _call(
            api,
            "POST",
            "/v1/completions",
            {"prompt": PROMPT + "# " + SECRET, "max_tokens": 12, "session": sid, **extra},
        )
        assert status == 200, body
        assert body["object"] == "text_completion" and body["model"] == "privcode-pac"
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
        _assert_accounting(body)
        assert body["privacy"]["session"] == sid and not body["privacy"]["one_shot"]
        bodies.append(body)
    assert [b["privacy"]["decoder"] for b in bodies] == ["greedy", "gumbel"]
    first, second = (b["privacy"] for b in bodies)
    assert first["private_tokens"] > 0  # the worlds disagree: the session is charged
    assert second["session_charged_nats"] == pytest.approx(
        first["charged_nats"] + second["charged_nats"], rel=1e-12
    )
    assert second["remaining_nats"] == pytest.approx(2.0**-10 - second["session_charged_nats"])
    info = _call(api, "GET", f"/v1/sessions/{sid}")[1]
    assert info["charged_nats"] == second["session_charged_nats"]
    assert info["private_tokens"] == first["private_tokens"] + second["private_tokens"]
    assert info["free_tokens"] == first["free_tokens"] + second["free_tokens"]
    privacy = _call(api, "GET", "/v1/privacy")[1]
    charged = privacy["deployment_charged_nats"]  # every key's, rounded up to 1% of the budget
    assert privacy["key_charged_nats"] == info["charged_nats"] <= charged == 2.0**-4 / 100
    assert privacy["key_private_tokens"] == info["private_tokens"]
    assert privacy["deployment_remaining_nats"] == pytest.approx(2.0**-4 - charged)
    assert (privacy["m"], privacy["per_token_budget_nats"], privacy["scope"]) == (
        M,
        B,
        "deployment",
    )
    assert privacy["bounds"]["current"] == {
        "mutual_information_nats": charged,
        "membership_inference_success": mia_success_bound(charged),
        "world_identification_success": world_identification_bound(charged, M),
    }
    assert privacy["bounds"]["at_deployment_budget"]["membership_inference_success"] == (
        mia_success_bound(2.0**-4)
    )
    # Nothing secret-dependent leaves the server: no such field, and not the posterior's values.
    posterior = service.curator._posterior
    assert not np.allclose(posterior, 1.0 / M, rtol=0, atol=0)
    text = json.dumps([bodies, info, privacy])
    assert not HIDDEN & set(_keys(privacy)) and not HIDDEN & set(_keys(info))
    assert not [x for x in posterior if repr(float(x)) in text]
    assert SECRET not in caplog.text and sid not in caplog.text  # no prompt, no session id
    assert "pac completion: prompt_tokens=" in caplog.text


def test_one_shot_sessions_and_budgets_that_fail_closed(service):
    api = service
    status, body, _ = _call(api, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 8})
    assert status == 200 and body["privacy"]["session"] is None and body["privacy"]["one_shot"]
    _assert_accounting(body)
    privacy = _call(api, "GET", "/v1/privacy")[1]
    assert privacy["sessions_open"] == privacy["key_sessions_open"] == 0  # one-shot: closed
    assert privacy["key_charged_nats"] == body["privacy"]["charged_nats"]
    # A session that affords 2 private tokens (on_exhausted: error, the default): the
    # completion ends where the budget does, and the next request is refused with a 429.
    sid = _call(api, "POST", "/v1/sessions", {"budget_nats": 2 * B})[1]["id"]
    body = _call(
        api, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 16, "session": sid}
    )[1]
    _assert_accounting(body)
    assert body["privacy"]["private_tokens"] == 2 and body["privacy"]["fallback_tokens"] == 0
    assert body["privacy"]["budget_exhausted"] and not body["privacy"]["public_fallback"]
    assert body["privacy"]["remaining_nats"] == 0
    status, again, headers = _call(
        api, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "session": sid}
    )
    assert status == 429 and again["error"]["code"] == "privacy_budget_exhausted"
    assert "session" in again["error"]["message"]


def test_the_public_fallback_when_configured_is_flagged(ensemble, tmp_path):
    svc = _service(ensemble, tmp_path, on_exhausted="fallback")
    try:
        sid = _call(svc, "POST", "/v1/sessions", {"budget_nats": 2 * B})[1]["id"]
        body = _call(
            svc, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 16, "session": sid}
        )[1]
        _assert_accounting(body)
        assert body["privacy"]["private_tokens"] == 2 and body["privacy"]["fallback_tokens"] > 0
        assert body["privacy"]["public_fallback"] and body["privacy"]["budget_exhausted"]
        again = _call(
            svc, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "session": sid}
        )[1]
        assert again["privacy"]["private_tokens"] == 0 and again["privacy"]["public_fallback"]
    finally:
        svc.close()


OTHER = "other-client-key-0123456789abcdef012"


def test_one_key_cannot_exhaust_the_sessions_and_idle_ones_expire(ensemble, tmp_path):
    """The review's session exhaustion: sessions never expired and one client could hold the
    deployment's every slot (then every new session and one-shot request got 429 forever)."""
    now = [1000.0]
    svc = _service(
        ensemble,
        tmp_path,
        keys={"other": OTHER},
        clock=lambda: now[0],
        max_sessions=4,
        max_sessions_per_key=2,
        session_ttl_s=60.0,
    )
    try:
        mine = [_call(svc, "POST", "/v1/sessions")[1]["id"] for _ in range(2)]
        status, body, _ = _call(svc, "POST", "/v1/sessions")
        assert status == 429 and body["error"]["code"] == "too_many_sessions"
        # Another client is not locked out, and cannot see (or close) this key's sessions.
        theirs = _call(svc, "POST", "/v1/sessions", key=OTHER)[1]["id"]
        assert _call(svc, "GET", f"/v1/sessions/{mine[0]}", key=OTHER)[0] == 404
        assert _call(svc, "DELETE", f"/v1/sessions/{mine[0]}", key=OTHER)[0] == 404
        one_shot = {"prompt": PROMPT, "max_tokens": 4}
        assert _call(svc, "POST", "/v1/completions", one_shot, key=OTHER)[0] == 200
        # Spend a little in one session, then let both idle past the TTL.
        done = {**one_shot, "session": mine[0]}
        charged = _call(svc, "POST", "/v1/completions", done)[1]["privacy"]["charged_nats"]
        now[0] += 61.0
        assert _call(svc, "GET", f"/v1/sessions/{mine[0]}")[0] == 404  # expired
        status, body, _ = _call(svc, "POST", "/v1/completions", done)
        assert status == 404 and body["error"]["code"] == "session_not_found"
        assert _call(svc, "POST", "/v1/sessions")[0] == 200  # their slots are free again
        privacy = _call(svc, "GET", "/v1/privacy")[1]
        assert privacy["sessions_open"] == 1  # the other key's expired too
        assert privacy["deployment_charged_nats"] >= charged > 0  # charges stay spent
        assert theirs not in json.dumps(privacy)
    finally:
        svc.close()


def test_one_key_cannot_spend_everyones_budget(ensemble, tmp_path):
    """The review's budget exhaustion: one client's one-shot requests spent the whole deployment
    budget, after which every client silently got public tokens. Now a key spends its share,
    then gets 429 privacy_budget_exhausted; other keys keep theirs."""
    args = {"deployment_budget": 8 * B, "session_budget": 8 * B, "key_budget_share": 0.25}
    svc = _service(ensemble, tmp_path, keys={"other": OTHER}, **args)
    try:
        one_shot = {"prompt": PROMPT, "max_tokens": 16}
        spent, statuses = 0, []
        for _ in range(6):
            status, body, _ = _call(svc, "POST", "/v1/completions", one_shot)
            statuses.append(status)
            if status == 200:
                spent += body["privacy"]["private_tokens"]
                assert body["privacy"]["key_remaining_nats"] == pytest.approx((2 - spent) * B)
            else:
                assert status == 429 and body["error"]["code"] == "privacy_budget_exhausted"
                assert "API key" in body["error"]["message"]
        assert spent == 2 and statuses[-1] == 429  # 0.25 x 8 tokens' worth, then refused
        status, body, _ = _call(svc, "POST", "/v1/completions", one_shot, key=OTHER)
        assert status == 200 and body["privacy"]["private_tokens"] > 0
        privacy = _call(svc, "GET", "/v1/privacy")[1]
        assert privacy["deployment_remaining_nats"] > 0
    finally:
        svc.close()
    # A restart keeps each key's charges (the curator's state holds them).
    again = _service(ensemble, tmp_path, keys={"other": OTHER}, **args)
    try:
        status, body, _ = _call(again, "POST", "/v1/completions", {"prompt": PROMPT})
        assert status == 429 and body["error"]["code"] == "privacy_budget_exhausted"
    finally:
        again.close()


def test_the_server_can_force_greedy(ensemble, tmp_path):
    svc = _service(ensemble, tmp_path, decoder="greedy")
    try:
        body = _call(
            svc, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 1.0}
        )[1]
        assert body["privacy"]["decoder"] == "greedy"
    finally:
        svc.close()


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"prompt": SECRET, "session": "no-such-session"}, 404, "session"),
        ({"prompt": SECRET, "session": 7}, 400, "session"),
        ({"prompt": SECRET, "top_p": 0.5}, 400, "top_p"),
        ({"prompt": SECRET, "model": "gpt-4"}, 404, "model"),
        ({"prompt": SECRET, "max_tokens": 33}, 400, "max_tokens"),
        ({"prompt": SECRET, "n": 2}, 400, "n"),
        ({"prompt": SECRET, "frobnicate": 1}, 400, "frobnicate"),
        ({"max_tokens": 3}, 400, "prompt"),
        ({"prompt": SECRET + " x" * 5000, "max_tokens": 4}, 400, "prompt"),  # beyond the context
        (b"not json", 400, None),
        (b"[1]", 400, None),
    ],
)
def test_bad_completion_requests(service, body, status, param):
    got, answer, _ = _call(service, "POST", "/v1/completions", body)
    assert got == status and answer["error"]["param"] == param
    assert SECRET not in json.dumps(answer)
    assert service.curator.deployment_info()["deployment_charged"] == 0  # nothing generated


def test_routes_and_api_key(ensemble, tmp_path):
    svc = _service(ensemble, tmp_path, key=KEY)
    try:
        for method, path in (
            ("GET", "/v1/models"),
            ("GET", "/v1/privacy"),
            ("POST", "/v1/sessions"),
            ("GET", "/v1/sessions/x"),
            ("POST", "/v1/completions"),
        ):
            for key in (None, "wrong"):
                status, body, headers = _call(svc, method, path, {"prompt": "x"}, key=key)
                assert status == 401 and body["error"]["code"] == "invalid_api_key"
                assert headers["WWW-Authenticate"] == "Bearer"
        assert _call(svc, "GET", "/healthz")[:2] == (200, {"status": "ok"})
        models = _call(svc, "GET", "/v1/models", key=KEY)[1]
        assert models["data"][0]["id"] == "privcode-pac"
        assert _call(svc, "GET", "/v1/models/privcode-pac", key=KEY)[0] == 200
        assert _call(svc, "GET", "/v1/models/other", key=KEY)[0] == 404
        status, body, _ = _call(svc, "POST", "/v1/embeddings", {}, key=KEY)
        assert status == 404 and body["error"]["code"] == "not_found"
        status, _, headers = _call(svc, "GET", "/v1/completions", key=KEY)
        assert status == 405 and headers["Allow"] == "POST"
        assert _call(svc, "POST", "/v1/privacy", key=KEY)[0] == 405
    finally:
        svc.close()


def test_state_is_locked_and_survives_a_restart(worlds, tmp_path, monkeypatch):
    monkeypatch.delenv("PRIVCODE_PRIVACY_STORE", raising=False)
    store = init_store(tmp_path / "store")
    cfg = parse_args({"worlds": str(worlds), "device": "cpu", "privacy_store": str(store)})
    svc = _with_api(PacService.load(cfg, lock_wait_s=0))
    try:
        with pytest.raises(EnsembleError, match="ONE replica"):
            PacService.load(cfg, lock_wait_s=0)  # a second curator on the same state
        sid = _call(svc, "POST", "/v1/sessions")[1]["id"]
        _call(svc, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "session": sid})
        before = _call(svc, "GET", f"/v1/sessions/{sid}")[1]
        charged = svc.curator.deployment_info()["deployment_charged"]  # exact (the API rounds)
        assert charged > 0
    finally:
        svc.close()
    # A copy of the worlds elsewhere (a re-run that reproduces them) finds the same state:
    # same secret, same charges, same sessions.
    import shutil

    copy = tmp_path / "rerun" / "pac" / "worlds"
    shutil.copytree(worlds, copy)
    again = parse_args({"worlds": str(copy), "device": "cpu", "privacy_store": str(store)})
    svc = _with_api(PacService.load(again, lock_wait_s=0))
    try:
        assert _call(svc, "GET", f"/v1/sessions/{sid}")[1] == before
        # Everything the ledger leased counts as spent: the old replica's unspent block too.
        from privcode.privacy.budget import call

        (shown,) = call(store, "show")["pac"]
        restarted = svc.curator.deployment_info()["deployment_charged"]
        assert restarted == shown["leased_nats"] > charged
        assert _call(svc, "GET", "/v1/privacy")[1]["deployment_charged_nats"] >= restarted
    finally:
        svc.close()
    (state,) = (store / "pac").iterdir()
    assert oct(state.stat().st_mode & 0o777) == "0o700"
    # More than the allowance, later, is refused: only `privcode budget raise --pac` raises it.
    more = parse_args({**dataclasses.asdict(again), "deployment_budget": 1.0})
    with pytest.raises(LedgerConflictError, match="privcode budget raise --pac"):
        PacService.load(more, lock_wait_s=0)
    # A deleted state of served worlds fails closed; it is never redrawn with a full budget.
    (state / "curator.json").unlink()
    with pytest.raises(EnsembleError, match="were served"):
        PacService.load(again, lock_wait_s=0)
    assert not (state / "curator.json").exists()


def test_retrained_worlds_share_their_datas_pac_budget(worlds, tmp_path):
    """Other worlds of the same data (a pac re-run with new adapters) get only what is left."""
    import shutil

    from privcode.privacy.budget import call

    store = init_store(tmp_path / "store")

    def variant(name: str, extra: bytes) -> Path:
        root = tmp_path / name / "pac" / "worlds"
        shutil.copytree(worlds, root)
        info = json.loads((root / "pac.json").read_text())
        (root / "pac.json").write_text(json.dumps({**info, "dataset_id": "ds-same"}))
        cfg_file = root / "adapters" / info["worlds"][0] / "adapter_config.json"
        cfg_file.write_bytes(cfg_file.read_bytes() + extra)  # other adapters: other worlds
        return root

    def load(root: Path, budget: float):
        return PacService.load(
            parse_args(
                {
                    "worlds": str(root),
                    "device": "cpu",
                    "privacy_store": str(store),
                    "session_budget": budget,
                    "deployment_budget": budget,
                }
            ),
            lock_wait_s=0,
        )

    load(variant("first", b" "), 2.0**-4).close()
    with pytest.raises(LedgerConflictError, match="does not reset what the records have"):
        load(variant("second", b"  "), 2.0**-4)
    from privcode.privacy.raising import raise_with_authority

    worlds = call(store, "show")["pac"][0]["worlds"]
    out = raise_with_authority(store, None, to=2.0**-3, who="o", why="why", worlds=worlds)
    assert out["allowance_nats"] == 2.0**-3
    shown = call(store, "show")["pac"]
    assert len(shown) == 1 and shown[0]["record_budget_nats"] == 2.0**-3


def test_a_session_that_expires_in_the_queue_is_a_404(ensemble, tmp_path, monkeypatch):
    from privcode.pac.curator import UnknownSessionError

    svc = _service(ensemble, tmp_path)
    try:
        sid = _call(svc, "POST", "/v1/sessions")[1]["id"]

        def gone(*args, **kwargs):
            raise UnknownSessionError("expired")

        monkeypatch.setattr(svc.ensemble, "decode", gone)
        status, body, _ = _call(
            svc, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "session": sid}
        )
        assert status == 404 and body["error"]["code"] == "session_not_found"
    finally:
        svc.close()


@pytest.mark.heavy
def test_openapi_fuzz_pac(ensemble, tmp_path):
    svc = _service(ensemble, tmp_path)
    try:
        ops = fuzz_openapi(svc.api, examples=8)
        assert {"POST /v1/sessions", "DELETE /v1/sessions/{sid}", "GET /v1/privacy"} <= set(ops)
        assert {"POST /v1/completions", "POST /v1/chat/completions"} <= set(ops)
    finally:
        svc.close()


# --------------------------------------------------------------------------- Ray Serve


def test_ensemble_app_overhttp_json(serve_http, worlds, tmp_path):
    from ray import serve

    answers = []
    try:
        application = build_app(
            {
                "worlds": str(worlds),
                "device": "cpu",
                "max_tokens_limit": 32,
                "privacy_store": str(init_store(tmp_path / "store")),
                "api_key_env": "PRIVCODE_TEST_PAC_KEY",
                "insecure_no_auth": False,
            },
            ray_actor_options={
                "num_cpus": 1,
                "runtime_env": {"env_vars": {"PRIVCODE_TEST_PAC_KEY": KEY, "OMP_NUM_THREADS": "1"}},
            },
        )
        serve.run(application, name="pac-test", route_prefix="/pac-test")
        url = f"{serve_http}/pac-test"
        assert http_json(f"{url}/healthz") == (200, {"status": "ok"})
        assert http_json(f"{url}/v1/privacy")[0] == 401
        status, session = http_json(f"{url}/v1/sessions", b"", key=KEY, method="POST")
        assert status == 200 and session["object"] == "pac.session"
        answers.append(session)
        sid, total = session["id"], 0.0
        for extra in ({}, {"temperature": 1.0, "seed": 3}):
            status, body = http_json(
                f"{url}/v1/completions",
                {"prompt": PROMPT, "max_tokens": 10, "session": sid, **extra},
                key=KEY,
            )
            assert status == 200, body
            _assert_accounting(body)
            total += body["privacy"]["charged_nats"]
            assert body["privacy"]["session_charged_nats"] == pytest.approx(total, rel=1e-12)
            answers.append(body)
        assert answers[1]["privacy"]["private_tokens"] > 0
        status, info = http_json(f"{url}/v1/sessions/{sid}", key=KEY)
        assert status == 200 and info["charged_nats"] == pytest.approx(total, rel=1e-12)
        status, privacy = http_json(f"{url}/v1/privacy", key=KEY)
        assert status == 200 and privacy["key_charged_nats"] == info["charged_nats"]
        # The deployment's accounting reaches the Ray dashboard's Prometheus endpoint.
        private = sum(a["privacy"]["private_tokens"] for a in answers[1:])
        metrics = scrape_metrics(
            'app="privcode-pac"',
            {
                "ray_privcode_pac_charged_nats",
                "ray_privcode_pac_budget_nats",
                "ray_privcode_pac_tokens_total",
            },
            until=lambda m: m["ray_privcode_pac_charged_nats"] == pytest.approx(total),
        )
        assert metrics["ray_privcode_pac_charged_nats"] == pytest.approx(total, rel=1e-9)
        assert metrics["ray_privcode_pac_budget_nats"] == privacy["deployment_budget_nats"]
        tokens = scrape_metrics(
            'kind="private"',
            {"ray_privcode_pac_tokens_total"},
            until=lambda m: m["ray_privcode_pac_tokens_total"] == private,
        )
        assert tokens["ray_privcode_pac_tokens_total"] == private
        answers += [info, privacy]
        status, body = http_json(
            f"{url}/v1/completions", {"prompt": "x", "session": "gone"}, key=KEY
        )
        assert status == 404 and body["error"]["param"] == "session"
        status, body = http_json(f"{url}/v1/sessions/{sid}", key=KEY, method="DELETE")
        assert status == 200 and body["deleted"] is True
        assert http_json(f"{url}/v1/sessions/{sid}", key=KEY)[0] == 404
    finally:
        serve.delete("pac-test")
    for answer in answers:  # the secret and the posterior never leave the server
        assert not HIDDEN & set(_keys(answer))
    (state_file,) = (tmp_path / "store" / "pac").glob("*/curator.json")
    state = json.loads(state_file.read_text())
    text = json.dumps(answers)
    assert not [x for x in state["posterior"] if repr(float(x)) in text]
