"""The store's ledger over HTTP (issue 41 point 10): one writer for a whole release.

A real uvicorn server on 127.0.0.1 in front of a real store: the pipeline's
token admits and reserves with the same answers a plain ledger gives, the
serving token reaches the PAC methods only, a bad or missing token and an
oversized body are refused before the ledger sees them, the ledger's own
errors come back as the same classes, and with ``PRIVCODE_LEDGER_URL`` every
ledger helper (``budget.call``, ``open_ledger``, the PAC server) goes there
and holds no lock of its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import init_store

pytest.importorskip("fastapi")

from privcode.dp.accounting import DPEvent  # noqa: E402
from privcode.errors import (  # noqa: E402
    LedgerConflictError,
    LedgerUnavailableError,
    PrivcodeError,
)
from privcode.privacy.ledger import Budget, StoreLedger, pack_fingerprints  # noqa: E402
from privcode.privacy.ledger_client import (  # noqa: E402
    TOKEN_FILE_ENV,
    URL_ENV,
    RemoteLedger,
)
from privcode.privacy.ledger_service import load_tokens  # noqa: E402
from privcode.privacy.store import PrivacyStore  # noqa: E402

TOKENS = {"pipeline": "p" * 32, "serving": "s" * 32}
PLAN = DPEvent(1.0, 0.02, 40).to_dict()
BUDGET = Budget(8.0, 1e-5).to_dict()


def _fps(root: Path, n: int) -> bytes:
    rows = [(f"prompt {i}", f"def f{i}():\n    return {i}\n") for i in range(n)]
    return pack_fingerprints(PrivacyStore(root).record_fingerprints(rows))


@pytest.fixture()
def service(tmp_path):
    """(url, store root) of a served store; stopped after the test."""
    from operator_support import ledger_service

    root = init_store(tmp_path / "store")
    with ledger_service(root, TOKENS, max_body_bytes=1 << 20) as url:
        yield url, root


def _env(monkeypatch, tmp_path: Path, url: str, role: str) -> None:
    token = tmp_path / f"{role}.token"
    token.write_text(TOKENS[role] + "\n")
    monkeypatch.setenv(URL_ENV, url)
    monkeypatch.setenv(TOKEN_FILE_ENV, str(token))


def test_the_pipeline_token_admits_and_reserves_with_a_plain_ledgers_answers(service, tmp_path):
    url, root = service
    remote = RemoteLedger(url, TOKENS["pipeline"])
    reply = remote.call("admit", _fps(root, 30), PLAN, BUDGET, run="a", run_key="k")
    assert reply["admitted"] and reply["records"] == 30
    grant = remote.call("reserve", reply["job"], 1.0, 0.02, 1, request_id="i:0")
    assert grant["granted"] == 1 and grant["position"] == 1
    again = remote.call("reserve", reply["job"], 1.0, 0.02, 1, request_id="i:0")
    assert again.get("duplicate") and again["position"] == 1  # answered from the log

    reference = StoreLedger(init_store(tmp_path / "other"))
    try:
        ref = reference.admission(_fps(root, 30), PLAN, BUDGET)
    finally:
        reference.close()
    asked = remote.call("admission", _fps(root, 30), PLAN, BUDGET)
    assert asked["epsilon_spent"] > 0  # the served store has the first job now
    assert asked["epsilon_after"] > ref["epsilon_after"]
    assert remote.call("show")["jobs"][0]["steps_granted"] == 1


def test_tokens_roles_and_limits(service):
    url, root = service
    with pytest.raises(LedgerUnavailableError, match="HTTP 401"):
        RemoteLedger(url, "x" * 32).call("describe")
    serving = RemoteLedger(url, TOKENS["serving"])
    assert serving.call("ping") == "ok"
    for method in ("admit", "show", "reserve", "raise_budget", "pac_records"):
        with pytest.raises(LedgerUnavailableError, match="HTTP 403"):
            serving.call(method, b"", PLAN, BUDGET)
    big = b"\0" * (1 << 20)
    with pytest.raises(LedgerUnavailableError, match="HTTP 413"):
        RemoteLedger(url, TOKENS["pipeline"]).call("admission", big, PLAN, BUDGET)
    with pytest.raises(LedgerUnavailableError, match="HTTP 400"):
        RemoteLedger(url, TOKENS["pipeline"]).call("admission", "not bytes", PLAN)
    import requests

    assert requests.get(f"{url}/healthz", timeout=5).json() == {"ok": True}
    assert requests.get(f"{url}/docs", timeout=5).status_code == 404  # no schema to browse


def test_the_ledgers_errors_come_back_as_their_class(service):
    url, _ = service
    serving = RemoteLedger(url, TOKENS["serving"])
    assert serving.call("pac_open", "pw-a", "pd-a", 4, 2.0**-10, "deployment", 2.0**-4)
    with pytest.raises(LedgerConflictError, match="were served with m=4"):
        serving.call("pac_open", "pw-a", "pd-a", 8, 2.0**-10, "deployment", 2.0**-4)
    with pytest.raises(LedgerConflictError, match="no PAC worlds"):
        serving.call("pac_lease", "pw-none", 1e-3, "holder", 0)


def test_with_a_ledger_url_every_helper_uses_the_service(service, tmp_path, monkeypatch):
    from privcode.privacy.budget import call
    from privcode.privacy.ledger_actor import open_ledger

    url, root = service
    _env(monkeypatch, tmp_path, url, "pipeline")
    # The service holds the store's lock: a plain ledger here could not open it.
    with pytest.raises(LedgerUnavailableError):
        StoreLedger(root)
    assert call(root, "show")["store_id"] == PrivacyStore(root).ledger_id
    assert isinstance(open_ledger(root), RemoteLedger)
    other = init_store(tmp_path / "another")
    with pytest.raises(LedgerConflictError, match="serves store"):
        open_ledger(other)


def test_a_pac_server_reaches_the_service_with_the_serving_token(service, tmp_path, monkeypatch):
    from privcode.serve.pac_args import parse_args
    from privcode.serve.pac_ledger import PacLedger

    url, _ = service
    _env(monkeypatch, tmp_path, url, "serving")
    cfg = parse_args(
        {"worlds": str(tmp_path), "ledger": url, "pac_state": str(tmp_path / "pac-state")}
    )
    pac = PacLedger(cfg)
    worlds = pac.worlds_id(b"\1" * 32)
    assert worlds.startswith("pw-") and pac.call("pac_served", worlds) is False
    with pytest.raises(LedgerUnavailableError, match="HTTP 403"):
        pac.call("show")


def test_tokens_are_one_per_role_and_long(tmp_path):
    d = tmp_path / "tokens"
    d.mkdir()
    with pytest.raises(PrivcodeError, match="no ledger token"):
        load_tokens(d)
    (d / "pipeline").write_text("short")
    with pytest.raises(PrivcodeError, match="at least 16"):
        load_tokens(d)
    (d / "pipeline").write_text("a" * 20)
    (d / "serving").write_text("a" * 20)
    with pytest.raises(PrivcodeError, match="its own token"):
        load_tokens(d)
    (d / "serving").write_text("b" * 20)
    assert load_tokens(d) == {"pipeline": "a" * 20, "serving": "b" * 20}
    assert "token" not in repr(RemoteLedger("http://127.0.0.1:1", "a" * 20)).lower()
