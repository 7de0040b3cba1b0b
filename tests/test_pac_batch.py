"""PAC requests of different sessions decoded together (privcode.models.kv_batch,
PacEnsemble.step_batch, privcode.serve.pac_scheduler): each request's step log-probs equal
its solo decode's to 1e-5 (relative: float32 sums in another order) while others join and leave; through the scheduler each greedy
answer is its solo answer token for token and every charge is b per private token; a client
that has not read its last token is passed over, not waited for; one session's requests and
its close run in arrival order."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from privcode.models.kv_batch import KvBatch, KvBatchError
from privcode.serve.pac_args import new_curator, parse_args
from privcode.serve.pac_scheduler import DecodeScheduler, PacJob

pytestmark = pytest.mark.usefixtures("one_torch_thread")

B = 2.0**-16
ATOL = 1e-5
PROMPTS = [
    "def add(a, b):",
    "import os\n\n\ndef list_files(path):\n    return [",
    "x",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
]


def _curator(m, tmp_path, **args):
    cfg = parse_args({"worlds": "/unused", "b": B, **args})
    return new_curator(cfg, m, state_dir=tmp_path, rng_seed=0)


def _same(a, b):
    assert a.candidates.tolist() == b.candidates.tolist()
    np.testing.assert_allclose(a.worlds, b.worlds, atol=ATOL, rtol=ATOL)
    np.testing.assert_allclose(a.public, b.public, atol=ATOL, rtol=ATOL)


def _solo_steps(ens, ids, tokens):
    """Step log-probs of a solo decode of ``ids`` fed ``tokens`` one by one."""
    lp, past = ens.step_logprobs(ids)
    out = [lp]
    for t in tokens:
        lp, past = ens.step_logprobs([t], past)
        out.append(lp)
    return out


def test_groups_that_join_and_leave_get_their_solo_logprobs(pac_ensemble):
    ids = [pac_ensemble.encode(p) for p in PROMPTS[:3]]
    assert len({len(i) for i in ids}) == 3  # different lengths: left padding
    feeds = {g: [int(t) for t in np.random.default_rng(g).integers(5, 500, 8)] for g in range(3)}
    want = {g: _solo_steps(pac_ensemble, ids[g], feeds[g]) for g in range(3)}
    batch, got, step = KvBatch(), {g: [] for g in range(3)}, {g: 0 for g in range(3)}
    joins = {0: 0, 1: 2, 2: 3}  # group g joins at round joins[g]
    for rnd in range(9):
        for g, at in joins.items():
            if at == rnd:
                lp, cache = pac_ensemble.step_logprobs(ids[g])
                got[g].append(lp)
                batch.join(g, cache, pac_ensemble.m + 1, len(ids[g]))
        if rnd == 5:  # group 1 leaves with its cache, group 0 leaves for good
            parked = batch.leave(1, take=True)
            batch.leave(0)
        if rnd == 7:
            batch.join(1, parked, pac_ensemble.m + 1, parked.get_seq_length())
        members = [g for g in batch.groups if step[g] < len(feeds[g])]
        for g in [g for g in batch.groups if g not in members]:
            batch.leave(g)
        if not members:
            continue
        lps = pac_ensemble.step_batch(batch, [feeds[g][step[g]] for g in members])
        for g, lp in zip(members, lps, strict=True):
            got[g].append(lp)
            step[g] += 1
    assert step[2] == 6 and step[1] >= 4  # they really shared forwards
    for g in range(3):
        for a, b in zip(got[g], want[g], strict=False):
            _same(a, b)
    with pytest.raises(KvBatchError, match="already in the batch"):
        lp, cache = pac_ensemble.step_logprobs(ids[0])
        batch.join(2, cache, pac_ensemble.m + 1, len(ids[0]))


def test_prompts_prefilled_together_get_their_solo_logprobs_and_caches(pac_ensemble):
    ids = [pac_ensemble.encode(p) for p in PROMPTS]
    feeds = [5, 77, 301]
    want = [_solo_steps(pac_ensemble, i, feeds) for i in ids]
    prefilled = pac_ensemble.prefill_batch(ids)  # four lengths, one forward
    batch = KvBatch()
    for g, (lp, cache) in enumerate(prefilled):
        _same(lp, want[g][0])
        assert cache.get_seq_length() == len(ids[g])  # its own columns, no padding
        batch.join(g, cache, pac_ensemble.m + 1, len(ids[g]))
    for t, token in enumerate(feeds):  # the caches decode on as their solo ones do
        for g, lp in enumerate(pac_ensemble.step_batch(batch, [token] * len(ids))):
            _same(lp, want[g][t + 1])


def _run_all(scheduler, jobs):
    futures = [scheduler.submit(j) for j in jobs]
    return [f.result(timeout=300) for f in futures]


def _job(ens, curator, prompt, *, sink=None, session=None, max_tokens=12):
    sid = session or curator.open_session()

    def start():
        return ens.decode(curator, sid, prompt, max_tokens, decoder="greedy", sink=sink)

    return PacJob(session, start, lambda d: d.result())


def test_scheduled_answers_are_their_solo_answers(pac_unanimous, pac_ensemble, tmp_path):
    solo_curator = _curator(pac_unanimous.m, tmp_path / "solo")
    solo = [
        pac_unanimous.generate(solo_curator, solo_curator.open_session(), p, 12)
        for p in PROMPTS * 2
    ]
    curator = _curator(pac_unanimous.m, tmp_path / "batched")
    scheduler = DecodeScheduler(pac_unanimous, max_batch=8)
    try:
        got = _run_all(scheduler, [_job(pac_unanimous, curator, p) for p in PROMPTS * 2])
        assert scheduler.peak_batch >= 4
    finally:
        scheduler.close()
    for a, b in zip(got, solo, strict=True):
        assert a.token_ids == b.token_ids and a.text == b.text
        assert a.finish_reason == b.finish_reason and a.free_tokens == len(a.token_ids)
    # Worlds that disagree: every request's charge is b per private token, and the
    # deployment's is the sum of them. Each round's charges are one state write (group
    # commit), and the last write holds them all.
    curator = _curator(pac_ensemble.m, tmp_path / "charged")
    writes, write = [], curator._write
    curator._write = lambda snap: (writes.append(snap["deployment_steps"]), write(snap))[1]
    scheduler = DecodeScheduler(pac_ensemble, max_batch=4)
    try:
        got = _run_all(scheduler, [_job(pac_ensemble, curator, p) for p in PROMPTS * 2])
    finally:
        scheduler.close()
    assert all(a.charged_nats == pytest.approx(B * a.private_tokens, rel=1e-12) for a in got)
    assert sum(a.private_tokens for a in got) > 0
    total = curator.deployment_info()["deployment_charged"]
    assert total == pytest.approx(sum(a.charged_nats for a in got), rel=1e-9)
    private = sum(a.private_tokens for a in got)
    assert writes[-1] == private and len(writes) < private


class _SlowClient:
    """A lockstep sink whose client reads nothing until ``go`` is set."""

    cancelled = False

    def __init__(self):
        self.go, self.tokens = threading.Event(), []

    def ready(self):
        return self.go.is_set() or not self.tokens

    def put(self, token):
        self.tokens.append(token)
        return True


def test_a_slow_client_is_passed_over_and_one_sessions_requests_run_in_order(
    pac_unanimous, tmp_path
):
    curator = _curator(pac_unanimous.m, tmp_path)
    solo = pac_unanimous.generate(curator, curator.open_session(), PROMPTS[1], 12)
    slow = _SlowClient()
    scheduler = DecodeScheduler(pac_unanimous, max_batch=4)
    try:
        waiting = scheduler.submit(_job(pac_unanimous, curator, PROMPTS[1], sink=slow))
        quick = _run_all(scheduler, [_job(pac_unanimous, curator, p) for p in PROMPTS])
        assert not waiting.done() and len(slow.tokens) == 1  # the others did not wait on it
        slow.go.set()
        late = waiting.result(timeout=300)
        assert late.token_ids == solo.token_ids == tuple(slow.tokens)  # parked and back
        assert len(quick) == len(PROMPTS)
        # One session: its requests and its close run one after another, in arrival order.
        sid, order = curator.open_session(), []

        def tracked(tag):
            job = _job(pac_unanimous, curator, PROMPTS[0], session=sid, max_tokens=4)
            start, finish = job.start, job.finish
            job.start = lambda: order.append(f"{tag}+") or start()
            job.finish = lambda d: order.append(f"{tag}-") or finish(d)
            return job

        close = PacJob(sid, lambda: order.append("close") or curator.close_session(sid))
        _run_all(scheduler, [tracked("a"), tracked("b"), close])
        assert order == ["a+", "a-", "b+", "b-", "close"]
    finally:
        scheduler.close()


def test_a_failing_request_fails_alone(pac_unanimous, tmp_path):
    curator = _curator(pac_unanimous.m, tmp_path)
    scheduler = DecodeScheduler(pac_unanimous, max_batch=4)
    cleaned = []
    try:
        bad = PacJob(None, lambda: pac_unanimous.decode(curator, "no-such-session", "x", 4))
        bad.cleanup = lambda: cleaned.append(1)
        futures = [scheduler.submit(bad), scheduler.submit(_job(pac_unanimous, curator, "y"))]
        with pytest.raises(Exception, match="session"):
            futures[0].result(timeout=300)
        assert futures[1].result(timeout=300).token_ids and cleaned == [1]
    finally:
        scheduler.close()
    with pytest.raises(RuntimeError, match="closed"):
        scheduler.submit(_job(pac_unanimous, curator, "z"))
    start = time.monotonic()
    DecodeScheduler(pac_unanimous).close()  # an idle thread stops at once
    assert time.monotonic() - start < 5
