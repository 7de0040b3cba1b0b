"""A record is known by what trains, not by its exact text (issue 41, point 2).

A job trains records; then each variant is admitted to the same store and its
spent epsilon must include the first job, checked against Google's
dp-accounting (RDP, on the same orders). One exact fingerprint of the
(prompt, code) text gave every variant below a fresh budget:

* (a) the training row: trailing blanks in a prompt, a whitespace-only prompt
  against none, an edit past ``train.max_length`` tokens;
* (b) the code alone: tabs against spaces, trailing blanks, black's reformat,
  another prompt;
* (c) MinHash bands: a near duplicate that ingest itself would drop.

Plus: rows sharing (a) or (b) in one job are refused, identities are keyed, and
a store written with single fingerprints (log format 2, snapshot format 1)
still composes. :func:`privcode.privacy.admission.admit` runs as in training,
its ledger a plain :class:`StoreLedger` in this process instead of the actor.
"""

from __future__ import annotations

import inspect
import json
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import init_store

from privcode.dp.accounting import RDP_ORDERS, DPEvent
from privcode.errors import BudgetRefused
from privcode.privacy import admission
from privcode.privacy.ledger import Budget, StoreLedger, pack_fingerprints
from privcode.privacy.store import PrivacyStore

DELTA = 1e-5
FIRST, SECOND = DPEvent(1.1, 0.05, 200), DPEvent(0.9, 0.02, 150)
BUDGET = Budget(100.0, DELTA)
MAX_LENGTH = 48

ADD = 'def add_tax(price, rate):\n    """Return the price with tax."""\n    return price * (1 + rate)\n'
CODE = """\
def invoice_total(items, tax_rate=0.2, currency='EUR', rounding=2, discount=None, shipping=0):
    subtotal = sum(item['price'] * item.get('qty', 1) for item in items)
    if discount is not None:
        subtotal = subtotal - discount
    total = round(subtotal * (1 + tax_rate) + shipping, rounding)
    return {'total': total, 'currency': currency, 'lines': len(items), 'taxed': tax_rate > 0}
"""
BLACK = """\
def invoice_total(
    items, tax_rate=0.2, currency="EUR", rounding=2, discount=None, shipping=0
):
    subtotal = sum(item["price"] * item.get("qty", 1) for item in items)
    if discount is not None:
        subtotal = subtotal - discount
    total = round(subtotal * (1 + tax_rate) + shipping, rounding)
    return {
        "total": total,
        "currency": currency,
        "lines": len(items),
        "taxed": tax_rate > 0,
    }
"""  # `ruff format` of CODE (black's style: quotes, wrapped lines, magic trailing comma)


def rec(prompt: str, code: str) -> SimpleNamespace:
    return SimpleNamespace(prompt=prompt, code=code)


def dp_accounting_epsilon(*events: DPEvent) -> float:
    """The composition by an independent implementation (Google's dp-accounting)."""
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    reference = RdpAccountant(orders=list(RDP_ORDERS))
    for e in events:
        inner = dp_accounting.GaussianDpEvent(e.noise_multiplier)
        reference.compose(dp_accounting.PoissonSampledDpEvent(e.sample_rate, inner), e.steps)
    return reference.get_epsilon(DELTA)


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A store whose ledger answers ``admission.admit`` in this process (one writer)."""
    root = init_store(tmp_path / "store")
    ledgers: dict[str, StoreLedger] = {}

    def open_ledger(path):
        if str(path) not in ledgers:
            ledgers[str(path)] = StoreLedger(path)
        return ledgers[str(path)]

    monkeypatch.setattr(admission, "open_ledger", open_ledger)
    monkeypatch.setattr(admission, "ledger_call", lambda h, m, *a, **k: getattr(h, m)(*a, **k))
    yield PrivacyStore(root)
    for ledger in ledgers.values():
        ledger.close()


@pytest.fixture(scope="module")
def tokenizer():
    from privcode.models.tokenizer import train_tokenizer

    return train_tokenizer(inspect.getsource(textwrap).splitlines(keepends=True), vocab_size=600)


def rows_of(records, tokenizer):
    from privcode.models.encoding import encode_records

    return encode_records(records, tokenizer, MAX_LENGTH)


def admit(store, records, tokenizer=None, *, reserve, plan=FIRST):
    """``admission.admit`` as the train stage calls it (rows when a tokenizer is given)."""
    extra = {}
    if tokenizer is not None:
        from privcode.privacy.identities import tokenizer_id

        extra = {"rows": rows_of(records, tokenizer), "tokenizer": tokenizer_id(tokenizer)}
    _, reply = admission.admit(
        store, records, plan, BUDGET, explicit=False, reserve=reserve, **extra
    )
    return reply


def assert_includes_first_job(reply):
    """The variant has spent the first job, and the second composes with it."""
    assert reply["admitted"] and reply["new_records"] == 0
    assert reply["epsilon_spent"] == pytest.approx(dp_accounting_epsilon(FIRST), rel=1e-3)
    assert reply["epsilon_after"] == pytest.approx(dp_accounting_epsilon(FIRST, SECOND), rel=1e-3)


def trained_then(store, trained, variant, tokenizer=None):
    """Train ``trained`` (one job, with ``add`` beside it), then ask for ``variant``."""
    admit(store, [trained, rec("Add tax.", ADD)], tokenizer, reserve=True)
    return admit(store, [variant], tokenizer, reserve=False, plan=SECOND)


# --------------------------------------------------------------------------- (a) the row


def test_trailing_blanks_in_a_prompt_are_the_same_record(store, tokenizer):
    trained, variant = rec("Sum an invoice.", CODE), rec("Sum an invoice.  \t", CODE)
    rows = rows_of([trained, variant], tokenizer)
    assert rows[0].input_ids == rows[1].input_ids  # what trains is identical
    assert_includes_first_job(trained_then(store, trained, variant, tokenizer))


def test_a_whitespace_only_prompt_is_no_prompt(store, tokenizer):
    reply = trained_then(store, rec("", CODE), rec(" \n\t ", CODE), tokenizer)
    assert_includes_first_job(reply)


def test_an_edit_past_max_length_is_the_same_record(store, tokenizer):
    """The row is cut to train.max_length tokens: what trains is identical. The code and
    its shingles differ (no other identity joins them): the row identity does it."""
    tail = "\n".join(f"    table_{i} = [{i}] * {i}" for i in range(60))
    other = "\n".join(f"    other_{i} = '{i}' + str({i * 7})" for i in range(60))
    trained, variant = rec("Sum an invoice.", CODE + tail), rec("Sum an invoice.", CODE + other)
    rows = rows_of([trained, variant], tokenizer)
    assert rows[0].input_ids == rows[1].input_ids and len(rows[0].input_ids) == MAX_LENGTH
    assert_includes_first_job(trained_then(store, trained, variant, tokenizer))
    without_rows = admit(store, [variant], None, reserve=False, plan=SECOND)
    assert without_rows["new_records"] == 1 and without_rows["epsilon_spent"] == 0.0


# --------------------------------------------------------------------------- (b) the code


@pytest.mark.parametrize(
    "variant",
    [
        CODE.replace("    ", "\t"),  # tabs for spaces
        CODE.replace("\n", "   \n"),  # trailing blanks
        BLACK,  # black's reformat
    ],
    ids=["tabs", "trailing-blanks", "black"],
)
def test_a_reformat_of_the_code_is_the_same_record(store, variant):
    reply = trained_then(store, rec("Sum an invoice.", CODE), rec("Sum an invoice.", variant))
    assert_includes_first_job(reply)


def test_the_same_code_with_another_prompt_is_the_same_record(store, tokenizer):
    reply = trained_then(
        store, rec("Sum an invoice.", CODE), rec("Total of the basket, taxed.", CODE), tokenizer
    )
    assert_includes_first_job(reply)


# --------------------------------------------------------------------------- (c) MinHash


def test_a_near_duplicate_that_ingest_drops_is_the_same_record(store):
    from privcode.data.ingest.hygiene import dedup, shingle_hashes

    lines = [f"    row_{i} = compute(row_{i - 1}, weight={i}, name='r{i}')" for i in range(1, 40)]
    trained = "def pipeline(row_0):\n" + "\n".join(lines) + "\n    return row_39\n"
    variant = trained.replace("weight=17,", "weight=71,")
    a, b = shingle_hashes(trained), shingle_hashes(variant)
    assert 0.85 <= len(a & b) / len(a | b) < 1.0  # ingest's measure, at its threshold
    assert dedup([("t", trained), ("v", variant)]).near == {"v": "t"}  # ingest drops it
    reply = trained_then(store, rec("Run the pipeline.", trained), rec("Run it.", variant))
    assert_includes_first_job(reply)


def test_near_duplicates_in_one_job_are_admitted_and_joined_for_later_jobs(store):
    """Not refused (a band is shared below the threshold too); one component after:
    a near copy of either has spent the job."""
    from privcode.privacy.identities import FIRST_BAND

    lines = [f"    x{i} = step(x{i - 1}, {i})" for i in range(1, 40)]
    one = "def run(x0):\n" + "\n".join(lines) + "\n    return x39\n"
    near = one.replace("step(x20, 21)", "step(x20, 12)")
    ids = store.record_identities([("Run.", one), ("Run again.", near)])
    assert (ids[0, FIRST_BAND:] == ids[1, FIRST_BAND:]).all(axis=1).any()  # a shared band
    assert admit(store, [rec("Run.", one), rec("Run again.", near)], reserve=True)["admitted"]
    third = one.replace("step(x30, 31)", "step(x30, 13)")
    assert_includes_first_job(admit(store, [rec("p", third)], reserve=False, plan=SECOND))


# --------------------------------------------------------------------------- one job


def test_rows_sharing_code_or_training_row_in_one_job_are_refused(store, tokenizer):
    same_code = [rec("Sum an invoice.", CODE), rec("Total of the basket.", BLACK)]
    with pytest.raises(BudgetRefused, match="several rows .*code up to layout") as err:
        admit(store, same_code, reserve=False)
    assert "invoice" not in str(err.value)  # names no record
    tail = "\n".join(f"    t{i} = {i}" for i in range(80))
    same_row = [rec("Sum.", CODE + tail), rec("Sum.", CODE + tail.replace("t7", "u7"))]
    with pytest.raises(BudgetRefused, match="several rows .*training row"):
        admit(store, same_row, tokenizer, reserve=False)
    admit(store, same_row, reserve=False)  # the rows alone share that identity


# --------------------------------------------------------------------------- keys, formats


def test_identities_are_keyed(tmp_path):
    records = [("Sum an invoice.", CODE), ("Add tax.", ADD)]
    one = PrivacyStore(init_store(tmp_path / "one"))
    other = PrivacyStore(init_store(tmp_path / "other"))
    ids = one.record_identities(records)
    assert np.array_equal(ids, one.record_identities(records))  # stable under one key
    theirs = other.record_identities(records)
    assert ids.shape == theirs.shape == (2, 19, 16)
    mine = {bytes(x) for x in ids.reshape(-1, 16)}
    assert not mine & {bytes(x) for x in theirs.reshape(-1, 16)}  # nothing to match outside


def test_a_store_of_single_fingerprints_still_composes(tmp_path, monkeypatch):
    """Log format 2, jobs of one fingerprint a record, a format 1 snapshot: read, and the
    same record admitted on identities composes (its exact identity is the old
    fingerprint; a variant of it is not known to such a job)."""
    from privcode.privacy import budget as budget_module

    monkeypatch.setattr(budget_module, "WAL_FORMAT", 2)
    root = init_store(tmp_path / "old")
    assert json.loads((root / "ledger.wal").read_text().splitlines()[0])["format"] == 2
    old = PrivacyStore(root)
    fps = pack_fingerprints(old.record_fingerprints([("Sum an invoice.", CODE), ("x", ADD)]))
    ledger = StoreLedger(root)
    job = ledger.admit(fps, FIRST.to_dict(), BUDGET.to_dict())["job"]
    ledger.close()
    entry = json.loads((root / "ledger.wal").read_text().splitlines()[-1])
    assert entry["type"] == "admit" and "per_record" not in entry
    gid = {(): 0, (job,): 1}
    state = {"accountant": "rdp", "delta": DELTA, "groups": [[], [job]], "wal_records": 3}
    state["jobs"] = {job: [FIRST.to_dict()]}
    index = b"".join(fp + gid[(job,)].to_bytes(4, "big") for fp in _split(fps))
    old.write_groups(state, index)  # what the ledger before identities wrote
    monkeypatch.setattr(admission, "open_ledger", lambda path: StoreLedger(path))
    monkeypatch.setattr(admission, "ledger_call", lambda h, m, *a, **k: getattr(h, m)(*a, **k))
    _, reply = admission.admit(
        old, [rec("Sum an invoice.", CODE)], SECOND, BUDGET, explicit=False, reserve=False
    )
    assert_includes_first_job(reply)


def _split(blob: bytes) -> list[bytes]:
    return [blob[i : i + 16] for i in range(0, len(blob), 16)]


def test_records_joined_through_another_compose_over_the_whole_component():
    """A ~ B by one identity, B ~ C by another: a job on A counts every job of B and C
    (the closure: a job on A charges B, whose account holds C's jobs)."""
    from privcode.privacy.groups import RecordGroups

    def record(*names: str) -> np.ndarray:
        return np.frombuffer(b"".join(n.encode().ljust(16, b".") for n in names), np.uint8)

    a, b, c = record("a", "x", "a2"), record("b", "x", "y"), record("c", "c1", "y")
    groups = RecordGroups("rdp", DELTA)
    groups.add_job("on-c", c.reshape(1, 3, 16), [FIRST])
    groups.add_job("on-b", b.reshape(1, 3, 16), [SECOND])
    adm = groups.admission(a.reshape(1, 3, 16), [SECOND], budget=100.0)
    assert adm.new_records == 0 and adm.worst.jobs == {"on-b", "on-c"}
    assert adm.worst.epsilon == pytest.approx(dp_accounting_epsilon(FIRST, SECOND), rel=1e-3)
    assert groups.groups() == {frozenset({"on-b", "on-c"}): 2}  # B and C: one component
