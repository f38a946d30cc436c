"""A store of its own for each trial of the large profile: made empty, judged, checked by the CLI, dropped.

Content addressing lets a checkpoint list a chunk any earlier checkpoint of the store
wrote. On one store shared by the trials, every trial after the first would find the
large profile's tensors stored already and write only their listings: no later kill,
server kill or power cut would land in the middle of a large write. So a large trial
gets an empty store of its own, of its store's kind and on the campaign's servers: a
directory, a SQLite file, Postgres tables of a prefix of their own, an object store
prefix, or both of the last two (``pgs3``).

A few hundred such stores of 200-300 MiB would fill the disk, so a store is dropped
once its trial is judged and `agck recover` has cross-checked it (a few stores per
interpreter, as :meth:`crashtests.trialkit.TrialKit.cli_check` does at the end). Kept
to the end are the stores of the first trials of each (store, fault) whose fault was
delivered, for the resumes and for the rechecks after a server kill, and every store
whose trial does not look ok or indeterminate so far, as evidence.

Contract: :meth:`TrialStores.url` makes a store (the Postgres tables, so the workload
need not) and returns its URL; :meth:`TrialStores.done` takes a judged trial and,
every :data:`BATCH` trials, cross-checks and drops their stores; :meth:`TrialStores.gone`
says whether a URL's store was dropped. A URL not made here (a shared store) is left alone.
"""

from __future__ import annotations

import copy
import os
import shutil
import threading
from collections import Counter

from . import checker

BATCH = 4                                         # stores cross-checked per `agck recover` interpreter
KEPT = ("kill", "failpoint", "pgkill", "s3kill")  # resumed at the end, or read again after a server kill


class TrialStores:
    def __init__(self, c):
        self.c = c
        self._lock = threading.Lock()
        self._n = 0
        self._drop: dict[str, list] = {}     # url -> what removes that store: ("dir"|"sqlite"|"tables"|"objects", arg)
        self._gone: set[str] = set()
        self._pending: list = []
        self._kept: Counter = Counter()

    def url(self, store: str, db: str = "crash") -> str:
        """An empty store of kind ``store`` for one trial (Postgres tables in database ``db``)."""
        c = self.c
        with self._lock:
            self._n += 1
            name = f"own{self._n}"
        root = os.path.join(c.work, "own")
        os.makedirs(root, exist_ok=True)
        if store == "file":
            url = os.path.join(root, name)
            drop = [("dir", url)]
        elif store == "sqlite":
            url = f"sqlite:///{root}/{name}.db"
            drop = [("sqlite", os.path.join(root, f"{name}.db"))]
        elif store == "s3":
            url = c.s3_url(name)
            drop = [("objects", url)]
        elif store == "postgres":
            url = c.cluster.dsn(db) + f"&agck_prefix={name}"
            drop = [("tables", (db, name))]
        elif store == "pgs3":
            url = c.catalog_url(db, name, f"{name}-objects")
            drop = [("tables", (db, name)), ("objects", c.s3_url(f"{name}-objects"))]
        else:
            raise ValueError(f"unknown store {store!r}")
        if store in ("postgres", "pgs3"):
            from agck.stores import open_store
            open_store(url, init=True).close()
        with self._lock:
            self._drop[url] = drop
        return url

    def gone(self, url: str) -> bool:
        return url in self._gone

    def summary(self) -> str | None:
        """A line for the report: how many stores were made and dropped; None when none was made."""
        if not self._n:
            return None
        return (f"{self._n} trial stores of their own: {len(self._gone)} dropped after their "
                f"`agck recover` cross-check, {sum(self._kept.values())} kept for the resumes and rechecks")

    def done(self, t) -> None:
        """Trial ``t`` is judged: its store is kept, or queued to be cross-checked and dropped."""
        if t.url not in self._drop:
            return
        with self._lock:
            key = (t.store, t.fault)
            if t.fault in KEPT and t.reached and t.recovered != "raised" \
                    and self._kept[key] < max(1, self.c.cfg.resume_samples):
                self._kept[key] += 1
                return
            self._pending.append(t)
            if len(self._pending) < BATCH:
                return
            batch, self._pending = self._pending, []
        self._check_and_drop(batch)

    def _check_and_drop(self, batch: list) -> None:
        self.c.cli_check({t.url: [t] for t in batch})
        for t in batch:
            # judged as the campaign will judge it (on a copy: the cross-check is not the end)
            if checker.classify(copy.deepcopy(t)) in ("ok", "indeterminate"):
                self._remove(t.url)

    def _remove(self, url: str) -> None:
        with self._lock:
            drop = self._drop.pop(url, None)
            self._gone.add(url)
        for kind, arg in drop or ():
            if kind == "dir":
                shutil.rmtree(arg, ignore_errors=True)
            elif kind == "sqlite":
                for suffix in ("", "-wal", "-shm", "-journal"):
                    if os.path.exists(arg + suffix):
                        os.unlink(arg + suffix)
            elif kind == "objects":
                from agck.stores.s3.client import ObjectClient
                client = ObjectClient(arg)
                for obj in list(client.list("")):
                    client.delete(obj.key)
            else:
                _drop_tables(self.c.cluster, *arg)


def _drop_tables(cluster, db: str, prefix: str) -> None:
    """Drop the tables of an agck Postgres store of table prefix ``prefix``."""
    import psycopg2
    conn = psycopg2.connect(cluster.dsn(db))
    conn.autocommit = True
    try:
        cur = conn.cursor()
        cur.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public' AND tablename LIKE %s",
                    (prefix.replace("_", r"\_") + r"\_%",))
        names = [r[0] for r in cur.fetchall()]
        if names:
            cur.execute("DROP TABLE IF EXISTS " + ", ".join(f'"{n}"' for n in names) + " CASCADE")
    finally:
        conn.close()
