"""The AppendLog workload of the crash campaign: a snapshotted pipeline whose state
holds an :class:`agck.AppendLog`, every acknowledgement logged out of band.

Step ``i`` appends ``item(i)`` (a draw from the state's numpy Generator and a small
array) to the log and counts it in ``done``; a Snapshotter takes a checkpoint every
``EVERY`` steps, whose AppendLog segment goes to the run's journal log before the
checkpoint commits. Each durable checkpoint appends its step to ``acks`` (fsync'd)
before the pipeline goes on. At the end, ``out.json`` gets the hash of every item
and the step the incarnation resumed from.

Run as ``python -m crashtests.applogwork URL RUN DIR sync|async STEPS SLEEP``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import xxhash

EVERY = 4


def item(i: int, rng) -> dict:
    return {"i": i, "draw": float(rng.random()), "v": np.arange(i % 5, dtype=np.int32) * i}


def digest(items) -> str:
    """The hash of a list of items (what the judge compares with an uninterrupted run)."""
    h = xxhash.xxh3_128()
    for x in items:
        h.update(json.dumps([x["i"], x["draw"], x["v"].tolist(), str(x["v"].dtype)]).encode())
    return h.hexdigest()


def state() -> dict:
    import agck
    return {"done": 0, "rng": np.random.default_rng(7), "results": agck.AppendLog(name="results")}


def run(url: str, run_name: str, d: str, mode: str, steps: int, sleep: float) -> dict:
    import agck
    fd = os.open(os.path.join(d, "acks"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def ack(step: int, ref: str) -> None:
        os.write(fd, f"{step}\n".encode())
        os.fsync(fd)

    os.write(fd, f"--- {os.getpid()}\n".encode())
    with agck.Snapshotter(url, run_name, every=EVERY, mode=mode, max_in_flight=2, on_durable=ack,
                          handle_signals=False) as snap:
        s = snap.restore(state())
        start = snap.start_step
        for i in snap.steps(steps):
            s["results"].append(item(i, s["rng"]))
            s["done"] = i + 1
            time.sleep(sleep)
    os.close(fd)
    return {"hash": digest(s["results"]), "count": len(s["results"]), "start": start}


def acks(path: str) -> list[list[int]]:
    """The acknowledged steps of each incarnation, in order."""
    out: list[list[int]] = []
    if not os.path.exists(path):
        return out
    for line in open(path).read().splitlines():
        if line.startswith("---"):
            out.append([])
        elif line.strip().isdigit() and out:
            out[-1].append(int(line))
    return out


if __name__ == "__main__":
    url, run_name, d, mode, steps, sleep = sys.argv[1:7]
    out = run(url, run_name, d, mode, int(steps), float(sleep))
    with open(os.path.join(d, "out.json"), "w") as f:
        json.dump(out, f)
