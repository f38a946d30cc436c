"""The power-cut shim (crashtests/powercut.c) and its cut, under Python, SQLite and Postgres.

A child process writes under the shim and is SIGKILLed (or exits); :func:`cut`
must then leave exactly the last synced content plus the mode's choice of what
came after. The SQLite tests show the layer has teeth: commits made with
``synchronous=OFF`` are lost, those made with ``synchronous=FULL`` never are.
"""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from crashtests import pgcluster, powercut

REASON = powercut.available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"power-cut shim unusable: {REASON}")


class KeepAll(random.Random):
    """Draws that keep every unsynced op and every created file (prefix, subset modes)."""

    def random(self):
        return 0.0

    def randrange(self, start, stop=None, step=1):
        return (start if stop is None else stop) - 1


SYNCDIR = """
def syncdir():
    fd = os.open(D, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
"""


def shim_run(code: str, d, log, *, kill: bool = True, timeout: float = 20) -> str:
    """Run Python ``code`` under the shim tracking ``d`` (``D`` in the code, a str;
    ``syncdir()`` fsyncs it).

    With ``kill`` the child is SIGKILLed once the code has run (it prints
    "ready" and waits); else it exits by itself. Returns its stdout.
    """
    script = f"import os, sys\nD = {str(d)!r}\n" + SYNCDIR + textwrap.dedent(code)
    if kill:
        script += "\nprint('ready', flush=True)\nimport time\ntime.sleep(60)\n"
    p = subprocess.Popen([sys.executable, "-c", script], env=powercut.env(os.environ, str(d), str(log)),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = []
    if kill:
        for line in p.stdout:
            if line.strip() == "ready":
                p.send_signal(signal.SIGKILL)
                break
            out.append(line)
    rest, err = p.communicate(timeout=timeout)
    if kill:
        assert p.returncode == -signal.SIGKILL, err
    else:
        assert p.returncode == 0, err
    return "".join(out) + rest


def tracked(tmp_path):
    """A directory for the shim to track, and its log beside it."""
    d = tmp_path / "d"
    d.mkdir()
    return d, tmp_path / "log"


def contents(d) -> dict:
    out = {}
    for parent, _, names in os.walk(d):
        for n in names:
            p = os.path.join(parent, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, d)] = f.read()
    return out


def durable_file(path, data: bytes) -> None:
    """A file made before the shim runs, synced with its directory."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Synced content, then unsynced changes of every kind: overwrite, extend, shrink,
# writev, truncate(path), O_TRUNC, fallocate, on files made before and under the shim.
MIXED = """
fd = os.open(D + "/old", os.O_RDWR)
os.pwrite(fd, b"X" * 300, 100)
os.writev(fd, [b"Y" * 10, b"Z" * 5000])
os.ftruncate(fd, 700)
os.pwrite(fd, b"W" * 100, 6000)
a = os.open(D + "/a", os.O_CREAT | os.O_WRONLY, 0o644)
os.write(a, b"A" * 1000)
os.fsync(a)
syncdir()
os.ftruncate(a, 10)
os.write(a, b"B" * 2000)
b = os.open(D + "/b", os.O_CREAT | os.O_RDWR, 0o644)
os.write(b, b"b" * 100)
os.ftruncate(b, 10000)
os.fdatasync(b)
syncdir()
os.pwrite(b, b"c" * 1500, 9000)
os.posix_fallocate(b, 0, 20000)
os.truncate(D + "/t", 5)
with open(D + "/w", "w") as f:
    f.write("rewritten")
"""


def mixed_setup(d) -> dict:
    durable_file(os.path.join(d, "old"), bytes(range(256)) * 20)
    durable_file(os.path.join(d, "t"), b"truncate me " * 100)
    durable_file(os.path.join(d, "w"), b"to be replaced " * 100)
    return {"old": bytes(range(256)) * 20, "t": b"truncate me " * 100, "w": b"to be replaced " * 100,
            "a": b"A" * 1000, "b": b"b" * 100 + bytes(9900)}


def test_drop_restores_exactly_the_last_synced_content(tmp_path):
    d, log = tracked(tmp_path)
    expected = mixed_setup(d)
    shim_run(MIXED, d, log)
    s = powercut.cut(str(d), str(log), "drop", random.Random(1))
    assert contents(d) == expected
    assert s["files"] == 5 and s["removed"] == 0 and s["dropped"] == s["unsynced"] > 0
    assert os.path.getsize(log) == len(powercut.HEADER)     # ready for the next run


@pytest.mark.parametrize("mode", ["prefix", "subset"])
def test_keeping_every_op_reproduces_the_files(tmp_path, mode):
    """Revert all, re-apply all: the files as the program left them, byte for byte."""
    d, log = tracked(tmp_path)
    mixed_setup(d)
    shim_run(MIXED, d, log)
    before = contents(d)
    s = powercut.cut(str(d), str(log), mode, KeepAll())
    assert contents(d) == before
    assert s["dropped"] == 0 and s["unsynced"] > 0


@pytest.mark.parametrize("mode", powercut.MODES)
def test_synced_bytes_survive_every_mode(tmp_path, mode):
    code = """
    fds = [os.open(D + "/f%d" % i, os.O_CREAT | os.O_RDWR, 0o644) for i in range(4)]
    for i, fd in enumerate(fds):
        os.write(fd, bytes([65 + i]) * (3000 + 700 * i))
        os.fsync(fd)
    syncdir()
    for k in range(20):
        for fd in fds:
            os.write(fd, bytes([97 + k]) * (100 + 300 * k))
    """
    for seed in range(3):
        d = tmp_path / str(seed)
        d.mkdir()
        log = tmp_path / f"log{seed}"
        shim_run(textwrap.dedent(code), d, log)
        powercut.cut(str(d), str(log), mode, random.Random(seed))
        for i in range(4):
            data = (d / f"f{i}").read_bytes()
            synced = bytes([65 + i]) * (3000 + 700 * i)
            assert data[:len(synced)] == synced
            # then unsynced write k at its place: whole; a hole (subset); or (torn, the
            # last) its first bytes up to a sector boundary
            pos, k = len(synced), 0
            while pos < len(data):
                n = 100 + 300 * k
                piece = data[pos:pos + n]
                whole = piece == bytes([97 + k]) * n
                hole = mode == "subset" and piece == bytes(n)
                torn = (mode == "torn" and pos + len(piece) == len(data) and len(piece) < n
                        and piece == bytes([97 + k]) * len(piece) and len(data) % 512 == 0)
                assert whole or hole or torn, (mode, seed, i, k)
                pos, k = pos + n, k + 1
            if mode == "drop":
                assert data == synced


def test_torn_write_stops_at_a_sector_boundary(tmp_path):
    d, log = tracked(tmp_path)
    durable_file(d / "f", b"a" * 4096)
    seen = set()
    for seed in range(6):
        shim_run('fd = os.open(D + "/f", os.O_WRONLY)\nos.pwrite(fd, b"b" * 3000, 100)\n', d, log)
        s = powercut.cut(str(d), str(log), "torn", random.Random(seed))
        assert s["torn"] == 1 and s["unsynced"] == 1
        with open(d / "f", "rb") as f:
            data = f.read()
        cut_at = 100 + data[100:].index(b"a")
        assert data == b"a" * 100 + b"b" * (cut_at - 100) + b"a" * (4096 - cut_at)
        assert cut_at % 512 == 0 and 100 < cut_at < 3100
        assert s["bytes_dropped"] == 3100 - cut_at
        seen.add(cut_at)
        durable_file(d / "f", b"a" * 4096)
    assert len(seen) > 1


@pytest.mark.parametrize("dirs", powercut.DIR_RULES)
def test_a_file_created_without_a_directory_fsync_is_lost(tmp_path, dirs):
    """Under POSIX only a directory fsync makes a new entry durable; on Linux's journaling
    file systems the file's own fsync does too. A file never fsync'd is lost under both."""
    d, log = tracked(tmp_path)
    code = """
    # a directory fsync makes every entry made before it durable: "kept" first
    for name, dirsync in (("kept", True), ("synced", False)):
        fd = os.open(D + "/" + name, os.O_CREAT | os.O_WRONLY, 0o644)
        os.write(fd, name.encode())
        os.fsync(fd)
        if dirsync:
            syncdir()
    fd = os.open(D + "/late", os.O_CREAT | os.O_WRONLY, 0o644)   # created after the last directory fsync
    os.write(fd, b"late")
    """
    shim_run(textwrap.dedent(code), d, log)
    s = powercut.cut(str(d), str(log), "drop", random.Random(0), dirs=dirs)
    if dirs == "posix":
        assert contents(d) == {"kept": b"kept"}
        assert s["removed"] == 2
    else:
        assert contents(d) == {"kept": b"kept", "synced": b"synced"}
        assert s["removed"] == 1


def test_files_outside_the_directory_are_untouched(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    out = tmp_path / "outside"
    out.mkdir()
    log = tmp_path / "log"
    durable_file(d / "in", b"synced")
    durable_file(out / "o", b"synced")
    code = f"""
    for p in (D + "/in", {str(out / "o")!r}):
        fd = os.open(p, os.O_WRONLY | os.O_APPEND)
        os.write(fd, b" and not")
    """
    shim_run(textwrap.dedent(code), d, log)
    records, _ = powercut.read_log(str(log))
    ino = os.stat(d / "in").st_ino
    assert {r.ino for r in records if r.type == powercut.WRITE} == {ino}
    powercut.cut(str(d), str(log), "drop", random.Random(0))
    assert (d / "in").read_bytes() == b"synced"
    assert (out / "o").read_bytes() == b"synced and not"


def test_append_writes(tmp_path):
    d, log = tracked(tmp_path)
    durable_file(d / "f", b"")
    code = """
    a = os.open(D + "/f", os.O_WRONLY | os.O_APPEND)
    b = os.open(D + "/f", os.O_RDWR | os.O_APPEND)
    os.write(a, b"hello ")
    os.fsync(a)
    os.write(b, b"world ")
    os.pwrite(a, b"pwrite-appends ", 0)     # Linux appends with O_APPEND, whatever the offset
    os.writev(b, [b"and ", b"more"])
    """
    shim_run(textwrap.dedent(code), d, log)
    assert (d / "f").read_bytes() == b"hello world pwrite-appends and more"
    powercut.cut(str(d), str(log), "prefix", KeepAll())
    assert (d / "f").read_bytes() == b"hello world pwrite-appends and more"
    shim_run('a = os.open(D + "/f", os.O_WRONLY | os.O_APPEND)\nos.write(a, b"!")\n', d, log, kill=False)
    powercut.cut(str(d), str(log), "drop")
    assert (d / "f").read_bytes() == b"hello world pwrite-appends and more"
    shim_run(textwrap.dedent(code), d, log)
    powercut.cut(str(d), str(log), "drop")
    assert (d / "f").read_bytes() == b"hello world pwrite-appends and more" + b"hello "


def test_a_failed_write_is_not_replayed(tmp_path):
    d, log = tracked(tmp_path)
    durable_file(d / "f", b"kept")
    code = """
    fd = os.open(D + "/f", os.O_RDONLY)
    try:
        os.write(fd, b"never")
    except OSError:
        pass
    """
    shim_run(textwrap.dedent(code), d, log)
    records, _ = powercut.read_log(str(log))
    assert [r.type for r in records] == [powercut.WRITE, powercut.RESULT]
    powercut.cut(str(d), str(log), "prefix", KeepAll())
    assert (d / "f").read_bytes() == b"kept"


def test_processes_forked_by_the_writer(tmp_path):
    d, log = tracked(tmp_path)
    code = """
    shared = os.open(D + "/shared", os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o644)
    syncdir()
    pid = os.fork()
    if pid == 0:
        own = os.open(D + "/child", os.O_CREAT | os.O_RDWR, 0o644)
        os.pwrite(own, b"c" * 5000, 0)
        os.fsync(own)
        syncdir()
        os.pwrite(own, b"C" * 100, 10)
        for i in range(300):
            os.write(shared, b"c%03d;" % i)
        os._exit(0)
    for i in range(300):
        os.write(shared, b"p%03d;" % i)
    os.waitpid(pid, 0)
    os.fsync(shared)
    os.write(shared, b"unsynced")
    """
    shim_run(textwrap.dedent(code), d, log)
    before = contents(d)
    records, _ = powercut.read_log(str(log))
    assert len({r.pid for r in records}) == 2
    powercut.cut(str(d), str(log), "subset", KeepAll())
    assert contents(d) == before
    # the log was emptied: write it all again, then drop
    for name in ("shared", "child"):
        os.unlink(d / name)
    shim_run(textwrap.dedent(code), d, log)
    powercut.cut(str(d), str(log), "drop")
    after = contents(d)
    assert after["child"] == b"c" * 5000
    shared = after["shared"]
    assert len(shared) == 600 * 5
    assert sorted(shared.split(b";")[:-1]) == sorted([b"c%03d" % i for i in range(300)] +
                                                     [b"p%03d" % i for i in range(300)])


def test_synchronous_writes_are_durable_when_they_return(tmp_path):
    d, log = tracked(tmp_path)
    durable_file(d / "f", b"." * 3000)
    code = """
    plain = os.open(D + "/f", os.O_WRONLY)
    dsync = os.open(D + "/f", os.O_WRONLY | os.O_DSYNC)
    os.pwrite(plain, b"p" * 100, 0)
    os.pwrite(dsync, b"s" * 100, 1000)
    os.pwritev(plain, [b"r" * 100], 2000, os.RWF_DSYNC)
    os.pwrite(plain, b"p" * 100, 2500)
    """
    shim_run(textwrap.dedent(code), d, log)
    s = powercut.cut(str(d), str(log), "drop")
    assert (d / "f").read_bytes() == b"." * 1000 + b"s" * 100 + b"." * 900 + b"r" * 100 + b"." * 900
    assert s["unsynced"] == 4 and s["dropped"] == 2


def test_punched_holes_are_writes_of_zeros(tmp_path):
    d, log = tracked(tmp_path)
    durable_file(d / "f", b"z" * 20000)
    code = """
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    fd = os.open(D + "/f", os.O_RDWR)
    if libc.fallocate(fd, 1 | 2, 4096, 8192) != 0:      # KEEP_SIZE | PUNCH_HOLE
        print("unsupported", flush=True)
    """
    out = shim_run(textwrap.dedent(code), d, log)
    if "unsupported" in out:
        pytest.skip("this file system cannot punch holes")
    assert (d / "f").read_bytes() == b"z" * 4096 + bytes(8192) + b"z" * 7712
    records, _ = powercut.read_log(str(log))
    assert [(r.type, r.flags, r.offset, r.length, len(r.data)) for r in records] == \
        [(powercut.WRITE, powercut.ZEROS, 4096, 8192, 0)]
    powercut.cut(str(d), str(log), "drop")
    assert (d / "f").read_bytes() == b"z" * 20000


def test_the_log_outlives_a_program_closing_every_fd(tmp_path):
    d, log = tracked(tmp_path)
    durable_file(d / "f", b"synced")
    code = """
    fd = os.open(D + "/f", os.O_WRONLY)
    os.write(fd, b"1")
    os.closerange(3, 4096)              # the shim's log fd among them
    fds = [os.open(D + "/g%d" % i, os.O_CREAT | os.O_WRONLY, 0o644) for i in range(3)]
    fd = os.open(D + "/f", os.O_WRONLY | os.O_APPEND)
    os.write(fd, b"2")
    """
    shim_run(textwrap.dedent(code), d, log)
    records, _ = powercut.read_log(str(log))
    assert [r.type for r in records] == [powercut.WRITE] + [powercut.CREATE] * 3 + [powercut.WRITE]
    powercut.cut(str(d), str(log), "drop")
    assert contents(d) == {"f": b"synced"}


def test_a_record_torn_by_a_kill_is_skipped(tmp_path):
    d, log = tracked(tmp_path)
    shim_run('fd = os.open(D + "/f", os.O_CREAT | os.O_WRONLY, 0o644)\n'
             'os.write(fd, b"x" * 9000)\nos.write(fd, b"y" * 100)\n', d, log)
    with open(log, "rb") as f:
        raw = f.read()
    records, skipped = powercut.read_log(str(log))
    assert skipped == 0 and [r.type for r in records] == [powercut.CREATE, powercut.WRITE, powercut.WRITE]
    # a second copy of the big record, cut short, before the last one: a writer killed mid-append
    big = raw.index(b"x" * 9000) - 32 - 48
    last = raw.rindex(b"APCR")
    with open(log, "wb") as f:
        f.write(raw[:last] + raw[big:big + 5000] + raw[last:])
    again, skipped = powercut.read_log(str(log))
    assert skipped == 5000
    assert [(r.type, bytes(r.data)) for r in again] == [(r.type, bytes(r.data)) for r in records]


# -- SQLite: the layer has teeth ------------------------------------------------------------------

SQLITE_WRITER = """
import sqlite3
conn = sqlite3.connect(D + "/db.sqlite", isolation_level=None)
conn.execute("PRAGMA synchronous=" + sys.argv[1])
start = int(sys.argv[2])
for i in range(start, start + 100000):
    conn.execute("BEGIN")
    conn.execute("INSERT INTO t VALUES (?, ?)", (i, "row %d " % i * 20))
    conn.execute("COMMIT")
    print(i, flush=True)
"""


def sqlite_setup(d) -> str:
    path = os.path.join(d, "db.sqlite")
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, pad TEXT)")
    conn.commit()
    conn.close()
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    durable_file(os.path.join(d, ".sync"), b"")
    return path


def sqlite_run(d, log, sync: str, start: int, *, acks: int | None = None, after: float = 0.0) -> list[int]:
    """Run the writer until ``acks`` commits were acknowledged, or for ``after``
    seconds past the first; SIGKILL it; the ids it acknowledged."""
    p = subprocess.Popen([sys.executable, "-c", f"import os, sys\nD = {str(d)!r}\n" + SQLITE_WRITER, sync,
                          str(start)], env=powercut.env(os.environ, str(d), str(log)),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    acked: list[int] = []
    deadline = None
    for line in p.stdout:
        acked.append(int(line))
        if deadline is None:
            deadline = time.monotonic() + after
        if (acks is not None and len(acked) >= acks) or (acks is None and time.monotonic() >= deadline):
            break
    p.send_signal(signal.SIGKILL)
    rest, err = p.communicate(timeout=20)
    assert p.returncode == -signal.SIGKILL, err
    # a line the writer printed before the kill is an acknowledgement too
    acked += [int(x) for x in rest.split("\n") if x.strip().isdigit()]
    return acked


def sqlite_rows(path: str) -> tuple[set, str]:
    conn = sqlite3.connect(path)
    try:
        ids = {r[0] for r in conn.execute("SELECT id FROM t")}
        return ids, conn.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        conn.close()


def test_sqlite_without_fsync_loses_acknowledged_commits(tmp_path):
    d, log = tracked(tmp_path)
    path = sqlite_setup(d)
    acked = sqlite_run(d, log, "OFF", 0, acks=50)
    assert len(acked) >= 50
    s = powercut.cut(str(d), str(log), "drop", random.Random(0))
    ids, ok = sqlite_rows(path)
    assert len(ids) < len(acked), s
    assert ok == "ok"


def test_sqlite_with_fsync_keeps_every_acknowledged_commit(tmp_path):
    d, log = tracked(tmp_path)
    path = sqlite_setup(d)
    rng = random.Random(20240601)
    acked: set[int] = set()
    unsynced = 0
    for i in range(20):
        mode = powercut.MODES[i % len(powercut.MODES)]
        acked.update(sqlite_run(d, log, "FULL", i * 100000, after=rng.uniform(0.0, 0.1)))
        s = powercut.cut(str(d), str(log), mode, rng)
        unsynced += s["unsynced"]
        ids, ok = sqlite_rows(path)
        assert ok == "ok", (i, mode, s)
        assert acked <= ids, (i, mode, sorted(acked - ids)[:10], s)
    assert unsynced > 0        # the kills did land between a write and its fsync


# -- Postgres: every process of a server under the shim ------------------------------------------

NO_PG = pytest.mark.skipif(pgcluster.available() is not None, reason=f"no private Postgres: {pgcluster.available()}")


def pg_commits_then_cut(pg, mode: str, rng: random.Random, base: int) -> tuple[list[int], set[int], dict]:
    """Rows committed one by one (each acknowledged when its INSERT returns) until the
    server is SIGKILLed at a random instant; the cut; the restart. (acked, rows found, cut)."""
    import psycopg2
    acked: list[int] = []
    stop = threading.Event()

    def writer():
        conn = psycopg2.connect(pg.dsn())
        conn.autocommit = True
        cur = conn.cursor()
        try:
            for i in range(base, base + 100000):
                if stop.is_set():
                    return
                cur.execute("INSERT INTO t VALUES (%s, %s)", (i, "x" * 200))
                acked.append(i)
        except psycopg2.Error:
            pass          # the server was killed under the commit
        finally:
            conn.close()

    t = threading.Thread(target=writer)
    t.start()
    time.sleep(rng.uniform(0.2, 0.5))
    pg.kill("sigkill")
    stop.set()
    t.join(30)
    s = pg.cut(mode, rng)
    pg.restart()
    conn = psycopg2.connect(pg.dsn())
    try:
        cur = conn.cursor()
        cur.execute("SELECT id FROM t")
        return acked, {r[0] for r in cur.fetchall()}, s
    finally:
        conn.close()


@NO_PG
def test_postgres_keeps_every_acknowledged_commit():
    from crashtests.pgpower import PowerCluster
    rng = random.Random(7)
    # crash recovery fsyncs every file of the data directory one by one unless told to syncfs
    pg = PowerCluster(settings={"recovery_init_sync_method": "syncfs"}).start()
    try:
        pg.execute("CREATE TABLE t (id int PRIMARY KEY, pad text)")
        acked: list[int] = []
        for n, mode in enumerate(powercut.MODES):
            got, ids, s = pg_commits_then_cut(pg, mode, rng, n * 100000)
            acked += got
            assert s["records"] > 0
            assert set(acked) <= ids, (mode, s, pg.log_tail())
        assert len(acked) > 20
    finally:
        pg.destroy()


@NO_PG
def test_postgres_without_fsync_loses_acknowledged_commits():
    """The layer has teeth under Postgres: with ``fsync=off`` (set after the table was made
    durable) the commits it acknowledged were only written, and the cut takes them."""
    from crashtests.pgpower import PowerCluster
    pg = PowerCluster(settings={"recovery_init_sync_method": "syncfs"}).start()
    try:
        pg.execute("CREATE TABLE t (id int PRIMARY KEY, pad text)")
        pg.execute("CHECKPOINT")
        pg.execute("ALTER SYSTEM SET fsync = off")
        pg.execute("SELECT pg_reload_conf()")
        acked, ids, s = pg_commits_then_cut(pg, "drop", random.Random(3), 0)
        assert len(acked) > 20
        assert len(set(acked) - ids) > 0, s
    finally:
        pg.destroy()
