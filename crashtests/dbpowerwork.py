"""The workload of the ``dbpower`` trials: checkpoints put one after another on a
database store, each acknowledged once its put returned. It imports no torch, so a
trial starts in a fraction of a second.

Step ``k``'s state (:func:`tree`) is a base array the same at every step (its
chunks shared by every checkpoint of the run, as a frozen base is): 1 MiB, or 128 MiB
with the large profile; a 64 KiB array of its own, and the step number; each put
names the previous step as its parent. The step is appended to the ack log
(``O_APPEND``, outside the directory the power cut touches) after ``put`` returns, so
the log lists exactly what was acknowledged.

Run as ``python -m crashtests.dbpowerwork URL RUN STEPS ACKLOG [PROFILE]``.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import xxhash

_BASES: dict = {}


def base(profile: str = "small") -> np.ndarray:
    if profile not in _BASES:
        if profile == "small":
            _BASES[profile] = np.random.default_rng(12345).standard_normal(1 << 18).astype(np.float32)  # 1 MiB
        elif profile == "large":     # 128 MiB, made in a fraction of a second; every 1 MiB of it differs
            _BASES[profile] = np.arange(1 << 25, dtype=np.float32) * np.float32(1e-6)
        else:
            raise ValueError(f"unknown profile {profile!r}")
    return _BASES[profile]


def tree(k: int, profile: str = "small") -> dict:
    return {"base": base(profile), "delta": np.random.default_rng(k).standard_normal(1 << 14).astype(np.float32),
            "step": k}


def tree_hash(state) -> str:
    """A digest of a state as :func:`tree` builds it (numpy arrays and ints)."""
    h = xxhash.xxh3_64()
    for key in sorted(state):
        v = state[key]
        h.update(key.encode())
        if isinstance(v, np.ndarray):
            h.update(f"{v.dtype}{v.shape}".encode())
            h.update(np.ascontiguousarray(v).tobytes())
        else:
            h.update(repr(v).encode())
    return h.hexdigest()


def main(argv=None) -> int:
    from agck.stores import open_store
    args = argv or sys.argv[1:]
    url, run, steps, acklog = args[:4]
    profile = args[4] if len(args) > 4 else "small"
    store = open_store(url)
    fd = os.open(acklog, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, b"--- started\n")
    parent = None
    for k in range(1, int(steps) + 1):
        store.put(run, k, tree(k, profile), meta={"snapshot": True}, parent=parent)
        os.write(fd, b"%d\n" % k)
        parent = k
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
