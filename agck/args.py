"""Checks of the values a caller passes to agck's functions: a value of the wrong type
or out of range is one :class:`~agck.errors.UsageError` line that names the argument
and says what it takes, never Python's own TypeError, ValueError or OverflowError from
deep inside."""

from __future__ import annotations

import math
import numbers
from typing import Any

from .errors import UsageError


def check_seconds(value: Any, what: str, *, maximum: float = 86_400.0, zero: bool = False) -> float:
    """A number of seconds: finite, above 0 (or 0 with ``zero``), at most ``maximum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise UsageError(f"{what} must be a number of seconds, not {type(value).__name__}",
                         hint=f"e.g. {what}=30")
    v = float(value)
    if not (math.isfinite(v) and (v >= 0 if zero else v > 0) and v <= maximum):
        raise UsageError(f"{what}={value!r} is not a number of seconds {'from 0' if zero else 'above 0'} and up "
                         f"to {maximum:g}", hint=f"e.g. {what}=30")
    return v


def check_callable(value: Any, what: str) -> Any:
    """None, or something to call."""
    if value is not None and not callable(value):
        raise UsageError(f"{what} must be callable or None, not {type(value).__name__}")
    return value


def check_addresses(addresses: Any, what: str = "addresses") -> list[bytes]:
    """Chunk addresses: an iterable (not a str or bytes itself) of 32-byte bytes."""
    if isinstance(addresses, (str, bytes, bytearray, memoryview)) or not hasattr(addresses, "__iter__"):
        raise UsageError(f"{what} must be a list of 32-byte chunk addresses (bytes), not {type(addresses).__name__}",
                         hint="bytes.fromhex(hex_address) turns a printed address back into one")
    out = []
    for i, a in enumerate(addresses):
        if not isinstance(a, (bytes, bytearray)) or len(a) != 32:
            raise UsageError(f"{what}[{i}] is not a 32-byte chunk address: a {type(a).__name__}"
                             + (f" of {len(a)} bytes" if isinstance(a, (bytes, bytearray, str)) else ""),
                             hint="bytes.fromhex(hex_address) turns a printed address back into one")
        out.append(bytes(a))
    return out
