#!/usr/bin/env python3
"""Many LangGraph conversations at once on one Postgres server: agck's AgckSaver
against LangGraph's AsyncPostgresSaver, each with a pool of the same size, in one run.
A conversation is a compiled graph run with ``ainvoke``: 20 super-steps, each
appending a chat message of about 1 KB to a ``messages`` channel (LangGraph's
``add_messages`` reducer), so each checkpoint holds the conversation so far (a few
KB up to about 20 KB). Two layouts, each saver in turn, alternated every round:

- one process: ``--conversations`` (64) conversations on one event loop, sharing
  one saver whose pool holds ``--pool`` (16) connections;
- ``--procs`` (8) OS processes, each with its own saver and a pool of ``--pool`` /
  ``--procs`` connections (the same connections in all; at least 2 each), running an
  equal share of the conversations; they start together.

Reported per saver and layout: throughput in super-steps per second (all
conversations' super-steps over the wall time from the first start to the last
end), the p50 and p99 latency of a checkpoint (``aput``, awaited by the graph
once per super-step) and of a write (``aput_writes``), and the CPU time per
super-step of the clients (their processes' CPU time while the conversations run)
and of the server (every ``postgres`` process's, read from /proc where the server
runs on this machine, other clients' included): where the cores are all busy,
throughput is their sum's inverse.

At the end, what AgckSaver wrote is read back through a store object of its own
(benchio.readback): every conversation's last checkpoint compared bit for bit with
the conversation it must hold, and every checkpoint of the store must verify; the
first that does not ends the run, status 1.

    pip install -e '.[test]' langgraph-checkpoint-postgres==3.2.0 'psycopg[binary,pool]==3.3.9'
    python scripts/bench_langgraph_concurrent.py [--rounds 3] [--conversations 64] [--procs 8] [--pool 16]
                                                 [--steps 20] [--dsn postgresql://...] [--json F]
"""

import argparse
import asyncio
import json
import multiprocessing as mp
import operator
import os
import secrets
import statistics
import sys
import time
from typing import Annotated, TypedDict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchio  # noqa: E402  (puts the checkout on sys.path, before agck is imported)

DSN = os.environ.get("AGCK_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/test")
SAVERS = ("LangGraph AsyncPostgresSaver", "agck AgckSaver (Postgres)")


def _reply(k: int):
    from langchain_core.messages import AIMessage
    return AIMessage(content=f"reply {k}: " + "lorem ipsum dolor " * 55, id=f"m{k}")


def _opening():
    from langchain_core.messages import HumanMessage
    return HumanMessage(content="hello", id="h")


def _graph(steps: int):
    from langgraph.graph import END, START, StateGraph
    from langgraph.graph.message import add_messages

    class State(TypedDict):
        messages: Annotated[list, add_messages]
        n: Annotated[int, operator.add]

    def reply(state: State):
        return {"messages": [_reply(state["n"])], "n": 1}

    g = StateGraph(State)
    g.add_node("reply", reply)
    g.add_edge(START, "reply")
    g.add_conditional_edges("reply", lambda s: END if s["n"] >= steps else "reply")
    return g


class _Timed:
    """Wraps a saver's aput and aput_writes to record how long each took."""

    def __init__(self, saver):
        self.puts: list[float] = []
        self.writes: list[float] = []
        saver.aput = self._timed(saver.aput, self.puts)
        saver.aput_writes = self._timed(saver.aput_writes, self.writes)

    @staticmethod
    def _timed(method, into: list):
        async def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return await method(*a, **k)
            finally:
                into.append(time.perf_counter() - t0)
        return timed


async def _open(which: str, dsn: str, schema: str, pool: int):
    """(saver, close) for saver ``which`` on ``schema`` with a pool of ``pool`` connections."""
    if which == SAVERS[0]:
        from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
        from psycopg.rows import dict_row
        from psycopg_pool import AsyncConnectionPool
        p = AsyncConnectionPool(dsn, min_size=pool, max_size=pool, open=False,
                                kwargs={"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row,
                                        "options": f"-c search_path={schema}"})
        await p.open(wait=True)
        saver = AsyncPostgresSaver(p)

        async def close():
            await p.close()
        return saver, close
    from agck.integrations.langgraph import AgckSaver
    from agck.stores.postgres.store import PostgresStore
    store = PostgresStore(dsn, schema=schema, pool=pool)
    saver = AgckSaver(store)

    async def close():
        saver.close()
        store.close()
    return saver, close


async def _conversations(which: str, dsn: str, schema: str, pool: int, n: int, steps: int, tag: str,
                         start_at: float | None = None) -> dict:
    saver, close = await _open(which, dsn, schema, pool)
    timed = _Timed(saver)
    graph = _graph(steps).compile(checkpointer=saver)
    try:
        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.time()))
        t0, cpu0 = time.time(), time.process_time()
        threads = [f"{tag}-{i}" for i in range(n)]
        outs = await asyncio.gather(*(graph.ainvoke({"messages": [_opening()], "n": 0},
                                                    {"configurable": {"thread_id": t}}) for t in threads))
        t1, cpu = time.time(), time.process_time() - cpu0
        assert all(o["n"] == steps and len(o["messages"]) == steps + 1 for o in outs)
        return {"start": t0, "end": t1, "cpu": cpu, "puts": timed.puts, "writes": timed.writes,
                "supersteps": n * steps, "threads": threads}
    finally:
        await close()


def _proc_main(args):
    which, dsn, schema, pool, n, steps, tag, start_at, q = args
    try:
        q.put(asyncio.run(_conversations(which, dsn, schema, pool, n, steps, tag, start_at)))
    except BaseException as e:   # reported by the parent
        q.put({"error": repr(e)})


def _multi(which: str, dsn: str, schema: str, pool: int, n: int, procs: int, steps: int, tag: str) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    start_at = time.time() + 20.0      # time for every process to import LangGraph and open its pool
    share = [n // procs + (1 if i < n % procs else 0) for i in range(procs)]
    pool = max(2, pool // procs)
    ps = [ctx.Process(target=_proc_main, args=((which, dsn, schema, pool, share[i], steps, f"{tag}-p{i}", start_at,
                                                q),)) for i in range(procs)]
    for p in ps:
        p.start()
    results = [q.get(timeout=600) for _ in ps]
    for p in ps:
        p.join()
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"{which}: {errors[0]}")
    late = max(r["start"] for r in results) - start_at
    if late > 1.0:
        print(f"  warning: a process started {late:.1f} s late", file=sys.stderr)
    return {"start": min(r["start"] for r in results), "end": max(r["end"] for r in results),
            "cpu": sum(r["cpu"] for r in results),
            "puts": [x for r in results for x in r["puts"]], "writes": [x for r in results for x in r["writes"]],
            "supersteps": sum(r["supersteps"] for r in results), "threads": [t for r in results for t in r["threads"]]}


def _server_cpu() -> float | None:
    """CPU seconds used so far by every process named ``postgres`` on this machine, with
    the ended ones they have reaped (the postmaster's backends: a pool's connections end
    within a run), None where /proc cannot tell: the server's, when it runs here."""
    total, seen, tick = 0.0, False, os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    for pid in pids:
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() != "postgres":
                    continue
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue     # ended meanwhile
        total, seen = total + sum(int(v) for v in fields[11:15]) / tick, True    # utime stime cutime cstime
    return total if seen else None


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--procs", type=int, default=8)
    p.add_argument("--pool", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--dsn", default=DSN)
    p.add_argument("--json")
    p.add_argument("--layouts", default="one,procs")
    a = p.parse_args(argv)
    with benchio.scratch_schema(a.dsn, "bench_lgc") as (schema, _):
        _run(a, schema)
    return 0


def _run(a, schema: str) -> None:
    log = lambda m: print(m, file=sys.stderr, flush=True)   # noqa: E731
    from langgraph.checkpoint.postgres import PostgresSaver
    from psycopg import Connection
    with Connection.connect(a.dsn, autocommit=True, options=f"-c search_path={schema}") as c:
        PostgresSaver(c).setup()
    from agck import open_store
    from agck.stores.postgres.store import PostgresStore
    PostgresStore(a.dsn, schema=schema, init=True).close()
    # every conversation ends holding the opening and a reply per super-step
    final = {"messages": [_opening()] + [_reply(k) for k in range(a.steps)], "n": a.steps}
    written = {}     # (thread, None: its newest checkpoint) -> what AgckSaver must hold there

    layouts = a.layouts.split(",")
    runs: dict = {(s, lay): [] for s in SAVERS for lay in layouts}
    for r in range(-1, a.rounds):
        order = SAVERS if r % 2 == 0 else SAVERS[::-1]
        for lay in layouts:
            for s in order:
                tag = f"r{r}-{lay}-{secrets.token_hex(2)}"
                server0 = _server_cpu()
                if lay == "one":
                    res = asyncio.run(_conversations(s, a.dsn, schema, a.pool, a.conversations, a.steps, tag))
                else:
                    res = _multi(s, a.dsn, schema, a.pool, a.conversations, a.procs, a.steps, tag)
                server1 = _server_cpu()
                rate = res["supersteps"] / (res["end"] - res["start"])
                client_ms = res["cpu"] / res["supersteps"] * 1e3
                server_ms = (server1 - server0) / res["supersteps"] * 1e3 if server0 is not None \
                    and server1 is not None else float("nan")
                log(f"  {'warm-up' if r < 0 else f'round {r + 1}/{a.rounds}'} {lay:5s} {s}: "
                    f"{rate:.0f} super-steps/s, aput p50 {_pct(res['puts'], .5):.1f} ms "
                    f"p99 {_pct(res['puts'], .99):.1f} ms, CPU per super-step: clients {client_ms:.2f} ms, "
                    f"server {server_ms:.2f} ms")
                if r >= 0:
                    runs[(s, lay)].append({"rate": rate, "puts": res["puts"], "writes": res["writes"],
                                           "client_ms": client_ms, "server_ms": server_ms})
                if s == SAVERS[1]:
                    written.update({(t, None): final for t in res["threads"]})
    benchio.readback(lambda: open_store(a.dsn, schema=schema), written, reader=benchio.langgraph_values, runs=None)
    log(benchio.read_back_note())
    procs = f"{a.procs} processes x {a.conversations // a.procs} conversations"
    names = {"one": f"{a.conversations} conversations, one event loop", "procs": procs}
    print(f"## {a.conversations} LangGraph conversations at once, {a.steps} super-steps each, "
          f"pools of {a.pool} connections, medians of {a.rounds} rounds\n")
    print("| layout | saver | super-steps/s | ratio (agck / LangGraph) | aput p50 ms | aput p99 ms "
          "| aput_writes p50 ms | aput_writes p99 ms | client CPU ms / super-step | server CPU ms / super-step |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    out = {"rounds": a.rounds, "pool": a.pool, "conversations": a.conversations, "procs": a.procs,
           "steps": a.steps, "cases": {}}
    for lay in layouts:
        base = statistics.median(x["rate"] for x in runs[(SAVERS[0], lay)])
        for s in SAVERS:
            rs = runs[(s, lay)]
            rate = statistics.median(x["rate"] for x in rs)
            puts = [v for x in rs for v in x["puts"]]
            writes = [v for x in rs for v in x["writes"]]
            row = {"rate": rate, "put_p50_ms": _pct(puts, .5), "put_p99_ms": _pct(puts, .99),
                   "writes_p50_ms": _pct(writes, .5), "writes_p99_ms": _pct(writes, .99),
                   "client_cpu_ms": statistics.median(x["client_ms"] for x in rs),
                   "server_cpu_ms": statistics.median(x["server_ms"] for x in rs)}
            out["cases"][f"{lay} | {s}"] = row
            ratio = f"{rate / base:.2f}x" if s != SAVERS[0] else ""
            print(f"| {names[lay]} | {s} | {rate:.0f} | {ratio} | {row['put_p50_ms']:.1f} | "
                  f"{row['put_p99_ms']:.1f} | {row['writes_p50_ms']:.1f} | {row['writes_p99_ms']:.1f} | "
                  f"{row['client_cpu_ms']:.2f} | {row['server_cpu_ms']:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
