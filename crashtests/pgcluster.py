"""A throwaway Postgres cluster that the crash harness owns and may kill.

initdb into a fresh temp directory owned by the ``postgres`` OS user, a free
port that is not 5432, a private unix socket directory, no TCP listener, fsync
on. ``postgres`` runs as the session leader of its own process group (started
by us through ``runuser``), so killing that group reaches the postmaster and
every backend and nothing else. Only PIDs this object started are signalled;
the shared server on 127.0.0.1:5432 is never contacted.
"""

from __future__ import annotations

import atexit
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time

BINDIR = os.environ.get("AGCK_PG_BINDIR", "/usr/lib/postgresql/15/bin")
OS_USER = "postgres"


def available() -> str | None:
    """None when a private cluster can be started here, else the reason it cannot."""
    if os.geteuid() != 0:
        return "runuser needs root"
    if not shutil.which("runuser"):
        return "runuser not found"
    for b in ("initdb", "postgres", "pg_ctl"):
        if not os.access(os.path.join(BINDIR, b), os.X_OK):
            return f"{BINDIR}/{b} not found"
    try:
        pwd.getpwnam(OS_USER)
    except KeyError:
        return f"no {OS_USER!r} OS user"
    try:
        import psycopg2  # noqa: F401
    except ImportError:
        return "psycopg2 not installed"
    return None


def free_port() -> int:
    """A port nobody listens on (and never 5432, the shared server's)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port != 5432 and not os.path.exists(f"/tmp/.s.PGSQL.{port}"):
            return port
    raise RuntimeError("no free port found")


def _descendants(root: int) -> list[int]:
    """PIDs descending from ``root`` (a process we started), from /proc."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo and len(out) < 10000:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


class PgCluster:
    def __init__(self, *, settings: dict | None = None, start_timeout: float = 60.0):
        self.settings = settings or {}
        self.start_timeout = start_timeout
        self.base: str | None = None
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.kills = 0
        self._log = None

    # -- paths -----------------------------------------------------------------
    @property
    def data(self) -> str:
        return os.path.join(self.base, "data")

    @property
    def sockdir(self) -> str:
        return os.path.join(self.base, "sock")

    def dsn(self, db: str = "postgres") -> str:
        return f"postgresql://postgres@/{db}?host={self.sockdir}&port={self.port}"

    def _as_pg(self, *argv, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["runuser", "-u", OS_USER, "--", *argv], capture_output=True, text=True,
                              timeout=timeout, check=check, cwd="/")

    # -- lifecycle ---------------------------------------------------------------
    def make_base(self) -> None:
        """The cluster's directory and socket directory, owned by the ``postgres`` user."""
        # a short path: unix socket paths are limited to ~107 bytes
        self.base = tempfile.mkdtemp(prefix="agckpg-", dir="/tmp")
        atexit.register(self.destroy)
        pw = pwd.getpwnam(OS_USER)
        os.chown(self.base, pw.pw_uid, pw.pw_gid)
        os.mkdir(self.sockdir, 0o700)
        os.chown(self.sockdir, pw.pw_uid, pw.pw_gid)

    def start(self) -> "PgCluster":
        reason = available()
        if reason:
            raise RuntimeError(f"cannot start a private Postgres cluster: {reason}")
        self.make_base()
        # fsync stays on (the default): the crash tests are meaningless without it
        r = self._as_pg(f"{BINDIR}/initdb", "-D", self.data, "-U", "postgres", "--auth=trust",
                        "-E", "UTF8", "--no-instructions", check=False)
        if r.returncode != 0:
            raise RuntimeError(f"initdb failed: {r.stderr.strip()[-2000:]}")
        self.port = free_port()
        conf = {"port": self.port, "listen_addresses": "''", "unix_socket_directories": f"'{self.sockdir}'",
                "fsync": "on", "synchronous_commit": "on", "full_page_writes": "on",
                "shared_buffers": "'32MB'", "max_connections": 30, "logging_collector": "off",
                "max_wal_size": "'256MB'", "restart_after_crash": "off"}
        conf.update(self.settings)
        with open(os.path.join(self.data, "postgresql.auto.conf"), "a") as f:
            for k, v in conf.items():
                f.write(f"{k} = {v}\n")
        self.launch()
        return self

    def launch(self) -> None:
        """Start (or restart after a kill: crash recovery replays the WAL) and wait until it answers."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("the cluster is already running")
        self._log = open(os.path.join(self.base, "server.log"), "ab")
        self.proc = subprocess.Popen(["runuser", "-u", OS_USER, "--", f"{BINDIR}/postgres", "-D", self.data],
                                     stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, cwd="/")
        self.wait_ready()

    def wait_ready(self) -> None:
        import psycopg2
        deadline = time.monotonic() + self.start_timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"postgres exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                psycopg2.connect(self.dsn(), connect_timeout=2).close()
                return
            except psycopg2.OperationalError as e:
                last = e
                time.sleep(0.05)
        raise RuntimeError(f"postgres did not become ready: {last}; {self.log_tail()}")

    def postmaster_pid(self) -> int | None:
        try:
            with open(os.path.join(self.data, "postmaster.pid")) as f:
                return int(f.readline().strip())
        except (OSError, ValueError):
            return None

    def _own_group(self) -> int:
        """The process group we started, after checking the postmaster of our data dir is in it."""
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError("the cluster is not running")
        pgid = self.proc.pid          # start_new_session: our child leads its own group
        pm = self.postmaster_pid()
        if pm is not None:
            try:
                if os.getpgid(pm) != pgid:
                    raise RuntimeError(f"postmaster {pm} is not in the process group {pgid} we started")
            except ProcessLookupError:
                pass
        if pgid <= 1 or pgid == os.getpgrp():
            raise RuntimeError(f"refusing to signal process group {pgid}")
        return pgid

    def kill(self, method: str = "sigkill") -> None:
        """Crash the server: SIGKILL to its whole process group, or ``pg_ctl stop -m immediate``."""
        if method == "immediate":
            self._own_group()
            r = self._as_pg(f"{BINDIR}/pg_ctl", "-D", self.data, "stop", "-m", "immediate", "-w", "-t", "30",
                            check=False)
            if r.returncode != 0:
                method = "sigkill"   # fall through to the hard way
        if method == "sigkill":
            pgid = self._own_group()
            # Postgres puts each backend in its own session, so the group holds only runuser and the
            # postmaster: list the postmaster's descendants before it dies and they are re-parented.
            victims = _descendants(pgid)
            os.killpg(pgid, signal.SIGKILL)
            for pid in victims:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self._wait_pids_gone(victims)
        self.proc.wait(timeout=30)
        self._wait_group_gone(self.proc.pid)
        self.kills += 1

    def _wait_pids_gone(self, pids: list[int], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        for pid in pids:
            while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                            break   # a zombie holds nothing; its new parent reaps it
                except OSError:
                    break
                time.sleep(0.01)

    def _wait_group_gone(self, pgid: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            except PermissionError:
                return
            time.sleep(0.02)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def restart(self) -> float:
        t0 = time.perf_counter()
        self.launch()
        return time.perf_counter() - t0

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self._as_pg(f"{BINDIR}/pg_ctl", "-D", self.data, "stop", "-m", "fast", "-w", "-t", "30", check=False)
            self.proc.wait(timeout=30)
        except Exception:
            pass
        if self.proc.poll() is None:
            try:
                os.killpg(self._own_group(), signal.SIGKILL)
                self.proc.wait(timeout=30)
            except Exception:
                pass
        self._wait_group_gone(self.proc.pid, 10)

    def destroy(self) -> None:
        """Stop the server and remove every file of the cluster (idempotent)."""
        try:
            self.stop()
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None
            if self.base and os.path.isdir(self.base):
                shutil.rmtree(self.base, ignore_errors=True)
            self.base = None
            atexit.unregister(self.destroy)

    def log_tail(self, n: int = 2000) -> str:
        try:
            with open(os.path.join(self.base, "server.log"), "rb") as f:
                return f.read()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""

    # -- convenience ---------------------------------------------------------------
    def execute(self, sql: str, db: str = "postgres") -> None:
        import psycopg2
        conn = psycopg2.connect(self.dsn(db), connect_timeout=10)
        try:
            conn.autocommit = True
            conn.cursor().execute(sql)
        finally:
            conn.close()

    def create_db(self, name: str, settings: dict | None = None) -> str:
        self.execute(f"CREATE DATABASE {name}")
        for k, v in (settings or {}).items():
            self.execute(f"ALTER DATABASE {name} SET {k} = {v}")
        return self.dsn(name)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.destroy()
