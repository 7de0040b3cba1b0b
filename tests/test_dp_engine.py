"""The DP engine (privcode.dp.engine): reserve -> sample -> clip -> noise -> apply, and its one off switch.

References are computed independently: per-record gradients by one autograd
call per record, clipping by hand, the sum divided by qN.
"""

from __future__ import annotations

import pytest
import torch

from privcode.dp.engine import BudgetUnavailable, Privacy, make_private


class Tiny(torch.nn.Module):
    """Per-record squared error of a linear map: rows never interact."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, batch):
        return ((self.lin(batch["x"]) - batch["y"]) ** 2).sum(1)


N = 40
X = torch.randn(N, 4, generator=torch.Generator().manual_seed(1)) * 3
Y = torch.randn(N, 3, generator=torch.Generator().manual_seed(2))


def rows(local, step):
    idx = torch.tensor(local)
    return {"x": X[idx], "y": Y[idx]}


def loss_fn(module, batch):
    return module(batch)


def _engine(privacy, *, lr=0.1, reserve=None, q=0.25, **kw):
    model = Tiny()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr)
    if privacy.private and reserve is None:

        def reserve(request_id):
            return True, 7, None

    eng = make_private(model, opt, privacy, num_records=N, sample_rate=q, reserve=reserve, **kw)
    return model, eng


def _weights(model):
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def _reference_update(chosen, max_norm, denom):
    """sum_i clip(g_i) / denom, one autograd call per record (no Opacus)."""
    ref = Tiny()
    total = None
    for i in chosen:
        ref.zero_grad()
        ref({"x": X[i : i + 1], "y": Y[i : i + 1]}).sum().backward()
        g = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
        if max_norm is not None:
            g = g * min(1.0, max_norm / (float(g.norm()) + 1e-6))
        total = g if total is None else total + g
    return total / denom


def test_dp_step_is_the_clipped_sum_over_the_poisson_sample_divided_by_qn():
    model, eng = _engine(Privacy.dp_sgd(0.0, 1.0))
    before = _weights(model)
    chosen = eng.sample(0)
    assert chosen and chosen == eng.sample(0)  # a pure function of (secret seed, step)
    out = eng.step(0, rows, loss_fn)
    assert out.taken and out.position == 7 and out.nonfinite == 0
    expected = before - 0.1 * _reference_update(chosen, 1.0, 0.25 * N)
    assert torch.allclose(_weights(model), expected, atol=1e-6)


def test_noise_is_added_once_with_std_sigma_c_over_qn():
    sigma, c, q = 2.0, 0.5, 0.25
    # A loss with zero gradient leaves the noise alone: g_hat = N(0, s^2 C^2) / (qN).
    model = torch.nn.Linear(200, 50)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    eng = make_private(
        model,
        opt,
        Privacy.dp_sgd(sigma, c),
        num_records=N,
        sample_rate=q,
        reserve=lambda rid: (True, 0, None),
    )
    before = _weights(model)
    eng.step(
        0,
        lambda local, step: {"x": torch.zeros(len(local), 200)},
        lambda m, b: (m(b["x"]) * 0).sum(1),
    )
    delta = (before - _weights(model)) * q * N
    assert abs(float(delta.std()) - sigma * c) < 0.05 * sigma * c
    assert abs(float(delta.mean())) < 0.05


def test_a_denied_step_changes_nothing_and_reserve_comes_before_the_update():
    seen = []

    def reserve(request_id):
        seen.append((request_id, _weights(model_ref[0])))
        return len(seen) < 2, len(seen), None if len(seen) < 2 else "budget spent"

    model_ref = [None]
    model, eng = _engine(Privacy.dp_sgd(1.0, 1.0), reserve=reserve)
    model_ref[0] = model
    w0 = _weights(model)
    assert eng.step(0, rows, loss_fn, request_id="a:0").taken
    w1 = _weights(model)
    assert torch.equal(seen[0][1], w0) and not torch.equal(w1, w0)
    out = eng.step(1, rows, loss_fn, request_id="a:1")
    assert not out.taken and out.reason == "budget spent"
    assert torch.equal(_weights(model), w1)
    assert [rid for rid, _ in seen] == ["a:0", "a:1"]


def test_an_unreachable_budget_raises_and_takes_no_step():
    def reserve(request_id):
        raise TimeoutError("ledger actor gone")

    model, eng = _engine(Privacy.dp_sgd(1.0, 1.0), reserve=reserve)
    w0 = _weights(model)
    with pytest.raises(BudgetUnavailable, match="ledger actor gone"):
        eng.step(0, rows, loss_fn)
    assert torch.equal(_weights(model), w0)


def test_dp_seeds_are_secret_and_fresh_per_engine():
    _, a = _engine(Privacy.dp_sgd(1.0, 1.0))
    _, b = _engine(Privacy.dp_sgd(1.0, 1.0))
    assert a.schedule.seed != b.schedule.seed
    assert [a.sample(t) for t in range(5)] != [b.sample(t) for t in range(5)]


def test_non_private_mode_is_the_plain_sum_and_names_itself():
    mode = Privacy.non_private("comparison", seed=5)
    model, eng = _engine(mode)
    _, twin = _engine(mode)
    chosen = eng.sample(3)
    assert chosen == twin.sample(3)  # a fixed seed replays: only in this mode
    before = _weights(model)
    eng.step(3, rows, loss_fn)
    expected = before - 0.1 * _reference_update(chosen, None, 0.25 * N)
    assert torch.allclose(_weights(model), expected, atol=1e-5)
    rec = mode.record()
    assert rec["mode"] == "non-private" and rec["reason"] == "comparison"
    assert rec["fixed_seed"] is True and rec["clipped"] is False and "NOT_PRIVATE" in rec
    assert Privacy.dp_sgd(1.0, 1.0).record() == {"mode": "dp-sgd"}


def test_non_private_with_a_clip_norm_clips_per_record():
    model, eng = _engine(Privacy.non_private("clipped", seed=1, max_grad_norm=0.5))
    chosen = eng.sample(0)
    before = _weights(model)
    eng.step(0, rows, loss_fn)
    expected = before - 0.1 * _reference_update(chosen, 0.5, 0.25 * N)
    assert torch.allclose(_weights(model), expected, atol=1e-6)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: Privacy.non_private("  "), "needs a reason"),
        (lambda: Privacy("dp-sgd", 1.0, 1.0, seed=3), "no fixed seed"),
        (lambda: Privacy("dp-sgd", 1.0, 0.0), "positive max_grad_norm"),
        (lambda: Privacy("off"), "is not"),
    ],
)
def test_privacy_modes_are_validated(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_the_engine_refuses_dp_without_a_budget_and_a_budget_without_dp():
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="needs a budget"):
        make_private(model, opt, Privacy.dp_sgd(1.0, 1.0), num_records=N, sample_rate=0.1)
    with pytest.raises(ValueError, match="secret schedule only"):
        make_private(
            model,
            opt,
            Privacy.dp_sgd(1.0, 1.0),
            num_records=N,
            sample_rate=0.1,
            reserve=lambda r: (True, 0, None),
            sampler=lambda step: [0],
        )
    with pytest.raises(ValueError, match="reserves nothing"):
        make_private(
            model,
            opt,
            Privacy.non_private("x"),
            num_records=N,
            sample_rate=0.1,
            reserve=lambda r: (True, 0, None),
        )
