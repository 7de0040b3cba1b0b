"""privcode.checks.check_number: the one number validator (config, DP, models, audits)."""

import math
from fractions import Fraction

import numpy as np
import pytest

from privcode.checks import check_number
from privcode.errors import AccountingError, ConfigError


@pytest.mark.parametrize(
    "value, kwargs",
    [
        (3, {}),
        (0.5, {"min": 0, "max": 1}),
        (0, {"min": 0}),
        (1.0, {"max": 1.0}),
        (np.int64(7), {"min": 1, "integer": True}),
        (np.float32(0.25), {"min": 0.0}),
        (Fraction(1, 3), {"min": 0, "max": 1, "min_exclusive": True, "max_exclusive": True}),
        (math.inf, {"finite": False}),
        (2**127, {"min": 0, "max": 2**128, "integer": True}),
    ],
)
def test_accepted_values_come_back_unchanged(value, kwargs):
    assert check_number("x", value, **kwargs) is value


@pytest.mark.parametrize(
    "value, kwargs, message",
    [
        (-3, {"min": 10}, "x: -3 is below the minimum 10"),
        (1.5, {"max": 1.0}, "x: 1.5 is above the maximum 1.0"),
        (0.0, {"min": 0, "min_exclusive": True}, "x: 0.0 is not above 0"),
        (1.0, {"max": 1, "max_exclusive": True}, "x: 1.0 is not below 1"),
        (
            2**128,
            {"max": 2**128, "max_exclusive": True, "integer": True},
            "x: 340282366920938463463374607431768211456 is not below 2**128",
        ),
        (1e-12, {"min": 1e-06}, "x: 1e-12 is below the minimum 1e-06"),
        (math.nan, {"min": 0, "max": 1}, "x: nan is not finite"),
        (math.nan, {"min": 0, "min_exclusive": True}, "x: nan is not finite"),
        (math.inf, {"min": 0}, "x: inf is not finite"),
        # An infinity beyond a bound is refused by that bound (as the config always said).
        (math.inf, {"max": 1000.0}, "x: inf is above the maximum 1000.0"),
        (-math.inf, {"min": -1.0}, "x: -inf is below the minimum -1.0"),
        (2.5, {"integer": True}, "x: 2.5 is not an integer"),
        (True, {"integer": True}, "x: True is not an integer"),
        (False, {}, "x: False is not a number"),
        (None, {"min": 0}, "x: None is not a number"),
        ("3", {}, "x: '3' is not a number"),
    ],
)
def test_refusals_name_the_field_the_value_and_the_bound(value, kwargs, message):
    with pytest.raises(ValueError) as err:
        check_number("x", value, **kwargs)
    assert str(err.value) == message


def test_the_error_type_is_the_callers_and_a_secret_never_shows():
    with pytest.raises(AccountingError, match=r"^delta: 0.0 is not above 0$"):
        check_number(
            "delta",
            0.0,
            min=0,
            max=1,
            min_exclusive=True,
            max_exclusive=True,
            error=AccountingError,
        )
    secret = 123456789 << 110
    with pytest.raises(ValueError) as err:
        check_number(
            "seed", secret, min=0, max=1 << 128, max_exclusive=True, integer=True, secret=True
        )
    assert str(err.value) == "seed: the value (secret, not shown) is not below 2**128"
    assert str(secret) not in str(err.value)
    with pytest.raises(ValueError, match="secret, not shown"):
        check_number("seed", -1.5, integer=True, secret=True)


def test_config_constraints_and_dataclasses_use_it():
    from privcode.config import load_config
    from privcode.dp.accounting import DPEvent
    from privcode.dp.randomness import SecretRandomness
    from privcode.dp.sampler import PoissonSchedule

    with pytest.raises(
        ConfigError,
        match=r"^<defaults> \(with --set overrides\): data.size: 5 "
        r"is below the minimum 10$",
    ):
        load_config(overrides=["data.size=5"])
    # NaN passes every comparison: only the finiteness check refuses it.
    with pytest.raises(ConfigError, match=r"train.epsilon: nan is not finite"):
        load_config(overrides=["train.epsilon=.nan"])
    with pytest.raises(AccountingError, match=r"^sample_rate: 1.5 is above the maximum 1$"):
        DPEvent(1.0, 1.5)
    with pytest.raises(AccountingError, match=r"^steps: 2.5 is not an integer$"):
        DPEvent(1.0, 0.1, 2.5)
    assert DPEvent(np.float32(2.0), 0.5, np.int64(3)) == DPEvent(2.0, 0.5, 3)
    with pytest.raises(ValueError, match=r"^num_records: 0 is below the minimum 1$"):
        PoissonSchedule(0, 0.5, 1)
    for make in (lambda: PoissonSchedule(10, 0.5, 1 << 128), lambda: SecretRandomness(-7)):
        with pytest.raises(ValueError, match=r"^seed: the value \(secret, not shown\)"):
            make()
