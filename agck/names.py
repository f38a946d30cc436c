"""The names of things in a store: run names and steps. One rule everywhere, so
a run can move between backends and no name can reach outside a file store's root."""

from __future__ import annotations

import numbers
import re
from typing import Any

from .errors import InvalidRunNameError, UsageError

# ASCII only ([0-9] not \d, no re.UNICODE classes) and matched whole (fullmatch: `$`
# would also match before a final newline).
_RUN_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._\-:@+=]{0,199}", re.ASCII)

MAX_STEP = (1 << 63) - 1


def check_run(run: Any) -> str:
    """Run names: 1-200 of letters, digits and ``._-:@+=``, not starting with '.' or '-'."""
    if not isinstance(run, str) or not _RUN_RE.fullmatch(run):
        raise InvalidRunNameError(f"invalid run name {run!r}")
    return run


def is_run_name(name: Any) -> bool:
    """Whether ``name`` is a run name (a directory or key prefix that is not one, such
    as ``.git``, is not a run)."""
    return isinstance(name, str) and _RUN_RE.fullmatch(name) is not None


def check_step(step: Any, what: str = "step") -> int:
    """Steps are integers in [0, 2^63): any ``numbers.Integral`` but bool (numpy
    integers included), returned as a plain int."""
    if isinstance(step, numbers.Integral) and not isinstance(step, bool):
        step = int(step)
        if 0 <= step <= MAX_STEP:
            return step
    raise UsageError(f"invalid {what} {step!r}: steps are integers in [0, 2^63)",
                     hint=f"pass a non-negative int as the {what}")
