"""The one number validator: range, integrality and finiteness, with one message style.

Torch-free and Ray-free (bottom layer): the config's field constraints and the
``__post_init__`` checks of the DP, model and audit dataclasses all call
:func:`check_number`, so every refused number reads the same way::

    data.size: -3 is below the minimum 10
    sample_rate: 1.5 is above the maximum 1
    noise_multiplier: nan is not finite
"""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["check_number"]


def _show_bound(bound: Any) -> str:
    # 2**128 reads better than its 39 digits.
    if isinstance(bound, int) and bound > 2**32 and bound & (bound - 1) == 0:
        return f"2**{bound.bit_length() - 1}"
    return str(bound)


def check_number(
    name: str,
    value: Any,
    *,
    min: Any = None,
    max: Any = None,  # noqa: A002
    min_exclusive: bool = False,
    max_exclusive: bool = False,
    integer: bool = False,
    finite: bool = True,
    secret: bool = False,
    error: type[Exception] = ValueError,
) -> Any:
    """Return ``value`` if it is a number within the bounds, else raise ``error``.

    ``min``/``max`` are inclusive unless ``min_exclusive``/``max_exclusive``;
    ``integer`` refuses anything but an integral number (Python or numpy int);
    ``finite`` (the default) refuses NaN and infinities. A bool is never a
    number. ``secret`` keeps the value out of the message (seeds). The message
    is ``"<name>: <value> <problem>"``, naming the bound that was crossed.
    """
    shown = "the value (secret, not shown)" if secret else repr(value)
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        raise error(f"{name}: {shown} is not {'an integer' if integer else 'a number'}")
    # NaN first (it compares with nothing); infinities last, so that one beyond a
    # bound is refused by that bound.
    finite = finite and not isinstance(value, numbers.Integral)
    if finite and math.isnan(value):
        raise error(f"{name}: {shown} is not finite")
    if min is not None:
        if min_exclusive and not value > min:
            raise error(f"{name}: {shown} is not above {_show_bound(min)}")
        if not min_exclusive and value < min:
            raise error(f"{name}: {shown} is below the minimum {_show_bound(min)}")
    if max is not None:
        if max_exclusive and not value < max:
            raise error(f"{name}: {shown} is not below {_show_bound(max)}")
        if not max_exclusive and value > max:
            raise error(f"{name}: {shown} is above the maximum {_show_bound(max)}")
    if finite and math.isinf(value):
        raise error(f"{name}: {shown} is not finite")
    return value
