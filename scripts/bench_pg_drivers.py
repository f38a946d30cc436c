#!/usr/bin/env python3
"""psycopg2 against psycopg 3 on the Postgres store's small put and get, in one run.

The statements are the store's own for a small checkpoint (a manifest row and one
chunk row of ``--kb`` KiB, committed, ``synchronous_commit`` on; then the chunk read
back), on tables shaped as the store's, sent as each driver sends best:

- psycopg2: one multi-statement query (BEGIN, both INSERTs, COMMIT), the bytes as
  a hex bytea literal: one round trip (what agck sends);
- psycopg 3: pipeline mode, server-side prepared statements, the bytes as a binary
  parameter: one round trip (BEGIN, two prepared INSERTs, COMMIT, one sync);
- psycopg 3, async: the same on an ``AsyncConnection``.

Cases: one client in a loop (median latency of a put and of a get), then
``--threads`` (16) threads each with its own connection (puts per second), and, for
psycopg 3 async, as many coroutines on one event loop, each with its own connection.

    pip install 'psycopg[binary]==3.3.9'
    python scripts/bench_pg_drivers.py [--dsn postgresql://...] [--kb 10] [--n 400] [--threads 16] [--rounds 3]
"""

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchio  # noqa: E402  (puts the checkout on sys.path)

DSN = os.environ.get("AGCK_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/test")
META = '{"lg": 1, "thread_id": "t", "checkpoint_ns": "", "checkpoint_id": "1ef-..."}'


def _tables(schema: str) -> str:
    return (f"CREATE TABLE {schema}.m (run text, step bigint, size bigint, checksum text, meta jsonb, "
            f"created_at timestamptz DEFAULT now(), PRIMARY KEY (run, step)); "
            f"CREATE TABLE {schema}.c (run text, step bigint, idx int, data bytea, PRIMARY KEY (run, step, idx)); "
            f"ALTER TABLE {schema}.c ALTER data SET STORAGE EXTERNAL")


class Psycopg2:
    name = "psycopg2 (one multi-statement query, hex bytea)"

    def __init__(self, dsn, schema):
        import psycopg2
        self.conn = psycopg2.connect(dsn)
        self.conn.autocommit = True
        self.cur = self.conn.cursor()
        self.s = schema

    def put(self, run, step, data):
        self.cur.execute(f"BEGIN; SET LOCAL synchronous_commit = on; INSERT INTO {self.s}.m (run, step, size, checksum, "
                         f"meta) VALUES (%s, %s, %s, %s, %s::jsonb); INSERT INTO {self.s}.c (run, step, idx, data) "
                         f"VALUES (%s, %s, 0, %s); COMMIT", (run, step, len(data), "x" * 16, META, run, step, data))

    def get(self, run, step):
        self.cur.execute(f"SELECT m.size, c.data FROM {self.s}.m m JOIN {self.s}.c c USING (run, step) "
                         f"WHERE run = %s AND step = %s", (run, step))
        return bytes(self.cur.fetchone()[1])

    def close(self):
        self.conn.close()


class Psycopg3:
    name = "psycopg 3 (pipeline, prepared, binary)"

    def __init__(self, dsn, schema):
        import psycopg
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.s = schema

    def _sql(self):
        return (f"INSERT INTO {self.s}.m (run, step, size, checksum, meta) VALUES (%s, %s, %s, %s, %s::jsonb)",
                f"INSERT INTO {self.s}.c (run, step, idx, data) VALUES (%s, %s, 0, %b)",
                f"SELECT m.size, c.data FROM {self.s}.m m JOIN {self.s}.c c USING (run, step) "
                f"WHERE run = %s AND step = %s")

    def put(self, run, step, data):
        m, c, _ = self._sql()
        with self.conn.pipeline():
            self.conn.execute("BEGIN")
            self.conn.execute(m, (run, step, len(data), "x" * 16, META), prepare=True)
            self.conn.execute(c, (run, step, data), prepare=True)
            self.conn.execute("COMMIT")

    def get(self, run, step):
        return bytes(self.conn.execute(self._sql()[2], (run, step), prepare=True, binary=True).fetchone()[1])

    def close(self):
        self.conn.close()


class Psycopg3Async(Psycopg3):
    name = "psycopg 3 async (pipeline, prepared, binary)"

    def __init__(self, dsn, schema, conn):
        self.conn, self.s = conn, schema

    @classmethod
    async def open(cls, dsn, schema):
        import psycopg
        return cls(dsn, schema, await psycopg.AsyncConnection.connect(dsn, autocommit=True))

    async def aput(self, run, step, data):
        m, c, _ = self._sql()
        async with self.conn.pipeline():
            await self.conn.execute("BEGIN")
            await self.conn.execute(m, (run, step, len(data), "x" * 16, META), prepare=True)
            await self.conn.execute(c, (run, step, data), prepare=True)
            await self.conn.execute("COMMIT")

    async def aget(self, run, step):
        cur = await self.conn.execute(self._sql()[2], (run, step), prepare=True, binary=True)
        return bytes((await cur.fetchone())[1])


def _sequential(client, tag, data, n):
    puts, gets = [], []
    for i in range(n):
        t0 = time.perf_counter()
        client.put(tag, i, data)
        t1 = time.perf_counter()
        assert client.get(tag, i) == data
        t2 = time.perf_counter()
        puts.append(t1 - t0)
        gets.append(t2 - t1)
    return statistics.median(puts) * 1e3, statistics.median(gets) * 1e3


def _threads(cls, dsn, schema, tag, data, n, threads):
    clients = [cls(dsn, schema) for _ in range(threads)]
    barrier = threading.Barrier(threads + 1)

    def work(k):
        barrier.wait()
        for i in range(n):
            clients[k].put(f"{tag}-{k}", i, data)

    ts = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    rate = threads * n / (time.perf_counter() - t0)
    for c in clients:
        c.close()
    return rate


async def _coroutines(dsn, schema, tag, data, n, k):
    clients = [await Psycopg3Async.open(dsn, schema) for _ in range(k)]

    async def work(j):
        for i in range(n):
            await clients[j].aput(f"{tag}-{j}", i, data)

    t0 = time.perf_counter()
    await asyncio.gather(*(work(j) for j in range(k)))
    rate = k * n / (time.perf_counter() - t0)
    for c in clients:
        await c.conn.close()
    return rate


async def _async_sequential(dsn, schema, tag, data, n):
    c = await Psycopg3Async.open(dsn, schema)
    puts, gets = [], []
    for i in range(n):
        t0 = time.perf_counter()
        await c.aput(tag, i, data)
        t1 = time.perf_counter()
        assert await c.aget(tag, i) == data
        t2 = time.perf_counter()
        puts.append(t1 - t0)
        gets.append(t2 - t1)
    await c.conn.close()
    return statistics.median(puts) * 1e3, statistics.median(gets) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dsn", default=DSN)
    p.add_argument("--kb", type=int, default=10)
    p.add_argument("--n", type=int, default=400, help="puts per client per round, one client")
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    with benchio.scratch_schema(a.dsn, "bench_drv") as (schema, admin):
        admin.execute(_tables(schema))
        _run(a, schema)
    return 0


def _run(a, schema: str) -> None:
    data = os.urandom(a.kb << 10)
    names = [Psycopg2.name, Psycopg3.name, Psycopg3Async.name]
    seq = {n: [] for n in names}
    conc = {n: [] for n in names}
    for r in range(a.rounds):
        tag = f"r{r}"
        for cls in (Psycopg2, Psycopg3):
            c = cls(a.dsn, schema)
            seq[cls.name].append(_sequential(c, f"{tag}-{cls.__name__}", data, a.n))
            c.close()
            conc[cls.name].append(_threads(cls, a.dsn, schema, f"{tag}-{cls.__name__}-t", data, a.n // 4,
                                           a.threads))
        seq[Psycopg3Async.name].append(asyncio.run(_async_sequential(a.dsn, schema, f"{tag}-a", data, a.n)))
        conc[Psycopg3Async.name].append(asyncio.run(_coroutines(a.dsn, schema, f"{tag}-ac", data, a.n // 4,
                                                                a.threads)))
        print(f"  round {r + 1}/{a.rounds} done", file=sys.stderr, flush=True)
    print(f"## A small put ({a.kb} KiB chunk row + manifest row, committed) and its get, "
          f"medians of {a.rounds} rounds\n")
    print(f"| driver | put median ms | get median ms | puts/s, {a.threads} clients at once |")
    print("|---|---:|---:|---:|")
    for n in names:
        put = statistics.median(x[0] for x in seq[n])
        get = statistics.median(x[1] for x in seq[n])
        print(f"| {n} | {put:.3f} | {get:.3f} | {statistics.median(conc[n]):.0f} |")


if __name__ == "__main__":
    sys.exit(main())
