"""The journal workload of the crash campaign: a pipeline of journaled steps whose
every execution and every acknowledgement is logged, so a crash can be judged.

Step ``i`` of ``steps`` is a result (``embed``: a dict with a float32 vector) and,
every fifth step, a streamed step (``tokens``: three strings). Each execution of a
step's function, or of a stream's item, appends its label (``r7``, ``s5.1``) to the
``ran`` log as it happens; each result made durable appends its label to the
``acks`` log: in sync commit as each call returns (a stream's end, ``e5``, once it
is consumed whole), in group commit as :attr:`Journal.last_durable` passes it.
Each incarnation starts both logs with a line ``--- <pid>``. At the end, ``out``
gets the hash of every value the pipeline saw, in order, and what the journal
found damaged.

Run as ``python -m crashtests.journalwork URL RUN DIR sync|group STEPS SLEEP``; the
campaign's power-loss trials call :func:`pipeline` in-process on SimFS; :func:`reference`
is the hash an uninterrupted run's values come to.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
import time

import numpy as np
import xxhash

STREAM_EVERY = 5
STREAM_ITEMS = 3


def embed(i: int, ran) -> dict:
    ran(f"r{i}")
    return {"i": i, "vec": np.random.default_rng(i).standard_normal(16).astype(np.float32), "doc": f"doc-{i}"}


def tokens(i: int, ran):
    for k in range(STREAM_ITEMS):
        ran(f"s{i}.{k}")
        yield f"tok-{i}.{k}"


def pipeline(j, steps: int, ran, ack, sleep: float = 0.0) -> str:
    """Run the pipeline through journal ``j``; returns the hash of every value seen."""
    h = xxhash.xxh3_128()
    labels: list[str] = []     # what this journal recorded, in order (group commit: acknowledged as it becomes durable)
    acked = 0
    sync = j.commit == "sync"

    def recorded(label: str, before: int) -> None:
        nonlocal acked
        if j.recorded > before:
            labels.append(label)
        if sync:       # durable before the call returned (recorded now or replayed)
            if label != "flush":
                ack(label)
            return
        durable = j.last_durable
        for lab in labels[acked:durable]:
            ack(lab)
        acked = max(acked, durable)

    for i in range(steps):
        before = j.recorded
        r = j.step("embed", functools.partial(embed, ran=ran), i)
        h.update(json.dumps([r["i"], r["doc"]]).encode())
        h.update(np.ascontiguousarray(r["vec"]).tobytes())
        recorded(f"r{i}", before)
        if i % STREAM_EVERY == 0:
            k = 0
            before = j.recorded
            for tok in j.stream("tokens", functools.partial(tokens, ran=ran), i):
                h.update(tok.encode())
                recorded(f"s{i}.{k}", before)
                before = j.recorded
                k += 1
            recorded(f"e{i}", before)
        if sleep:
            time.sleep(sleep)
    j.flush()
    recorded("flush", j.recorded)
    return h.hexdigest()


class LineLog:
    """A log of lines, each written through at once (a SIGKILL loses none written)."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self(f"--- {os.getpid()}")

    def __call__(self, line: str) -> None:
        os.write(self.fd, (line + "\n").encode())


def reference(steps: int) -> str:
    """The hash of an uninterrupted run's values (in-process, on a fresh file store)."""
    from agck.journal import Journal
    with tempfile.TemporaryDirectory(prefix="agck-journal-ref-") as d:
        with Journal(os.path.join(d, "s"), "ref", commit="group") as j:
            return pipeline(j, steps, lambda _: None, lambda _: None)


def incarnations(path: str) -> list[list[str]]:
    """The lines of a log, one list per incarnation."""
    out: list[list[str]] = []
    try:
        with open(path) as f:
            for line in f.read().splitlines():
                if line.startswith("--- "):
                    out.append([])
                elif line and out:
                    out[-1].append(line)
    except FileNotFoundError:
        pass
    return out


def main(argv=None) -> int:
    url, run, d, commit, steps, sleep = (argv or sys.argv[1:])[:6]
    from agck.journal import Journal
    ran, ack = LineLog(os.path.join(d, "ran")), LineLog(os.path.join(d, "acks"))
    with Journal(url, run, commit=commit, every=4, ms=20) as j:
        digest = pipeline(j, int(steps), ran, ack, float(sleep))
        damaged = list(j.damaged)
    with open(os.path.join(d, "out.json"), "w") as f:
        json.dump({"hash": digest, "damaged": damaged}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
