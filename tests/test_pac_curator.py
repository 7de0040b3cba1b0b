"""The PAC curator: free unanimity, b nats per noisy step, fallback without touching the state,
the two posterior scopes, fail-closed persistence, nothing secret in what it shows, Bayes."""

from __future__ import annotations

import json
import os
import pickle
import stat

import numpy as np
import pytest

from privcode.errors import PrivcodeError
from privcode.pac.curator import (
    STATE_FILE,
    Curator,
    CuratorError,
    CuratorStateError,
    SessionLimitError,
    SessionScopeWarning,
    UnknownSessionError,
)

B = 0.25
SPLIT = np.array([0, 0, 1, 2])  # the worlds disagree
SAME = np.array([3, 3, 3, 3])  # unanimous


def make(m=4, b=B, deployment=100.0, session=10.0, **kw) -> Curator:
    return Curator(m, b, deployment_budget=deployment, session_budget=session, rng_seed=0, **kw)


def state(cur: Curator) -> tuple:
    """Internal privacy state (tests only): secret, deployment posterior, noise generator."""
    post = None if cur._posterior is None else cur._posterior.copy()
    return cur._secret, post, cur._rng.bit_generator.state


def test_unanimity_is_free_even_with_budgets_spent():
    cur = make(session=B)
    sid = cur.open_session()
    before = state(cur)
    out = cur.step(sid, SAME)
    assert (out.index, out.charged, out.kind) == (3, 0.0, "free")
    assert cur.step(sid, SPLIT).kind == "private"  # spends the whole session budget
    assert cur.step(sid, SPLIT).kind == "fallback"
    assert cur.step(sid, SAME).index == 3  # still free, still released
    info = cur.session_info(sid)
    assert (info["free_tokens"], info["private_tokens"], info["fallback_tokens"]) == (2, 1, 1)
    assert before[0] == state(cur)[0]


def test_each_noisy_step_charges_b_to_session_and_deployment():
    cur = make()
    a, b = cur.open_session(), cur.open_session(budget=1.0)
    outs = [cur.step(a, SPLIT) for _ in range(3)] + [cur.step(b, SPLIT)]
    assert all(o.kind == "private" and o.charged == B and o.index in (0, 1, 2) for o in outs)
    assert cur.session_info(a)["charged"] == 3 * B
    assert cur.session_info(b) == {
        "owner_charged": 4 * B,  # both sessions are the default owner's
        "owner_remaining": 100.0 - 4 * B,
        "session": b,
        "budget": 1.0,
        "charged": B,
        "remaining": 0.75,
        "private_tokens": 1,
        "free_tokens": 0,
        "fallback_tokens": 0,
    }
    dep = cur.deployment_info()
    assert dep["deployment_charged"] == 4 * B and dep["private_tokens"] == 4
    assert dep["deployment_remaining"] == 100.0 - 4 * B and dep["sessions_open"] == 2


@pytest.mark.parametrize("short", ["session", "deployment"])
def test_fallback_when_a_budget_is_short_leaves_the_state_alone(short):
    b = 2.0**-16
    # A budget of T * b allows exactly T private steps.
    cur = make(
        b=b,
        session=3 * b if short == "session" else 1.0,
        deployment=3 * b if short == "deployment" else 1.0,
    )
    sid = cur.open_session()
    assert [cur.step(sid, SPLIT).kind for _ in range(3)] == ["private"] * 3
    before = state(cur)
    for _ in range(5):
        out = cur.step(sid, SPLIT)
        assert (out.index, out.charged, out.kind) == (None, 0.0, "fallback")
    after = state(cur)
    assert after[0] == before[0] and np.array_equal(after[1], before[1]) and after[2] == before[2]
    assert cur.session_info(sid)["fallback_tokens"] == 5
    assert cur.deployment_info()["deployment_charged"] == 3 * b
    if short == "deployment":  # a new session cannot spend what the deployment lacks
        assert cur.step(cur.open_session(), SPLIT).kind == "fallback"


def test_a_budget_that_is_not_a_power_of_two_multiple_still_allows_its_steps():
    cur = make(b=0.1, session=0.3)
    sid = cur.open_session()
    assert [cur.step(sid, SPLIT).kind for _ in range(4)] == ["private"] * 3 + ["fallback"]


def test_deployment_scope_shares_one_posterior_across_sessions():
    cur = make(b=50.0, deployment=1e3, session=1e3)  # little noise: the posterior moves a lot
    a, b = cur.open_session(), cur.open_session()
    cur.step(a, SPLIT)
    after_a = cur._posterior.copy()
    assert not np.allclose(after_a, 0.25)
    cur.step(b, SPLIT)  # session b's step starts from a's posterior, not from uniform
    assert cur._sessions[a].posterior is None and cur._sessions[b].posterior is None
    assert cur.measured_leakage_nats() > 0
    with pytest.raises(CuratorError, match="without a session id"):
        cur.measured_leakage_nats(a)


def test_session_scope_keeps_separate_posteriors_and_warns(caplog):
    with pytest.warns(SessionScopeWarning, match="PER SESSION only"):
        cur = make(b=50.0, deployment=1e3, session=1e3, scope="session")
    assert any(r.levelname == "ERROR" and "PER SESSION" in r.getMessage() for r in caplog.records)
    a, b = cur.open_session(), cur.open_session()
    cur.step(a, SPLIT)
    assert not np.allclose(cur._sessions[a].posterior, 0.25)
    assert np.array_equal(cur._sessions[b].posterior, np.full(4, 0.25))
    assert cur._posterior is None
    assert cur.measured_leakage_nats(a) > 0 and cur.measured_leakage_nats(b) == 0
    assert cur.deployment_info()["deployment_charged"] == 50.0
    with pytest.raises(CuratorError, match="session id"):
        cur.measured_leakage_nats()


def test_persistence_restart_keeps_secret_and_charges(tmp_path):
    cur = make(state_dir=tmp_path)
    path = tmp_path / STATE_FILE
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    sid = cur.open_session(budget=2.0)
    for _ in range(3):
        cur.step(sid, SPLIT)
    cur.step(sid, SAME)
    saved = json.loads(path.read_text())
    assert saved["deployment_steps"] == 3 and saved["sessions"][sid]["private_tokens"] == 3
    again = make(state_dir=tmp_path)
    assert again._secret == cur._secret
    assert np.array_equal(again._posterior, cur._posterior)
    assert again.deployment_info()["deployment_charged"] == 3 * B
    info = again.session_info(sid)
    assert (info["budget"], info["charged"], info["private_tokens"]) == (2.0, 3 * B, 3)
    again.step(sid, SPLIT)
    again.close_session(sid)
    third = make(state_dir=tmp_path)
    assert third.deployment_info()["deployment_charged"] == 4 * B  # closing keeps the charge
    assert third.deployment_info()["sessions_open"] == 0
    with pytest.raises(UnknownSessionError):
        third.session_info(sid)


def test_session_scope_persists_session_posteriors(tmp_path):
    with pytest.warns(SessionScopeWarning):
        cur = make(b=50.0, deployment=1e3, session=1e3, scope="session", state_dir=tmp_path)
    sid = cur.open_session()
    cur.step(sid, SPLIT)
    with pytest.warns(SessionScopeWarning):
        again = make(b=50.0, deployment=1e3, session=1e3, scope="session", state_dir=tmp_path)
    assert np.array_equal(again._sessions[sid].posterior, cur._sessions[sid].posterior)


def test_the_ledger_is_written_before_the_release(tmp_path, monkeypatch):
    cur = make(state_dir=tmp_path)
    sid = cur.open_session()
    before = state(cur)

    def fail(_state):
        raise OSError("disk full")

    monkeypatch.setattr(cur, "_write", fail)
    with pytest.raises(OSError):
        cur.step(sid, SPLIT)
    # Nothing released, nothing recorded in memory: the step simply did not happen.
    assert cur.session_info(sid)["private_tokens"] == 0
    assert np.array_equal(cur._posterior, before[1])
    assert cur.step(sid, SAME).kind == "free"  # free steps need no write


@pytest.mark.parametrize(
    "damage", ["garbage", "format", "m", "b", "scope", "secret", "posterior", "steps"]
)
def test_a_bad_state_file_fails_closed(tmp_path, damage):
    make(state_dir=tmp_path)
    path = tmp_path / STATE_FILE
    saved = json.loads(path.read_text())
    kw = {}
    if damage == "garbage":
        path.write_text("{not json")
    elif damage in ("m", "b", "scope"):
        kw = {"m": 6, "b": 0.5, "scope": "session"}
        kw = {damage: kw[damage]}
    else:
        saved.update(
            {
                "format": {"format": "other/1"},
                "secret": {"secret": 9},
                "posterior": {"posterior": [1.0, 0, 0, 0.5]},
                "steps": {"deployment_steps": -1},
            }[damage]
        )
        path.write_text(json.dumps(saved))
    with pytest.warns(SessionScopeWarning) if damage == "scope" else _nothing():
        with pytest.raises(CuratorStateError, match="refusing to start") as info:
            make(state_dir=tmp_path, **kw)
    assert isinstance(info.value, PrivcodeError)
    if damage in ("m", "b", "scope"):
        assert damage in str(info.value)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_secret_and_posterior_never_show():
    cur = make(b=50.0, deployment=1e3, session=1e3)
    sid = cur.open_session()
    cur.step(sid, SPLIT)
    posterior = [float(x) for x in cur._posterior]
    shown = [cur.session_info(sid), cur.deployment_info()]
    for info in shown:
        assert not {"secret", "posterior", "world"} & set(info)
        assert not any(isinstance(v, list | np.ndarray) for v in info.values())
    text = repr(cur) + str(shown)
    assert "secret" not in text and "posterior" not in text
    assert not any(repr(p) in text for p in posterior if 0 < p < 1)
    with pytest.raises(TypeError, match="never serialised"):
        pickle.dumps(cur)
    with pytest.raises(UnknownSessionError, match="unknown") as info:
        cur.step("nope", SPLIT)
    assert isinstance(info.value, PrivcodeError) and isinstance(info.value, KeyError)


def test_arguments_are_checked():
    with pytest.raises(CuratorError, match="m"):
        Curator(1, B, deployment_budget=1.0, session_budget=1.0)
    with pytest.raises(CuratorError, match="b"):
        Curator(4, 0.0, deployment_budget=1.0, session_budget=1.0)
    with pytest.raises(CuratorError, match="scope"):
        Curator(4, B, deployment_budget=1.0, session_budget=1.0, scope="global")
    cur = make(session=2.0)
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(CuratorError, match="session budget"):
            cur.open_session(bad)
    assert cur.session_info(cur.open_session(budget=50.0))["budget"] == 2.0  # capped
    sid = cur.open_session()
    with pytest.raises(CuratorError, match="votes"):
        cur.step(sid, np.array([0, 1, 2]))
    with pytest.raises(CuratorError, match="votes"):
        cur.step(sid, np.array([0.0, 1.0, 2.0, 3.0]))
    small = make(max_sessions=1)
    small.open_session()
    with pytest.raises(CuratorError, match="max_sessions"):
        small.open_session()


# A world whose posterior underflowed to a denormal still counts as alive; the mechanism's
# likelihood of it then overflows to 0, harmlessly (a warning from privcode.pac.mechanism).
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_deployment_posterior_is_bayes_consistent():
    """With S uniform, E[P_t] = P_0 (uniform) over the noise, for a run of noisy steps.

    Stratified over the secret (each world equally often, set after construction) and
    with seeded noise, so the estimate is deterministic; the CSPRNG draw of the secret
    is checked for uniformity separately.
    """
    per_world, m = 250, 4
    votes = [SPLIT, np.array([1, 0, 0, 1]), np.array([2, 2, 2, 0])]
    mean = np.zeros(m)
    for secret in range(m):
        for seed in range(per_world):
            cur = Curator(
                m, 1.0, deployment_budget=10.0, session_budget=10.0, rng_seed=seed * m + secret
            )
            cur._secret = secret
            sid = cur.open_session()
            for v in votes:
                cur.step(sid, v)
            mean += cur._posterior
    assert np.allclose(mean / (m * per_world), 0.25, atol=0.015)
    drawn = np.bincount([make()._secret for _ in range(2000)], minlength=m) / 2000
    assert np.all(np.abs(drawn - 0.25) < 0.05)  # ~5 standard errors: the secret is uniform


def test_concurrent_sessions_lose_no_charge(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    cur = make(b=2.0**-10, state_dir=tmp_path)
    sids = [cur.open_session() for _ in range(4)]

    def run(sid):
        return sum(cur.step(sid, SPLIT).kind == "private" for _ in range(10))

    with ThreadPoolExecutor(4) as pool:
        assert sum(pool.map(run, sids)) == 40
    assert cur.deployment_info()["private_tokens"] == 40
    assert make(b=2.0**-10, state_dir=tmp_path).deployment_info()["private_tokens"] == 40


def test_owners_have_budget_shares_session_caps_and_idle_expiry(tmp_path):
    now = [0.0]
    kw = {"owner_budget": 2 * B, "max_sessions_per_owner": 2, "session_ttl_s": 10.0}
    cur = make(state_dir=tmp_path, clock=lambda: now[0], **kw)
    a1, a2 = cur.open_session(owner="a"), cur.open_session(owner="a")
    with pytest.raises(SessionLimitError, match="at most 2"):
        cur.open_session(owner="a")
    b1 = cur.open_session(owner="b")
    with pytest.raises(UnknownSessionError):
        cur.session_info(a1, "b")  # another owner's session is unknown to it
    # Owner a's share (2 steps) spans its sessions; then a falls back, b still pays.
    kinds = [cur.step(a1, SPLIT).kind, cur.step(a2, SPLIT).kind, cur.step(a2, SPLIT).kind]
    assert kinds == ["private", "private", "fallback"]
    assert cur.can_pay(a1, "a") == "key" and cur.owner_can_pay("a") == "key"
    assert cur.can_pay(b1, "b") is None and cur.step(b1, SPLIT).kind == "private"
    info = cur.session_info(a2, "a")
    assert info["owner_charged"] == 2 * B and info["owner_remaining"] == 0
    # Idle past the TTL: the sessions go, their slots are free, the charges stay.
    now[0] = 5.0
    cur.step(b1, SAME)  # b1 is used at t=5
    now[0] = 12.0
    with pytest.raises(UnknownSessionError):
        cur.session_info(a1)
    assert cur.session_info(b1)["private_tokens"] == 1
    assert cur.deployment_info()["sessions_open"] == 1
    a3 = cur.open_session(owner="a")
    assert cur.can_pay(a3, "a") == "key"  # the share is spent for good
    # A restart keeps owners' charges and sessions' idle clocks.
    again = make(state_dir=tmp_path, clock=lambda: now[0], **kw)
    assert again.can_pay(a3, "a") == "key" and again.can_pay(b1, "b") is None
    now[0] = 30.0
    with pytest.raises(UnknownSessionError):
        again.session_info(a3)


def test_a_format_1_state_is_read_and_rewritten_as_format_2(tmp_path):
    cur = make(state_dir=tmp_path)
    sid = cur.open_session()
    cur.step(sid, SPLIT)
    path = tmp_path / STATE_FILE
    old = json.loads(path.read_text())
    old["format"] = "privcode-pac-curator/1"
    del old["owners"]
    for entry in old["sessions"].values():
        del entry["owner"], entry["last_used"]
    path.write_text(json.dumps(old))
    again = make(state_dir=tmp_path)
    assert again.session_info(sid)["private_tokens"] == 1  # the default owner's session
    again.step(sid, SPLIT)
    new = json.loads(path.read_text())
    assert new["format"] == "privcode-pac-curator/2" and new["owners"] == {"default": 1}
    assert new["deployment_steps"] == 2


def _counting_writes(cur: Curator) -> list[int]:
    writes, real = [], cur._write

    def write(snapshot):
        writes.append(snapshot["deployment_steps"])
        real(snapshot)

    cur._write = write  # type: ignore[method-assign]
    return writes


def test_a_group_commit_releases_what_steps_one_after_another_do_with_one_write(tmp_path):
    group, single = make(state_dir=tmp_path / "g"), make(state_dir=tmp_path / "s")
    single._secret = group._secret  # the same realised world, the same noise seed
    g_ids, s_ids = (
        [group.open_session(), group.open_session()],
        [
            single.open_session(),
            single.open_session(),
        ],
    )
    plan = [(0, SPLIT), (1, SPLIT), (0, SAME), (None, SPLIT), (1, SPLIT), (0, np.array([1, 2]))]
    g_writes, s_writes = _counting_writes(group), _counting_writes(single)
    got = group.step_many([(g_ids[i] if i is not None else "gone", v) for i, v in plan])
    want = []
    for i, votes in plan:
        try:
            want.append(single.step(s_ids[i] if i is not None else "gone", votes))
        except CuratorError as exc:
            want.append(exc)
    assert [type(o) for o in got] == [type(o) for o in want]
    assert isinstance(got[3], UnknownSessionError) and isinstance(got[5], CuratorError)
    assert [o for o in got if not isinstance(o, Exception)] == [
        o for o in want if not isinstance(o, Exception)
    ]
    assert g_writes == [3] and s_writes == [1, 2, 3]  # one write, after all three charges
    assert np.array_equal(group._posterior, single._posterior)
    for g, s in zip(g_ids, s_ids, strict=True):
        info_g, info_s = group.session_info(g), single.session_info(s)
        assert {k: v for k, v in info_g.items() if k != "session"} == {
            k: v for k, v in info_s.items() if k != "session"
        }
    restored = make(state_dir=tmp_path / "g")  # what was written is what was released
    assert restored.deployment_info()["private_tokens"] == 3
    assert np.array_equal(restored._posterior, group._posterior)


def test_a_failed_group_write_undoes_every_step_of_the_group(tmp_path, monkeypatch):
    from privcode.pac.leases import Leases

    cur = make(state_dir=tmp_path)
    cur.use_leases(
        Leases(
            lambda amount, holder, steps: {"granted": amount, "leased": amount, "allowance": 1e3},
            B,
            10,
        )
    )
    a, b = cur.open_session(), cur.open_session(owner="k2")
    cur.step(a, SPLIT)
    before = (state(cur)[1], cur.session_info(a), cur.session_info(b), cur._leases.left)

    def fail(_state):
        raise OSError("disk full")

    monkeypatch.setattr(cur, "_write", fail)
    with pytest.raises(OSError):
        cur.step_many([(a, SPLIT), (b, SPLIT), (a, SPLIT)])
    after = (cur._posterior, cur.session_info(a), cur.session_info(b), cur._leases.left)
    assert np.array_equal(after[0], before[0]) and after[1:] == before[1:]
    assert cur.owner_info("k2")["owner_private_tokens"] == 0
    assert cur.deployment_info()["private_tokens"] == 1
