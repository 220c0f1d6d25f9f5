"""What counts as a whole number or a number in a user's argument: the lowest layer, so that every layer that checks
one (a layer, a target, a seed, a timeout) reads it by one rule. A bool is neither (``True`` is no layer and no
second); a numpy integer or float is what it stands for.

    integer(np.int64(3)) == 3         # integer(True) is None, integer(1.0) is None
    real(0.5) == 0.5                  # real(True) is None, real("1") is None; NaN is a number (ordering refuses it)
"""

from __future__ import annotations

import numbers
from typing import Any

__all__ = ["integer", "real"]


def integer(value: Any) -> int | None:
    """``value`` as an int when it is an integer (numpy integers included), else None; bools are not integers."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def real(value: Any) -> float | None:
    """``value`` as a float when it is a real number (ints and numpy numbers included), else None; bools are not
    numbers."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)
