"""A primary and a streaming standby: two private Postgres clusters the harness owns and fails over.

Both clusters are :class:`crashtests.pgcluster.PgCluster` (initdb as the ``postgres``
OS user, private sockets, fsync on, the shared server never contacted). The
standby is a ``pg_basebackup -R`` copy of the primary that streams its WAL
(``application_name`` ``agck_standby``). With ``synchronous=True`` the primary lists
it in ``synchronous_standby_names`` and a COMMIT returns only once the standby has
flushed it (``synchronous_commit=on``); with ``synchronous=False`` the standby
lags by whatever the WAL sender had not sent yet.

The two nodes keep their socket directory and port for life, so one multi-host
URL (:meth:`PgPair.dsn`: ``host=A,B``, ``target_session_attrs=read-write``) reaches
whichever is primary. :meth:`PgPair.failover` SIGKILLs the primary, promotes the
standby, and rebuilds the dead node as the new primary's standby, from a fresh
base backup (the dead primary's data may hold commits the new one never saw, so
it is never restarted as it was).
"""

from __future__ import annotations

import os
import shutil
import time

from .pgcluster import BINDIR, PgCluster, free_port

STANDBY_NAME = "agck_standby"


class PgPair:
    def __init__(self, *, synchronous: bool = True, settings: dict | None = None):
        self.synchronous = synchronous
        self.settings = dict(settings or {})
        self.settings.update({"wal_level": "replica", "max_wal_senders": 5, "hot_standby": "on",
                              "wal_keep_size": "'64MB'", "synchronous_commit": "on",
                              "synchronous_standby_names": f"'{STANDBY_NAME}'" if synchronous else "''",
                              "wal_receiver_status_interval": "'1s'",
                              # a node restarted after a kill syncs its data directory in one call, not file by file
                              "recovery_init_sync_method": "syncfs"})
        self.nodes: list[PgCluster] = []
        self.primary = 0             # index in nodes of the current primary
        self.failovers = 0

    @property
    def standby(self) -> PgCluster:
        return self.nodes[1 - self.primary]

    @property
    def leader(self) -> PgCluster:
        return self.nodes[self.primary]

    def dsn(self, db: str = "postgres") -> str:
        """One URL for both nodes: libpq tries them in turn and keeps the one that accepts writes."""
        hosts = ",".join(n.sockdir for n in self.nodes)
        ports = ",".join(str(n.port) for n in self.nodes)
        return f"postgresql://postgres@/{db}?host={hosts}&port={ports}&target_session_attrs=read-write"

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, databases: tuple = ()) -> "PgPair":
        first = PgCluster(settings=self.settings).start()
        self.nodes = [first]
        try:
            second = PgCluster(settings=self.settings)
            second.make_base()          # its directory, socket and port, kept across rebuilds
            second.port = free_port()
            self.nodes.append(second)
            self._clone(first, second)
            for db in databases:     # after the standby joined: a synchronous primary waits for it
                first.create_db(db)
            # replayed there too: libpq tries no further host after one that refuses the database
            self.wait_replayed()
        except BaseException:
            self.destroy()
            raise
        return self

    def _clone(self, source: PgCluster, node: PgCluster) -> None:
        """``node`` (stopped, its data gone) becomes a streaming standby of ``source``."""
        r = node._as_pg(f"{BINDIR}/pg_basebackup", "-D", node.data, "-h", source.sockdir, "-p", str(source.port),
                        "-U", "postgres", "-R", "-X", "stream", "-c", "fast", "--no-sync", check=False,
                        timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"pg_basebackup failed: {r.stderr.strip()[-2000:]}")
        # the copy carries the source's settings: its own port and socket, and a connection to the
        # source that names it as the standby the primary waits for
        with open(os.path.join(node.data, "postgresql.auto.conf"), "a") as f:
            f.write(f"port = {node.port}\nunix_socket_directories = '{node.sockdir}'\n"
                    f"primary_conninfo = 'host={source.sockdir} port={source.port} user=postgres "
                    f"application_name={STANDBY_NAME}'\n")
        # --no-sync above saves seconds a trial; the standby's files are made durable once, here
        node._as_pg("sync", "-f", node.data, check=False)
        node.proc = None
        node.launch()
        self._wait_streaming(source)

    def _wait_streaming(self, primary: PgCluster, timeout: float = 60.0) -> None:
        """Until the primary sees its standby streaming (and, if synchronous, as its sync standby)."""
        import psycopg2
        want = "sync" if self.synchronous else "async"
        deadline = time.monotonic() + timeout
        state = None
        while time.monotonic() < deadline:
            conn = psycopg2.connect(primary.dsn(), connect_timeout=5)
            try:
                cur = conn.cursor()
                cur.execute("SELECT state, sync_state FROM pg_stat_replication WHERE application_name = %s",
                            (STANDBY_NAME,))
                state = cur.fetchone()
            finally:
                conn.close()
            if state == ("streaming", want):
                return
            time.sleep(0.05)
        raise RuntimeError(f"the standby did not start streaming ({state}): {self.standby.log_tail()}")

    def wait_replayed(self, timeout: float = 60.0) -> None:
        """Until the standby has replayed everything the primary has written so far."""
        import psycopg2
        conn = psycopg2.connect(self.leader.dsn(), connect_timeout=5)
        try:
            cur = conn.cursor()
            cur.execute("SELECT pg_current_wal_lsn()")
            lsn = cur.fetchone()[0]
        finally:
            conn.close()
        deadline = time.monotonic() + timeout
        conn = psycopg2.connect(self.standby.dsn(), connect_timeout=5)
        try:
            cur = conn.cursor()
            while True:
                cur.execute("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (lsn,))
                if cur.fetchone()[0]:
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the standby has not replayed up to {lsn} after {timeout:g} s")
                time.sleep(0.02)
        finally:
            conn.close()

    def failover(self) -> dict:
        """SIGKILL the primary, promote the standby, rebuild the old primary as the new standby.
        Returns seconds per phase."""
        old, new = self.leader, self.standby
        t0 = time.perf_counter()
        old.kill("sigkill")
        t1 = time.perf_counter()
        self.promote(new)
        t2 = time.perf_counter()
        self.primary = 1 - self.primary
        self.failovers += 1
        shutil.rmtree(old.data, ignore_errors=True)
        self._clone(new, old)
        t3 = time.perf_counter()
        return {"kill": t1 - t0, "promote": t2 - t1, "rebuild": t3 - t2}

    @staticmethod
    def promote(node: PgCluster, timeout: float = 60.0) -> None:
        r = node._as_pg(f"{BINDIR}/pg_ctl", "-D", node.data, "promote", "-w", "-t", str(int(timeout)),
                        check=False)
        if r.returncode != 0:
            raise RuntimeError(f"pg_ctl promote failed: {r.stderr.strip()[-1000:]} {node.log_tail()}")

    def revive(self) -> None:
        """After a harness failure: a running primary with a streaming standby again."""
        if self.leader.proc is None or self.leader.proc.poll() is not None:
            if self.standby.proc is not None and self.standby.proc.poll() is None:
                self.promote(self.standby)
                self.primary = 1 - self.primary
            else:
                self.leader.launch()
        if self.standby.proc is None or self.standby.proc.poll() is not None:
            self.standby.stop()
            shutil.rmtree(self.standby.data, ignore_errors=True)
            self._clone(self.leader, self.standby)

    def destroy(self) -> None:
        for n in self.nodes:
            n.destroy()
        self.nodes = []

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.destroy()
