"""Named fail points in the write paths, for the crash harness.

Switched on by the environment variable ``AGCK_FAILPOINTS``, e.g.
``AGCK_FAILPOINTS=file.before_rename=kill`` or ``pg.before_commit=kill@3``
(on the third hit). Actions: ``kill`` (SIGKILL this process), ``raise``
(an OSError(EIO), as a failing disk would), ``sleep:SECONDS``. Unset, ``hit``
is a function that returns at once: the write paths pay one call.
"""

from __future__ import annotations

import errno
import os
import signal
import time

ENV = "AGCK_FAILPOINTS"

# Every fail point the library defines; the crash campaign iterates over these.
POINTS = (
    "file.before_write", "file.mid_write", "file.before_fsync", "file.after_fsync",
    "file.before_rename", "file.after_rename", "file.after_dir_fsync",
    "file.chunk_before_fsync", "file.chunks_before_dir_fsync",
    "sqlite.before_insert", "sqlite.after_objects", "sqlite.before_commit", "sqlite.after_commit",
    "pg.before_copy", "pg.mid_copy", "pg.after_objects", "pg.before_manifest", "pg.before_commit", "pg.after_commit",
    "pgobj.after_upload",      # a Postgres catalog whose chunks are in an object store (agck_objects)
    "s3.before_chunks", "s3.mid_chunks", "s3.before_data", "s3.before_record", "s3.after_record",
    "snapshot.after_stage", "snapshot.before_ack",
    "dist.after_part", "dist.before_commit", "dist.after_commit",
    # a multi-rank job over a tiered store (agck.replicas): between replicas, local and durable commits
    "tier.after_replicas", "tier.after_local_commit", "tier.before_durable_commit",
    "gc.pg_doomed",            # a Postgres collector between its two transactions (agck_objects)
    # step-journal appends (agck.journal): the campaign's journal trials
    "journal.file.before_write", "journal.file.before_sync", "journal.file.after_sync",
    "journal.sqlite.before_commit", "journal.sqlite.after_commit",
    "journal.pg.before_append", "journal.pg.after_append",
    "journal.s3.before_put", "journal.s3.after_put",
)


def _parse(spec: str) -> dict[str, list]:
    table = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, action = item.partition("=")
        action = action or "kill"
        nth = 1
        if "@" in action:
            action, _, n = action.partition("@")
            nth = int(n)
        table[name] = [action, nth, 0]
    return table


_table = _parse(os.environ.get(ENV, ""))


def _hit(name: str) -> None:
    entry = _table.get(name)
    if entry is None:
        return
    entry[2] += 1
    if entry[2] < entry[1]:
        return
    action = entry[0]
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)  # the signal is delivered asynchronously on some kernels
    elif action == "raise":
        raise OSError(errno.EIO, f"fail point {name}")
    elif action.startswith("sleep:"):
        time.sleep(float(action[6:]))


def _noop(name: str) -> None:
    return None


hit = _hit if _table else _noop


def configure(spec: str) -> None:
    """Set fail points in this process (tests); '' switches them off."""
    global _table, hit
    _table = _parse(spec)
    hit = _hit if _table else _noop
