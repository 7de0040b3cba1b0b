"""PAC charges live in the ledger (issue 41, points 8 and 10a).

A curator spends only nats the store's ledger leased to it first (a WAL entry
through the one writer), everything leased counts as spent at load, leases
fence a second replica, the PAC budget is keyed by the records (not the
file's bytes) and held per record across overlapping corpora, and a server
with a ledger actor opens no store.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import init_store

from privcode.errors import LedgerConflictError
from privcode.pac.curator import STATE_FILE, Curator
from privcode.pac.leases import Leases, block_steps
from privcode.privacy.ledger import StoreLedger
from privcode.privacy.pac_budgets import records_dataset_id
from privcode.privacy.store import PrivacyStore

M, B = 4, 2.0**-10
ALLOWANCE = 64 * B  # 64 private steps in all
BLOCK = block_steps(B, ALLOWANCE, ALLOWANCE)  # capped at 1/16 of the allowance: 4 steps
WORLDS = "pw-test"
DISAGREE = np.array([0, 1, 0, 1])  # the worlds never agree: every step is private or nothing


@pytest.fixture()
def ledger(tmp_path):
    led = StoreLedger(init_store(tmp_path / "store"))
    led.pac_open(WORLDS, "pd-data", M, B, "deployment", ALLOWANCE)
    yield led
    led.close()


def _curator(state: Path | None, ledger: StoreLedger) -> Curator:
    """A curator of the test worlds paying from leases of ``ledger``."""
    cur = Curator(
        M, B, deployment_budget=ALLOWANCE, session_budget=ALLOWANCE, state_dir=state, rng_seed=0
    )
    cur.use_leases(Leases(lambda *a: ledger.pac_lease(WORLDS, *a), B, BLOCK))
    return cur


def _spend(cur: Curator, sid: str, most: int = 10_000) -> int:
    """Private steps until the curator can pay no more (at most ``most``)."""
    n = 0
    while n < most and cur.step(sid, DISAGREE).kind == "private":
        n += 1
    return n


def _leased(ledger: StoreLedger) -> float:
    (shown,) = ledger.show()["pac"]
    return shown["leased_nats"]


def test_the_block_size():
    assert BLOCK == 4
    assert block_steps(2.0**-16, 2.0**-10, 2.0**-4) == 64  # the defaults: one session's budget
    assert block_steps(2.0**-16, 2.0**-10, 2.0**-16) == 1


def test_two_curators_on_one_store_cannot_together_spend_more_than_the_allowance(ledger, tmp_path):
    first = _curator(tmp_path / "a", ledger)
    one = first.open_session()
    assert _spend(first, one, most=2) == 2  # first holds a block of 4
    second = _curator(tmp_path / "b", ledger)  # another replica, another node: fences first
    two = second.open_session()
    spent = 2 + _spend(first, one) + _spend(second, two) + _spend(first, one)
    assert spent * B <= ALLOWANCE
    assert spent == 64  # first spent its block only, second the rest
    assert first.can_pay(one) == "ledger" and second.can_pay(two) == "deployment"
    assert _leased(ledger) == ALLOWANCE
    with pytest.raises(LedgerConflictError, match="took PAC worlds"):
        ledger.pac_lease(WORLDS, B, first._leases.holder, 64)


def test_a_restored_older_curator_json_spends_nothing_more_than_was_leased(ledger, tmp_path):
    state = tmp_path / "state"
    cur = _curator(state, ledger)
    sid = cur.open_session()
    assert _spend(cur, sid, most=2) == 2
    old = json.loads((state / STATE_FILE).read_text())  # a backup inside the first block
    assert _spend(cur, sid, most=1) == 1
    (state / STATE_FILE).write_text(json.dumps(old))  # restored: 2 steps, not 3
    again = _curator(state, ledger)
    assert again.deployment_info()["deployment_charged"] == _leased(ledger) == BLOCK * B
    spent = 3 + _spend(again, sid)
    assert _leased(ledger) == ALLOWANCE
    assert again.deployment_info()["private_tokens"] == 2 + spent - 3
    assert spent * B <= ALLOWANCE - B  # the first block's unspent step is lost, not reused


def test_a_curator_json_older_than_a_lease_is_refused(ledger, tmp_path):
    state = tmp_path / "state"
    cur = _curator(state, ledger)
    sid = cur.open_session()
    _spend(cur, sid, most=1)
    old = (state / STATE_FILE).read_text()
    _spend(cur, sid, most=BLOCK + 1)  # a second lease reports the steps spent so far
    (state / STATE_FILE).write_text(old)
    with pytest.raises(LedgerConflictError, match="older copy"):
        _curator(state, ledger)


def test_leases_are_in_the_wal_and_fence_across_a_ledger_restart(tmp_path):
    store = init_store(tmp_path / "store")
    led = StoreLedger(store)
    led.pac_open(WORLDS, "pd-data", M, B, "deployment", ALLOWANCE)
    cur = _curator(None, led)
    _spend(cur, cur.open_session(), most=1)
    holder = cur._leases.holder
    led.close()
    led = StoreLedger(store)  # rebuilt from the WAL
    try:
        assert _leased(led) == BLOCK * B
        assert led.pac_lease(WORLDS, B, "new-holder", 1)["granted"] == B
        with pytest.raises(LedgerConflictError, match="took PAC worlds"):
            led.pac_lease(WORLDS, B, holder, 1)
        wal = (store / "ledger.wal").read_text()
        assert wal.count('"pac-lease"') == 3  # the start, the first block, the new holder
    finally:
        led.close()


def test_the_pac_dataset_key_is_the_records_not_the_files_bytes(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    store = PrivacyStore(init_store(tmp_path / "store"))
    rows = [{"id": str(i), "prompt": f"task {i}", "code": f"x = {i}\n"} for i in range(5)]
    jsonl, parquet = tmp_path / "a.jsonl", tmp_path / "b.parquet"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    copy = {**rows[0], "id": "copy"}  # the same record again under another id
    pq.write_table(pa.Table.from_pylist([*rows[::-1], copy]), parquet)  # reordered, a duplicate
    from privcode.data.records import read_records

    def key(path: Path) -> str:
        return records_dataset_id(store, ((r.prompt, r.code) for r in read_records(path)))

    assert store.dataset_id(jsonl) != store.dataset_id(parquet)  # the old key: the bytes
    assert key(jsonl) == key(parquet)
    crlf = [(r["prompt"], r["code"].replace("\n", "\r\n")) for r in rows]
    assert records_dataset_id(store, crlf) == key(jsonl)
    assert records_dataset_id(store, [(r["prompt"], r["code"]) for r in rows[1:]]) != key(jsonl)


def _register(led: StoreLedger, store: PrivacyStore, pairs: list[tuple[str, str]]) -> str:
    from privcode.privacy.identities import pack_identities

    dataset = records_dataset_id(store, pairs)
    ids = store.record_identities(pairs)
    led.pac_records(dataset, pack_identities(ids), ids.shape[1])
    return dataset


def test_pac_budgets_are_per_record_across_copies_reformats_and_overlaps(tmp_path):
    """Worlds on another corpus that shares records with earlier worlds' data (a subset,
    a reformat) are held to what those records already paid; disjoint data is not."""
    from privcode.privacy.budget import verify_store

    root = init_store(tmp_path / "store")
    store = PrivacyStore(root)
    corpus = [(f"task {i}", f"def f{i}(x):\n    return x + {i}\n") for i in range(12)]
    led = StoreLedger(root)
    first = _register(led, store, corpus)
    assert led.pac_open("pw-1", first, M, B, "deployment", ALLOWANCE)["allowance"] == ALLOWANCE
    assert led.pac_records(first, b"", 1) == {"registered": False}  # once per record set
    # The old key alone would have let each of these start with a full budget.
    half = [(p, c.replace("    ", "\t")) for p, c in corpus[6:]]  # a reformat, half of it
    more = half + [(f"new {i}", f"y = {i}\n") for i in range(6)]
    second = _register(led, store, more)
    assert second != first
    with pytest.raises(LedgerConflictError, match="does not reset what the records have paid"):
        led.pac_open("pw-2", second, M, B, "deployment", ALLOWANCE)
    # Half of it fits next to the first worlds only if the budget allows both: it does not.
    with pytest.raises(LedgerConflictError, match=f"{ALLOWANCE:g} of them are held"):
        led.pac_open("pw-2", second, M, B, "deployment", ALLOWANCE / 2)
    other = _register(led, store, [(f"other {i}", f"z = {i} * 2\n") for i in range(6)])
    assert led.pac_open("pw-3", other, M, B, "deployment", ALLOWANCE)["allowance"] == ALLOWANCE
    led.close()
    led = StoreLedger(root)  # replayed from the log, snapshot included
    try:
        with pytest.raises(LedgerConflictError, match="does not reset"):
            led.pac_open("pw-4", second, M, B, "deployment", ALLOWANCE)
        shown = {w["worlds"]: w for w in led.show()["pac"]}
        assert shown["pw-1"]["record_budget_nats"] == ALLOWANCE
        assert shown["pw-1"]["records_registered"] and shown["pw-3"]["records_registered"]
        assert led.show()["epsilon_spent"] == 0.0  # PAC members carry no DP event
    finally:
        led.close()
    assert verify_store(root)["ok"]


def _fake_worlds(root: Path) -> Path:
    names = [f"w{s:03d}" for s in range(M)]
    for name in names:
        (root / "adapters" / name).mkdir(parents=True)
        (root / "adapters" / name / "adapter_config.json").write_text("{}")
    info = {"format": "privcode-pac-worlds/1", "m": M, "base_model": "/base", "worlds": names}
    (root / "pac.json").write_text(json.dumps({**info, "NOT_PRIVATE": "test"}))
    return root


class _FakeEnsemble:
    def __init__(self, *args, **kwargs):
        self.m = M


def test_a_server_with_the_ledger_actor_opens_no_store(tmp_path, monkeypatch):
    """Only the ledger (the actor) touches the store; the curator's state is in pac_state."""
    import privcode.privacy.budget as budget_mod
    import privcode.privacy.ledger_actor as actor_mod
    import privcode.serve.pac_service as service_mod
    from privcode.serve.pac_args import parse_args
    from privcode.serve.pac_service import PacService

    store = init_store(tmp_path / "store")
    led = StoreLedger(store)
    monkeypatch.delenv("PRIVCODE_PRIVACY_STORE", raising=False)
    monkeypatch.setattr(service_mod, "PacEnsemble", _FakeEnsemble)
    monkeypatch.setattr(actor_mod, "get_ledger", lambda name: led)
    calls = []

    def ledger_call(handle, method, *args, **kwargs):
        calls.append(method)
        return getattr(handle, method)(*args)

    def no_store(*args, **kwargs):
        raise AssertionError("the server opened the privacy store")

    monkeypatch.setattr(actor_mod, "ledger_call", ledger_call)
    monkeypatch.setattr(budget_mod, "call", no_store)
    monkeypatch.setattr(PrivacyStore, "__init__", no_store)
    cfg = parse_args(
        {
            "worlds": str(_fake_worlds(tmp_path / "worlds")),
            "device": "cpu",
            "ledger": f"privcode-store:{led.store_id}",
            "pac_state": str(tmp_path / "pac-state"),
            "session_budget": ALLOWANCE,
            "deployment_budget": ALLOWANCE,
            "b": B,
            "key_budget_share": 1.0,
        }
    )
    try:
        svc = PacService.load(cfg, lock_wait_s=0)
        sid = svc.curator.open_session()
        assert _spend(svc.curator, sid) == 64
        svc.close()
        assert calls[:4] == ["pac_worlds_id", "pac_served", "pac_open", "pac_lease"]
        (state,) = (tmp_path / "pac-state").iterdir()
        assert state.name.startswith("pw-") and (state / STATE_FILE).is_file()
        assert not (store / "pac").exists()
        assert _leased(led) == ALLOWANCE
        shutil.rmtree(state)  # served worlds whose state is gone are refused
        with pytest.raises(Exception, match="were served"):
            PacService.load(cfg, lock_wait_s=0)
    finally:
        led.close()


def test_the_chart_mounts_the_pac_state_on_the_serving_pods_only(helm):
    import yaml
    from chart_support import by_kind, k8s_problems, one, pod_templates, render

    from privcode.serve.pac_args import parse_args

    serving = ("--set", "serve.enabled=true", "--set", "serve.ensemble.enabled=true")
    serving += ("--set", "apiKey.existingSecret=keys")

    def mounts(objects):
        for where, template in pod_templates(objects):
            if not where.endswith("submitter"):
                volumes = template["spec"]["containers"][0]["volumeMounts"]
                yield where, {m["name"]: m["mountPath"] for m in volumes}

    def ensemble_args(objects):
        config = yaml.safe_load(one(objects, "RayService")["spec"]["serveConfigV2"])
        return {a["name"]: a for a in config["applications"]}["ensemble"]["args"]

    # off: the curator state in the privacy store's pac/ (only the single-cluster fallback
    # mounts the store on the serving pods)
    fallback = (*serving, "--set", "ledger.enabled=false", "--set", "operator.enabled=false")
    off = render(helm, *fallback, "--set", "storage.pacState.enabled=false")
    assert all("pac-state" not in m for _, m in mounts(off))
    assert "pac_state" not in ensemble_args(off)
    # on by default, whether the ledger service runs or not
    for extra in ((), ("--set", "ledger.enabled=false", "--set", "operator.enabled=false")):
        objects = render(helm, *serving, *extra)
        for where, mounted in mounts(objects):
            want = "/mnt/pac-state" if "RayService" in where else None
            assert mounted.get("pac-state") == want, where
        (claim,) = [c for c in by_kind(objects, "PersistentVolumeClaim") if "pac-state" in str(c)]
        assert claim["metadata"]["name"] == "rel-privcode-pac-state" and not k8s_problems(claim)
        args = ensemble_args(objects)
        assert args["pac_state"] == "/mnt/pac-state/curators"
        assert parse_args(args).pac_state == "/mnt/pac-state/curators"
    # the RayService without the ensemble has no use for it: no claim, no mount
    premium_only = render(helm, "--set", "serve.enabled=true", "--set", "apiKey.existingSecret=k")
    assert all("pac-state" not in m for _, m in mounts(premium_only))
    assert not [c for c in by_kind(premium_only, "PersistentVolumeClaim") if "pac-state" in str(c)]
    ledger = ("--set", "serve.ensemble.args.ledger=privcode-store:0123456789ab")
    args = ensemble_args(render(helm, *fallback, *ledger))
    assert parse_args(args).ledger == "privcode-store:0123456789ab"
