#!/usr/bin/env python
"""Benchmark agck's stores against the raw operations beneath them.

    python scripts/bench_stores.py [--size-mb 256] [--repeats 5] [--dsn DSN] [--json OUT]
                                   [--dir DIR] [--warmup 1] [--small-n 200] [--recover-n 10000]

One process. A ~--size-mb MiB state of float32 torch tensors is encoded once
with agck.checkpoint.encode and its parts joined into one bytes object: the
raw baselines move exactly those container bytes, cut into the same 64 MiB
chunk rows the Postgres store writes.

- Postgres put vs raw ``COPY t(data) FROM STDIN (FORMAT binary)`` (the stream
  generated and cut into pieces before the clock starts) and vs the naive
  ``INSERT ... VALUES (%s)`` with psycopg2.Binary, each one transaction with
  synchronous_commit=on.
- Postgres get(verify=True) vs raw ``COPY (SELECT data ...) TO STDOUT (FORMAT
  binary)`` into a sink that discards.
- file store put vs raw write+fsync+directory fsync in the same directory;
  SQLite put/get and file get for information.
- 10 KB checkpoints: put latency, medians over --small-n puts per store.
- recover_run over --recover-n checkpoints whose newest 100 are corrupt.

Every store is measured in two modes, each a store of its own: opened with
``incremental=False`` (standalone containers, the layout ``agck.save`` writes),
and in the default mode (``incremental=True``, what ``agck.open_store(url)``
gives: checkpoints as listings of content-addressed chunks), the "(incremental)"
rows. Each put moves all its bytes, like the baselines: the incremental store is
given a state of new random values each round (refilled outside the clock), so
every chunk is new; an unchanged state, of which it writes only the listing, is
bench_incremental.py's.

Every checkpoint a put wrote is read back, outside the clock, through a store
object of its own and compared bit for bit with what was put (benchio.readback):
each large put's before its step is deleted, the fixtures and the 10 KB puts at
the end of their phases. The first that differs or does not verify ends the run,
status 1.

Every round runs every case once, order rotated each round, so drift on a
shared machine spreads over all cases; tables quote medians of --repeats
rounds and ratios of those medians (>1: the first is faster). Every write is
of a fresh step; deletes, TRUNCATE, VACUUM, CHECKPOINT and sync happen
between cases, outside the clock. Everything created (a Postgres schema named
bench_<hex>, a temp directory) is dropped at the end.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import platform
import secrets
import shutil
import sqlite3
import statistics
import struct
import sys
import tempfile
import time

import numpy as np

from benchio import Case, raw_write_fsync, read_back_note, readback, run_rounds  # noqa: E402
import psycopg2
import torch

# Run from a checkout without installing: scripts/ is sys.path[0], the package is one up.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from agck import checkpoint, open_store  # noqa: E402
from agck.recovery import recover_run  # noqa: E402
from agck.stores.file.store import FileStore  # noqa: E402
from agck.stores.postgres.store import COPY_IO_SIZE, PostgresStore  # noqa: E402
from agck import format as agck_format  # noqa: E402
from agck.stores.sqlite.store import SqliteStore  # noqa: E402
from agck.stores.sqlrows import DEFAULT_CHUNK_SIZE, manifest_checksum, meta_json_text  # noqa: E402

MiB = 1 << 20
ROW = 1024
RUN = "bench"
RUN_RECOVER = "bench-recover"
CORRUPT = 100
DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"


# --- states -----------------------------------------------------------------------------

def build_state(total_bytes: int, seed: int = 0) -> dict:
    """8 blocks of 4 matrices and a bias, plus an embedding: 41 float32 tensors. Random
    values, so nothing below (TOAST compression is off anyway) can shortcut them."""
    rng = np.random.default_rng(seed)
    unit = max(1, total_bytes // ((8 + 8 * 12) * ROW * 4))
    shapes = [("embed.weight", (8 * unit, ROW))]
    for i in range(8):
        p = f"blocks.{i}."
        shapes += [(p + "qkv.weight", (3 * unit, ROW)), (p + "qkv.bias", (3 * ROW,)),
                   (p + "out.weight", (unit, ROW)), (p + "up.weight", (4 * unit, ROW)),
                   (p + "down.weight", (4 * unit, ROW))]
    return {name: torch.from_numpy(rng.random(shape, dtype=np.float32)) for name, shape in shapes}


def tiny_state(nbytes: int, seed: int = 0) -> dict:
    return {"w": torch.from_numpy(np.random.default_rng(seed).random(nbytes // 4, dtype=np.float32))}


# --- the raw operations -------------------------------------------------------------------

_COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + struct.pack("!ii", 0, 0)
_COPY_TRAILER = struct.pack("!h", -1)


def copy_binary_pieces(rows: list[tuple], piece: int = COPY_IO_SIZE) -> list[bytes]:
    """A complete binary COPY stream for ``rows`` (tuples of bytes-like field values),
    cut into bytes of ``piece`` size: what psycopg2 wants back from read()."""
    out = [_COPY_HEADER]
    for row in rows:
        out.append(struct.pack("!h", len(row)))
        for f in row:
            out += [struct.pack("!i", len(f)), f]
    out.append(_COPY_TRAILER)
    stream = b"".join(out)
    return [stream[i:i + piece] for i in range(0, len(stream), piece)]


class Feed:
    """COPY FROM source: hands out pre-cut pieces, so no copy happens on the clock."""

    def __init__(self, pieces: list[bytes]):
        self._it = iter(pieces)

    def read(self, n: int = -1) -> bytes:
        return next(self._it, b"")


class Discard:
    """COPY TO sink: the least any reader can do with the rows."""

    def write(self, data) -> int:
        return len(data)


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# --- reporting ------------------------------------------------------------------------

def fmt_s(t: float) -> str:
    if t < 0.01:
        return f"{t * 1e3:.3f} ms"
    return f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.3f} s"


# --- main ------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=256, help="state size in MiB (default 256)")
    ap.add_argument("--repeats", type=int, default=5, help="rounds; tables quote medians (default 5)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    ap.add_argument("--dsn", default=os.environ.get("AGCK_TEST_DSN") or DEFAULT_DSN,
                    help="Postgres DSN (default: $AGCK_TEST_DSN or %(default)s)")
    ap.add_argument("--dir", default=None, help="where the file and SQLite stores go (default: system temp dir)")
    ap.add_argument("--small-n", type=int, default=200, help="10 KB puts per store (default 200)")
    ap.add_argument("--recover-n", type=int, default=10000, help="checkpoints in the recovered run (default 10000)")
    ap.add_argument("--no-quiesce", action="store_true",
                    help="skip the untimed CHECKPOINT + sync before each large case")
    ap.add_argument("--json", default=None, help="also write the results as JSON here")
    args = ap.parse_args(argv)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    tag = f"bench_{secrets.token_hex(4)}"
    workdir = tempfile.mkdtemp(prefix="agck-bench-stores-", dir=args.dir)
    admin = psycopg2.connect(args.dsn, application_name="agck-bench")
    admin.autocommit = True
    opened: list = []
    try:
        return _bench(args, tag, workdir, admin, opened, log)
    finally:
        for s in opened:
            try:
                s.close()
            except Exception:
                pass
        try:
            with admin.cursor() as cur:
                cur.execute(f'DROP SCHEMA IF EXISTS "{tag}" CASCADE')
        except psycopg2.Error as e:
            log(f"could not drop schema {tag}: {e}")
        admin.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _bench(args, tag: str, workdir: str, admin, opened: list, log) -> int:
    t_start = time.perf_counter()
    schema = tag
    raw = admin.cursor()
    raw.execute(f'CREATE SCHEMA "{schema}"')
    # Standalone containers (incremental=False): every put writes every byte, as the raw
    # baselines do. The default mode (incremental) has stores of its own beside them, given
    # new content at every put, so that it writes every byte too.
    pg = PostgresStore(args.dsn, prefix=tag, schema=schema, init=True, incremental=False)
    opened.append(pg)
    pg_inc = PostgresStore(args.dsn, prefix=f"{tag}_inc", schema=schema, init=True)
    opened.append(pg_inc)
    chunks_table = pg.names.chunks
    # Raw tables shaped like the store's chunk rows: bytea kept out of line, uncompressed.
    t_copy, t_ins, t_out = (f'"{schema}".raw_copy', f'"{schema}".raw_insert', f'"{schema}".raw_out')
    for t in (t_copy, t_ins, t_out):
        raw.execute(f"CREATE TABLE {t} (idx int GENERATED BY DEFAULT AS IDENTITY, data bytea NOT NULL); "
                    f"ALTER TABLE {t} ALTER COLUMN data SET STORAGE EXTERNAL")

    can_checkpoint = not args.no_quiesce
    if can_checkpoint:
        try:
            raw.execute("CHECKPOINT")
        except psycopg2.Error as e:
            log(f"CHECKPOINT not allowed ({str(e).strip()}); quiescing with sync only")
            can_checkpoint = False

    def quiesce():
        if args.no_quiesce:
            return
        if can_checkpoint:
            raw.execute("CHECKPOINT")
        os.sync()

    files_root, files_inc_root = os.path.join(workdir, "files"), os.path.join(workdir, "files-inc")
    fs = FileStore(files_root, incremental=False)
    fs_inc = FileStore(files_inc_root)
    sq_path, sq_inc_path = os.path.join(workdir, "bench.db"), os.path.join(workdir, "bench-inc.db")
    sq = SqliteStore("sqlite:///" + sq_path, incremental=False)
    sq_inc = SqliteStore("sqlite:///" + sq_inc_path)
    sq_admin = sqlite3.connect(sq_path, isolation_level=None)
    sq_inc_admin = sqlite3.connect(sq_inc_path, isolation_level=None)
    opened += [sq, sq_inc, sq_admin, sq_inc_admin]
    writers = {"pg": pg, "file": fs, "sqlite": sq, "pg_inc": pg_inc, "file_inc": fs_inc, "sqlite_inc": sq_inc}
    # What the read-back reads through: another store object on each, as the writer was opened.
    reopen = {"pg": lambda: open_store(args.dsn, prefix=tag, schema=schema, incremental=False),
              "file": lambda: open_store(files_root, incremental=False),
              "sqlite": lambda: open_store("sqlite:///" + sq_path, incremental=False),
              "pg_inc": lambda: open_store(args.dsn, prefix=f"{tag}_inc", schema=schema),
              "file_inc": lambda: open_store(files_inc_root),
              "sqlite_inc": lambda: open_store("sqlite:///" + sq_inc_path)}

    log(f"building a {args.size_mb} MiB state; schema {schema}, files in {workdir} ...")
    state = build_state(args.size_mb * MiB)
    new_state = build_state(args.size_mb * MiB, seed=1)    # the incremental puts' content, new each put
    payload = sum(v.nbytes for v in state.values())
    w = checkpoint.encode(state, run=RUN, step=0)
    container = b"".join(w.parts())
    clen = len(container)
    assert clen == w.total_len
    chunks = [container[i:i + DEFAULT_CHUNK_SIZE] for i in range(0, clen, DEFAULT_CHUNK_SIZE)]
    copy_pieces = copy_binary_pieces([(c,) for c in chunks])

    # Read fixtures, written once: each store's step 0, the same chunks in the raw table.
    for store in writers.values():
        store.put(RUN, 0, state)
    raw.copy_expert(f"COPY {t_out} (data) FROM STDIN (FORMAT binary)", Feed(copy_pieces), size=COPY_IO_SIZE)
    raw.execute(f"VACUUM ANALYZE {t_out}")
    run_dir = os.path.dirname(fs.path(RUN, 0))
    raw_path = os.path.join(run_dir, "raw.bin")
    log(f"  payload {payload / MiB:.1f} MiB in {len(state)} tensors, container {clen / MiB:.1f} MiB "
        f"in {len(chunks)} chunk rows (setup {time.perf_counter() - t_start:.1f} s)")

    steps = itertools.count(1)
    last = {}

    def fresh(key: str) -> int:
        last[key] = next(steps)
        return last[key]

    def put_case(name: str, key: str, content: dict, tidy) -> Case:
        """A put of a fresh step of ``content``; after it, untimed, the step is read back,
        deleted, and ``tidy()`` leaves the store as empty as before."""
        store = writers[key]

        def after():
            readback(reopen[key], {(RUN, last[key]): content})
            store.delete(RUN, last[key])
            tidy()
        return Case(name, lambda: store.put(RUN, fresh(key), content), after, clen)

    def get_case(name: str, key: str) -> Case:
        store = writers[key]
        return Case(name, lambda: store.get(RUN, 0, verify=True), None, clen)

    def tidy_incremental(key: str, then):
        """The deleted step's chunks collected, ``then()``, and new values for the next put."""
        def tidy():
            writers[key].collect_garbage()
            then()
            for t in new_state.values():
                t.uniform_()
        return tidy

    def raw_copy_in():
        raw.execute("BEGIN; SET LOCAL synchronous_commit = on")
        raw.copy_expert(f"COPY {t_copy} (data) FROM STDIN (FORMAT binary)", Feed(copy_pieces), size=COPY_IO_SIZE)
        raw.execute("COMMIT")

    def raw_insert():
        raw.execute("BEGIN; SET LOCAL synchronous_commit = on")
        for c in chunks:
            raw.execute(f"INSERT INTO {t_ins} (data) VALUES (%s)", (psycopg2.Binary(c),))
        raw.execute("COMMIT")

    def raw_copy_out():
        raw.copy_expert(f"COPY (SELECT data FROM {t_out} ORDER BY idx) TO STDOUT (FORMAT binary)", Discard(),
                        size=COPY_IO_SIZE)

    # back to an empty heap, as TRUNCATE leaves the raw table; a WAL of nothing pending
    vacuum_pg = lambda: raw.execute(f"VACUUM {chunks_table}")   # noqa: E731
    vacuum_pg_inc = lambda: raw.execute(f"VACUUM {pg_inc.names.chunks}, {pg_inc.names.objects}")   # noqa: E731
    wal_sqlite = lambda: sq_admin.execute("PRAGMA wal_checkpoint(TRUNCATE)")   # noqa: E731
    wal_sqlite_inc = lambda: sq_inc_admin.execute("PRAGMA wal_checkpoint(TRUNCATE)")   # noqa: E731
    cases = [
        put_case("pg put", "pg", state, vacuum_pg),
        Case("raw COPY FROM STDIN (binary)", raw_copy_in, lambda: raw.execute(f"TRUNCATE {t_copy}"), clen),
        Case("INSERT bytea (psycopg2.Binary)", raw_insert, lambda: raw.execute(f"TRUNCATE {t_ins}"), clen),
        get_case("pg get (verify=True)", "pg"),
        Case("raw COPY TO STDOUT (binary, discard)", raw_copy_out, None, clen),
        put_case("file put", "file", state, lambda: None),
        Case("raw write+fsync+dir fsync", lambda: raw_write_fsync(raw_path, container),
             lambda: unlink(raw_path), clen),
        get_case("file get (verify=True)", "file"),
        put_case("sqlite put", "sqlite", state, wal_sqlite),
        get_case("sqlite get (verify=True)", "sqlite"),
        put_case("pg put (incremental)", "pg_inc", new_state, tidy_incremental("pg_inc", vacuum_pg_inc)),
        get_case("pg get (incremental, verify=True)", "pg_inc"),
        put_case("file put (incremental)", "file_inc", new_state, tidy_incremental("file_inc", lambda: None)),
        get_case("file get (incremental, verify=True)", "file_inc"),
        put_case("sqlite put (incremental)", "sqlite_inc", new_state, tidy_incremental("sqlite_inc", wal_sqlite_inc)),
        get_case("sqlite get (incremental, verify=True)", "sqlite_inc"),
    ]
    log(f"large: {len(cases)} cases x {args.repeats} rounds (+{args.warmup} warm-up), order rotated each round, "
        f"{'CHECKPOINT + ' if can_checkpoint else ''}{'sync' if not args.no_quiesce else 'no quiesce'} "
        "before each case ...")
    t_large = time.perf_counter()
    run_rounds(cases, args.repeats, log, args.warmup, quiesce)
    t_large = time.perf_counter() - t_large

    # Free the large fixtures before the small and recovery phases, once they are read back.
    for key, store in writers.items():
        readback(reopen[key], {(RUN, 0): state})
        store.delete(RUN, 0)
        if store.incremental:
            store.collect_garbage()
    for c in cases:
        c.fn = c.after = None
    w = container = chunks = copy_pieces = state = new_state = None  # noqa: F841
    raw.execute(f"TRUNCATE {t_out}, {t_copy}, {t_ins}")
    vacuum_pg()
    vacuum_pg_inc()
    wal_sqlite()
    wal_sqlite_inc()
    gc.collect()
    quiesce()

    small = _bench_small(args, writers, reopen, raw, t_copy, run_dir, steps, log)
    quiesce()
    recovery = _bench_recover(args, pg, fs, raw, log)
    log(read_back_note())

    return _report(args, cases, small, recovery, payload, clen, t_large, can_checkpoint, workdir, pg, log,
                   time.perf_counter() - t_start)


def _bench_small(args, writers, reopen, raw, t_copy, run_dir, steps, log) -> list[Case]:
    """10 KB checkpoints: per-put latency, the stores interleaved put by put; every put
    read back at the end."""
    state = tiny_state(10 * 1024, seed=2)
    w = checkpoint.encode(state, run=RUN, step=0)
    container = b"".join(w.parts())
    pieces = copy_binary_pieces([(container,)])
    os.makedirs(run_dir, exist_ok=True)     # gone with the run's last step, deleted before
    raw_path = os.path.join(run_dir, "raw-small.bin")
    written = {key: [] for key in writers}

    def put(key: str):
        store, done = writers[key], written[key]

        def fn():
            step = next(steps)
            store.put(RUN, step, state)
            done.append(step)
        return fn

    def raw_copy_small():
        raw.execute("BEGIN; SET LOCAL synchronous_commit = on")
        raw.copy_expert(f"COPY {t_copy} (data) FROM STDIN (FORMAT binary)", Feed(pieces), size=COPY_IO_SIZE)
        raw.execute("COMMIT")

    cases = [
        Case("pg put 10 KB", put("pg"), None, len(container)),
        Case("raw COPY FROM 10 KB + COMMIT", raw_copy_small, None, len(container)),
        Case("file put 10 KB", put("file"), None, len(container)),
        Case("raw write+fsync+dir fsync 10 KB", lambda: raw_write_fsync(raw_path, container), None, len(container)),
        Case("sqlite put 10 KB", put("sqlite"), None, len(container)),
        Case("pg put 10 KB (incremental)", put("pg_inc"), None, len(container)),
        Case("file put 10 KB (incremental)", put("file_inc"), None, len(container)),
        Case("sqlite put 10 KB (incremental)", put("sqlite_inc"), None, len(container)),
    ]
    log(f"small: {len(cases)} cases x {args.small_n} puts, interleaved ...")
    t0 = time.perf_counter()
    # No gc.collect per call: it would cost more than the put; collect between rounds instead.
    gc.disable()
    try:
        for i in range(-5, args.small_n):      # 5 untimed: first-call costs
            k = i % len(cases)
            for c in cases[k:] + cases[:k]:
                ts = time.perf_counter()
                c.fn()
                te = time.perf_counter()
                if i >= 0:
                    c.times.append(te - ts)
            if i % 50 == 0:
                gc.collect()
    finally:
        gc.enable()
    unlink(raw_path)
    log(f"  {time.perf_counter() - t0:.1f} s")
    for key, done in written.items():
        readback(reopen[key], {(RUN, step): state for step in done})
    return cases


def _bench_recover(args, pg, fs, raw, log) -> dict:
    """recover_run over N checkpoints whose newest CORRUPT are corrupt: the walk-back
    has to reject each with its reason before it reaches the newest good one."""
    n = args.recover_n
    state = tiny_state(1024, seed=3)
    log(f"recover: laying down {n} checkpoints in each store ...")
    t0 = time.perf_counter()
    containers = [b"".join(checkpoint.encode(state, run=RUN_RECOVER, step=s).parts()) for s in range(n)]

    # File store: the files a run of puts leaves, written directly (10,000 fsync'd puts
    # would measure the disk, not recovery); the newest CORRUPT with one byte flipped.
    run_dir = os.path.dirname(fs.path(RUN_RECOVER, 0))
    os.makedirs(run_dir, exist_ok=True)
    for s, data in enumerate(containers):
        if s >= n - CORRUPT:
            data = bytearray(data)
            data[len(data) // 2] ^= 0xFF
        with open(fs.path(RUN_RECOVER, s), "wb") as f:
            f.write(data)

    # Postgres: the rows a run of puts leaves (manifest + one chunk row each), in one
    # transaction; then one byte flipped in the newest CORRUPT chunk rows.
    n_ = pg.names
    meta_text = meta_json_text(None)
    raw.execute("BEGIN")
    raw.copy_expert(f"COPY {n_.chunks} (run, step, idx, data) FROM STDIN (FORMAT binary)",
                    Feed(copy_binary_pieces([(RUN_RECOVER.encode(), struct.pack("!q", s), struct.pack("!i", 0), c)
                                             for s, c in enumerate(containers)])), size=COPY_IO_SIZE)
    from psycopg2.extras import execute_values
    execute_values(raw, f"INSERT INTO {n_.manifest} (run, step, parent, size, checksum, nchunks, created_at, meta) "
                        f"VALUES %s",
                   [(RUN_RECOVER, s, None, len(c), manifest_checksum(c[len(c) - agck_format.parse_header(c).footer_len:]), 1,
                     time.time(), meta_text)
                    for s, c in enumerate(containers)],
                   template="(%s, %s, %s, %s, %s, %s, to_timestamp(%s), %s::jsonb)", page_size=1000)
    raw.execute(f"UPDATE {n_.chunks} SET data = set_byte(data, octet_length(data) / 2, "
                f"get_byte(data, octet_length(data) / 2) # 255) WHERE run = %s AND step >= %s",
                (RUN_RECOVER, n - CORRUPT))
    raw.execute("COMMIT")
    raw.execute(f"VACUUM ANALYZE {n_.chunks}")
    raw.execute(f"VACUUM ANALYZE {n_.manifest}")
    os.sync()
    # The rows must be what put writes: the oldest reads back through the store.
    assert pg.read(RUN_RECOVER, 0).step == 0 and fs.read(RUN_RECOVER, 0).step == 0
    log(f"  laid down in {time.perf_counter() - t0:.1f} s; recovering, {args.repeats} rounds alternated ...")

    times = {"file": [], "pg": []}
    reasons = {}
    stores = [("file", fs), ("pg", pg)]
    for r in range(args.repeats + 1):       # the first round is untimed (cold caches)
        for name, store in (stores if r % 2 == 0 else stores[::-1]):
            gc.collect()
            ts = time.perf_counter()
            rec = recover_run(store, RUN_RECOVER)
            te = time.perf_counter()
            if rec.step != n - CORRUPT - 1 or len(rec.rejected) != CORRUPT:
                raise SystemExit(f"{name} recovered step {rec.step} with {len(rec.rejected)} rejected; "
                                 f"expected step {n - CORRUPT - 1} with {CORRUPT}")
            if r:
                times[name].append(te - ts)
            reasons[name] = sorted({rj.reason.split(" (")[0][:60] for rj in rec.rejected})
    return {"n": n, "corrupt": CORRUPT, "times": times, "reasons": reasons}


def _report(args, cases, small, recovery, payload, clen, t_large, can_checkpoint, workdir, pg, log, total_s):
    by = {c.name: c for c in cases + small}

    def paired(a: str, b: str) -> tuple[float, float]:
        rs = [tb / ta for ta, tb in zip(by[a].times, by[b].times)]
        return min(rs), max(rs)

    # (case, baseline, target speed ratio baseline_time / case_time)
    checks = [
        ("pg put", "raw COPY FROM STDIN (binary)", 0.9),
        ("pg put", "INSERT bytea (psycopg2.Binary)", 4.0),
        ("pg get (verify=True)", "raw COPY TO STDOUT (binary, discard)", 0.9),
        ("file put", "raw write+fsync+dir fsync", 0.9),
    ]
    info = [
        ("file get (verify=True)", None), ("sqlite put", "raw write+fsync+dir fsync"),
        ("sqlite get (verify=True)", None),
        ("pg put (incremental)", "raw COPY FROM STDIN (binary)"),
        ("pg get (incremental, verify=True)", "raw COPY TO STDOUT (binary, discard)"),
        ("file put (incremental)", "raw write+fsync+dir fsync"), ("file get (incremental, verify=True)", None),
        ("sqlite put (incremental)", "raw write+fsync+dir fsync"), ("sqlite get (incremental, verify=True)", None),
    ]
    baselines = ["raw COPY FROM STDIN (binary)", "INSERT bytea (psycopg2.Binary)",
                 "raw COPY TO STDOUT (binary, discard)", "raw write+fsync+dir fsync"]
    results = {"checks": [], "cases": {}}
    lines = []
    out = lines.append
    ver, sb, mws, fpw = pg._query("SELECT current_setting('server_version'), current_setting('shared_buffers'), "
                                  "current_setting('max_wal_size'), current_setting('full_page_writes')")[0]
    out(f"## agck store benchmark: {payload / MiB:.0f} MiB of float32 ({clen / MiB:.1f} MiB container)")
    out("")
    out(f"`python scripts/bench_stores.py --size-mb {args.size_mb} --repeats {args.repeats}"
        + (f" --warmup {args.warmup}" if args.warmup != 1 else "") + "`")
    out("")
    out(f"- Python {platform.python_version()}, torch {torch.__version__}, psycopg2 {psycopg2.__version__.split()[0]}, "
        f"SQLite {sqlite3.sqlite_version}, Postgres {ver} (shared_buffers {sb}, max_wal_size {mws}, "
        f"full_page_writes {fpw}), {os.cpu_count()} CPUs, {platform.machine()} {platform.system()} {platform.release()}")
    out(f"- large cases: median of {args.repeats} rounds after {args.warmup} warm-up, order rotated each round; "
        + ("untimed CHECKPOINT + sync before each case" if can_checkpoint else
           "untimed sync before each case" if not args.no_quiesce else "no quiescing")
        + f"; MiB/s = container bytes / median; {t_large:.0f} s in all")
    out("- ratio = baseline median / case median (>1: faster than the baseline); "
        "in brackets the min-max of the same ratio per round")
    out("")
    out("| case | median | MiB/s | ratio vs baseline | target | verdict |")
    out("|---|---:|---:|---|---|---|")
    for name, base, target in checks:
        c, b = by[name], by[base]
        ratio = b.median / c.median
        lo, hi = paired(name, base)
        ok = ratio >= target
        out(f"| {name} | {fmt_s(c.median)} | {c.nbytes / MiB / c.median:.0f} | {ratio:.2f}x {base} "
            f"[{lo:.2f}-{hi:.2f}] | >= {target:g}x | {'PASS' if ok else 'FAIL'} |")
        results["checks"].append({"case": name, "baseline": base, "ratio": ratio, "paired_min": lo,
                                  "paired_max": hi, "target": target, "pass": ok})
    for name in baselines:
        c = by[name]
        out(f"| {name} (baseline) | {fmt_s(c.median)} | {c.nbytes / MiB / c.median:.0f} | | | |")
    for name, base in info:
        c = by[name]
        rel = f"{by[base].median / c.median:.2f}x {base}" if base else ""
        out(f"| {name} | {fmt_s(c.median)} | {c.nbytes / MiB / c.median:.0f} | {rel} | | info |")

    c = by["pg put 10 KB"]
    base = by["raw COPY FROM 10 KB + COMMIT"]
    ok = c.median <= 1e-3
    out(f"| pg put 10 KB (median of {len(c.times)}) | {fmt_s(c.median)} | {c.nbytes / MiB / c.median:.1f} | "
        f"{base.median / c.median:.2f}x raw COPY FROM 10 KB + COMMIT | <= 1 ms | {'PASS' if ok else 'FAIL'} |")
    results["checks"].append({"case": c.name, "median_s": c.median, "target_s": 1e-3, "pass": ok})
    for name, bname in (("raw COPY FROM 10 KB + COMMIT", None), ("file put 10 KB", "raw write+fsync+dir fsync 10 KB"),
                        ("raw write+fsync+dir fsync 10 KB", None), ("sqlite put 10 KB", None),
                        ("pg put 10 KB (incremental)", "raw COPY FROM 10 KB + COMMIT"),
                        ("file put 10 KB (incremental)", "raw write+fsync+dir fsync 10 KB"),
                        ("sqlite put 10 KB (incremental)", None)):
        c = by[name]
        rel = f"{by[bname].median / c.median:.2f}x {bname}" if bname else ""
        out(f"| {name} | {fmt_s(c.median)} | {c.nbytes / MiB / c.median:.1f} | {rel} | | info |")
    for key, label in (("file", "file"), ("pg", "pg")):
        ts = recovery["times"][key]
        out(f"| recover {label}: {recovery['n']:,} ckpts, newest {recovery['corrupt']} corrupt "
            f"(median of {len(ts)}) | {fmt_s(statistics.median(ts))} | | | | info |")
    out("")
    out("- (incremental): the default mode (`agck.open_store(url)`), a store of its own; each large put of new "
        "values (refilled outside the clock), so every chunk is new; the rows without it are stores opened with "
        "incremental=False (standalone containers)")
    out("- every checkpoint put was read back through a store object of its own, bit-exact and verified "
        "(outside the clock)")
    out(f"- 10 KB rows: per-put latency, {len(by['pg put 10 KB'].times)} puts per case interleaved put by put; "
        f"p90 pg put {fmt_s(np.percentile(by['pg put 10 KB'].times, 90))}")
    out(f"- recovery walks back over {recovery['corrupt']} corrupt checkpoints (one byte flipped) to step "
        f"{recovery['n'] - recovery['corrupt'] - 1}; rejected with: "
        + "; ".join(f"{k}: {', '.join(v)}" for k, v in recovery["reasons"].items()))
    out(f"- whole run {total_s:.0f} s")
    text = "\n".join(lines)
    print(text)

    if args.json:
        for c in cases + small:
            results["cases"][c.name] = {"median_s": c.median, "times_s": c.times, "nbytes": c.nbytes}
        results["recover"] = recovery
        results["args"] = vars(args)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
