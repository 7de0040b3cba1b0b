"""Admission rules of the privacy store beyond the per-record budget (issue 41, points 1, 6, 11).

* ``train.epsilon`` caps the job: a plan whose own epsilon is over it is refused even when
  the store's budget has room, and a step past the plan may not take the job over it;
* a record in several rows of one job is refused (each row is sampled and charged on its
  own, so one fingerprint would hide a group's epsilon);
* ``privacy.json`` states the rows a record may occupy and the composition's assumption.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from conftest import init_store
from scipy.stats import binom

from privcode.artifacts.privacy import ADJACENCY, ADMISSION, NOT_RELEASED
from privcode.dp.accounting import DPEvent, calibrate, epsilon
from privcode.errors import BudgetRefused
from privcode.privacy import admission
from privcode.privacy.ledger import Budget, StoreLedger, pack_fingerprints
from privcode.privacy.store import PrivacyStore

DELTA = 1e-5


def _fps(root, n: int) -> bytes:
    rows = [(f"prompt {i}", f"def f{i}():\n    return {i}\n") for i in range(n)]
    return pack_fingerprints(PrivacyStore(root).record_fingerprints(rows))


def test_train_epsilon_caps_the_plan_even_when_the_store_has_room(tmp_path):
    root = init_store(tmp_path / "store")
    ledger = StoreLedger(root)
    plan = DPEvent(0.8, 0.02, 400)  # epsilon ~8.6 alone under RDP
    own = epsilon(plan, DELTA)
    assert 4.0 < own < 10.0
    store_budget = Budget(10.0, DELTA).to_dict()
    refused = ledger.admit(_fps(root, 20), plan.to_dict(), store_budget, cap=4.0)
    assert not refused["admitted"] and "train.epsilon 4" in refused["message"]
    assert ledger.show()["jobs"] == []  # nothing reserved
    asked = ledger.admission(_fps(root, 20), plan.to_dict(), store_budget, cap=4.0)
    assert not asked["admitted"]
    # Within the cap: admitted, and a step past the plan may not cross the cap.
    small = DPEvent(0.8, 0.02, 10)
    cap = (epsilon(DPEvent(0.8, 0.02, 11), DELTA) + epsilon(DPEvent(0.8, 0.02, 12), DELTA)) / 2
    job = ledger.admit(_fps(root, 20), small.to_dict(), store_budget, cap=cap)["job"]
    replies = [ledger.reserve(job, 0.8, 0.02, 1, request_id=f"r{i}") for i in range(13)]
    assert [r["granted"] for r in replies] == [True] * 11 + [False] * 2
    assert "train.epsilon" in replies[-1]["reason"]
    # The cap is in the log: a restored ledger still holds the job to it.
    ledger.close()
    restored = StoreLedger(root)
    assert not restored.reserve(job, 0.8, 0.02, 1, request_id="after")["granted"]


def test_a_record_in_several_rows_of_one_job_is_refused(tmp_path):
    store = PrivacyStore(init_store(tmp_path / "store"))
    rec = SimpleNamespace
    rows = [rec(prompt=f"p{i}", code=f"x = {i}\n") for i in range(5)]
    copy = rec(prompt="p3", code="x = 3\r\n")  # a copy that only re-encodes line ends
    plan, budget = DPEvent(1.0, 0.1, 5), Budget(10.0, DELTA)
    with pytest.raises(BudgetRefused, match="several rows") as err:
        admission.admit(store, [*rows, copy], plan, budget, explicit=False, reserve=False)
    assert "p3" not in str(err.value) and "x = 3" not in str(err.value)  # names no record


def test_the_group_epsilon_the_refusal_prevents_is_what_the_docstring_says():
    """At demo settings content in k rows spends far more than one row's epsilon
    (dp-accounting's mixture-of-Gaussians PLD, the independent reference): 2.93 / 5.08
    for 1 / 2 rows; a fingerprint charged once would say 2.93 for both."""
    from dp_accounting.pld import privacy_loss_distribution as pld

    q, steps = 16 / 2700, 30
    sigma = calibrate(4.0, DELTA, q, steps)
    eps = {}
    for k in (1, 2):
        probs = [float(binom.pmf(j, k, q)) for j in range(k + 1)]
        dist = pld.from_mixture_gaussian_mechanism(
            sigma, list(range(k + 1)), probs, value_discretization_interval=1e-2
        )
        eps[k] = dist.self_compose(steps).get_epsilon_for_delta(DELTA)
    assert eps[1] == pytest.approx(2.93, abs=0.02)
    assert eps[2] == pytest.approx(5.08, abs=0.05)


def test_privacy_json_states_rows_and_the_composition_assumption():
    assert ADJACENCY["max_rows_per_record"] == admission.MAX_ROWS_PER_RECORD == 1
    assert "non-adaptive" in ADMISSION["composition"]
    assert "min(train.epsilon" in ADMISSION["cap"]
    assert "restart" in NOT_RELEASED and "why training stopped" in NOT_RELEASED


def test_grants_are_bound_to_the_admitted_datas_digest(tmp_path):
    """Issue 41, point 7: a job id alone draws no grant; the WAL keeps a keyed id only."""
    import hashlib
    import json

    root = init_store(tmp_path / "store")
    ledger = StoreLedger(root)
    sha = hashlib.sha256(b"the admitted bytes").hexdigest()
    plan = DPEvent(0.8, 0.02, 10)
    job = ledger.admit(_fps(root, 20), plan.to_dict(), Budget(10.0, DELTA).to_dict(), dataset=sha)[
        "job"
    ]
    assert not ledger.reserve(job, 0.8, 0.02, 1, request_id="a")["granted"]
    other = hashlib.sha256(b"other bytes").hexdigest()
    denied = ledger.reserve(job, 0.8, 0.02, 1, request_id="b", dataset=other)
    assert not denied["granted"] and "digest" in denied["reason"]
    assert ledger.reserve(job, 0.8, 0.02, 1, request_id="c", dataset=sha)["granted"]
    wal = (root / "ledger.wal").read_text()
    assert sha not in wal
    admitted = [json.loads(x) for x in wal.splitlines() if '"admit"' in x][-1]
    assert admitted["dataset"] == PrivacyStore(root).dataset_id_of(sha)
    ledger.close()
    restored = StoreLedger(root)  # the binding is in the log
    assert not restored.reserve(job, 0.8, 0.02, 1, request_id="d")["granted"]
    assert restored.reserve(job, 0.8, 0.02, 1, request_id="e", dataset=sha)["granted"]
