"""Kubernetes resource quantities (``80Gi``, ``100m``, ``1.5e3``) as numbers.

Grammar from k8s.io/apimachinery/pkg/api/resource: a signed decimal number followed by a binary
SI suffix (Ki..Ei), a decimal SI suffix (n, u, m, "", k, M, G, T, P, E) or an exponent (e3/E3).
Decimal arithmetic keeps ``80Gi`` exact before the final conversion to float.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from functools import lru_cache

_QUANTITY = re.compile(
    r"^(?P<num>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
    r"(?:(?P<bin>Ki|Mi|Gi|Ti|Pi|Ei)|(?P<exp>[eE][+-]?[0-9]+)|(?P<dec>[numkMGTPE]?))$",
    re.ASCII,
)
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


def parse_quantity(text: object) -> float:
    """The numeric value of a quantity; ``ValueError`` with the reason when it is not one."""
    if isinstance(text, bool):
        raise ValueError(f"not a quantity: {text!r}")
    if isinstance(text, int | float):
        return float(text)
    if not isinstance(text, str):
        raise ValueError(f"not a quantity: {text!r}")
    return _parse_text(text)


# Quantities repeat a lot (every GPU of a model has the same memory, the same counters): a slice
# list of 10^4 slices parses 10^5 of them, a few hundred distinct. Errors are not cached.
@lru_cache(maxsize=4096)
def _parse_text(text: str) -> float:
    match = _QUANTITY.match(text.strip())
    if match is None:
        raise ValueError(f"not a quantity: {text!r}")
    try:
        number = Decimal(match["num"])
        if match["bin"]:
            number *= _BINARY[match["bin"]]
        elif match["exp"]:
            exponent = int(match["exp"][1:])
            if abs(exponent) > 300:
                raise ValueError(f"quantity out of range: {text!r}")
            number = number.scaleb(exponent)
        else:
            number = number.scaleb(_DECIMAL[match["dec"] or ""])
    except InvalidOperation:
        raise ValueError(f"not a quantity: {text!r}") from None
    return float(number)
