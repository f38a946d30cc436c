#!/usr/bin/env python3
"""The LangGraph checkpointer on Postgres: agck's AgckSaver against LangGraph's own
PostgresSaver (langgraph-checkpoint-postgres), on the same server, in one run.

Cases, alternated each round with their order rotated, after one warm-up round:

- put and get of a checkpoint whose state is one float32 array channel of 16 MiB,
  and of 64 MiB (a fresh array each put: new content), plus a "messages" channel;
- put and get of a small state: a few chat messages, about 10 KB in all (50 timed
  calls a round);
- the floor for a put of new content: the array's bytes as one bytea row, sent in
  binary and committed (Postgres writes them through its WAL either way), and lower
  still, the same bytes as 1 MiB rows in one binary COPY, committed; for the
  small state, the messages as LangGraph's serializer writes them, one row, committed
  (one round trip and one commit: what any durable put costs at least).

The values a put writes are made before its clock starts.

Each put writes a new checkpoint of one thread (``put`` with the changed channels
in ``new_versions``, as LangGraph calls it); each get is ``get_tuple`` of the
newest checkpoint of the thread. PostgresSaver keeps a numpy array as LangGraph's
msgpack bytes; AgckSaver as a raw, checksummed blob (verified on get).

Then a compiled 100-super-step graph whose large channel (16 MiB) is written once
and never changes: the bytes each saver's tables grow by (pg_total_relation_size),
which shows whether the unchanged channel is written once or every step.

At the end, what AgckSaver wrote is read back through a store object of its own
(benchio.readback): each thread's last checkpoint compared bit for bit with the
values put (the graph's: with its final state), and every checkpoint of the store
must verify; the first that does not ends the run, status 1.

    pip install -e '.[test]' langgraph-checkpoint-postgres==3.2.0 'psycopg[binary]==3.3.9'
    python scripts/bench_langgraph.py [--rounds 5] [--dsn postgresql://...] [--json F] [--sizes small,16,64]
                                      [--no-graph]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchio  # noqa: E402  (puts the checkout on sys.path, before agck is imported)

import numpy as np  # noqa: E402
import psycopg2  # noqa: E402

DSN = os.environ.get("AGCK_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/test")
MiB = 1 << 20


def _messages(n: int = 20):
    from langchain_core.messages import AIMessage, HumanMessage
    return [(HumanMessage if i % 2 == 0 else AIMessage)(content=f"message {i}: " + "lorem ipsum " * 40)
            for i in range(n)]


def _copy_rows(array) -> bytes:
    """A binary COPY stream of one bytea column: ``array``'s bytes as 1 MiB rows."""
    data = memoryview(array).cast("B")
    out = [b"PGCOPY\n\xff\r\n\x00" + struct.pack("!ii", 0, 0)]
    for i in range(0, len(data), MiB):
        row = data[i:i + MiB]
        out += [struct.pack("!hi", 1, len(row)), row]
    out.append(struct.pack("!h", -1))
    return b"".join(out)


class Subject:
    """One saver with its own tables, and a thread to put to and get from."""

    def __init__(self, name: str, saver, tables_size):
        self.name, self.saver, self.tables_size = name, saver, tables_size
        self.parent = None
        self.thread = f"bench-{secrets.token_hex(3)}"
        self.n = 0

    def put(self, values: dict):
        from langgraph.checkpoint.base import create_checkpoint, empty_checkpoint
        self.n += 1
        base = empty_checkpoint()
        versions = {k: self.saver.get_next_version(None, None) if self.n == 1 else f"{self.n:032d}.0"
                    for k in values}
        base["channel_values"] = values
        base["channel_versions"] = versions
        ck = create_checkpoint(base, None, self.n)
        cfg = {"configurable": {"thread_id": self.thread, "checkpoint_ns": ""}}
        if self.parent:
            cfg["configurable"]["checkpoint_id"] = self.parent
        out = self.saver.put(cfg, ck, {"source": "loop", "step": self.n, "parents": {}}, versions)
        self.parent = out["configurable"]["checkpoint_id"]

    def get(self):
        t = self.saver.get_tuple({"configurable": {"thread_id": self.thread, "checkpoint_ns": ""}})
        assert t is not None
        return t


def _graph_growth(subject: Subject, steps: int = 100, big_mb: int = 16) -> tuple[int, str, dict]:
    """Bytes the saver's tables grow by over a graph of ``steps`` super-steps whose
    large channel is set once; the graph's thread, and its final state."""
    from typing import TypedDict

    from langgraph.graph import END, START, StateGraph

    class State(TypedDict):
        big: np.ndarray
        count: int

    big = np.random.default_rng(1).random(big_mb * MiB // 8)

    def init(state):
        return {"big": big, "count": 0}

    def tick(state):
        return {"count": state["count"] + 1}

    b = StateGraph(State)
    b.add_node("init", init)
    b.add_node("tick", tick)
    b.add_edge(START, "init")
    b.add_edge("init", "tick")
    b.add_conditional_edges("tick", lambda s: "tick" if s["count"] < steps else END)
    graph = b.compile(checkpointer=subject.saver)
    before = subject.tables_size()
    thread = f"graph-{subject.thread}"
    out = graph.invoke({"count": 0}, {"configurable": {"thread_id": thread}, "recursion_limit": steps + 10})
    assert out["count"] == steps
    return subject.tables_size() - before, thread, out


def _conversation_growth(subject: Subject, turns: int = 100) -> tuple[int, str, dict]:
    """Bytes the saver's tables grow by over a chat of ``turns`` turns (a super-step each:
    a human message and an AI answer appended to ``messages``, English-like text), the
    thread, and its final state."""
    from typing import Annotated, TypedDict

    from langchain_core.messages import AIMessage, HumanMessage
    from langgraph.graph import END, START, StateGraph
    from langgraph.graph.message import add_messages

    from bench_compress import word_list

    rng = np.random.default_rng(2)
    words = word_list(rng, 5000)
    weights = 1 / np.arange(1, len(words) + 1) ** 1.1     # Zipf, as bench_compress's conversation
    weights /= weights.sum()

    def paragraph(sentences: int) -> str:
        out = []
        for _ in range(sentences):
            text = " ".join(words[i] for i in rng.choice(len(words), rng.integers(5, 25), p=weights))
            out.append(text[0].upper() + text[1:] + ".")
        return " ".join(out)

    # the functional form: this module's annotations are strings, evaluated where these names are not
    State = TypedDict("State", {"messages": Annotated[list, add_messages], "turn": int})

    def chat(state):
        return {"messages": [HumanMessage(content=paragraph(int(rng.integers(1, 5)))),
                             AIMessage(content=paragraph(int(rng.integers(3, 12))))],
                "turn": state["turn"] + 1}

    b = StateGraph(State)
    b.add_node("chat", chat)
    b.add_edge(START, "chat")
    b.add_conditional_edges("chat", lambda s: "chat" if s["turn"] < turns else END)
    graph = b.compile(checkpointer=subject.saver)
    before = subject.tables_size()
    thread = f"chat-{subject.thread}"
    out = graph.invoke({"messages": [], "turn": 0}, {"configurable": {"thread_id": thread},
                                                     "recursion_limit": turns + 10})
    assert out["turn"] == turns and len(out["messages"]) == 2 * turns
    return subject.tables_size() - before, thread, out


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dsn", default=DSN)
    p.add_argument("--json")
    p.add_argument("--sizes", default="small,16,64",
                   help="the states to measure: small and/or MiB of the array channel (the small put measured "
                        "alone, without large puts filling the server's WAL alongside: --sizes small)")
    p.add_argument("--no-graph", action="store_true", help="skip the 100-super-step graph")
    p.add_argument("--no-chat", action="store_true", help="skip the 100-turn conversation")
    p.add_argument("--chat-only", action="store_true", help="only the 100-turn conversation")
    a = p.parse_args(argv)
    from langgraph.checkpoint.postgres import PostgresSaver
    from psycopg import Connection
    from psycopg.rows import dict_row

    from agck import open_store
    from agck.integrations.langgraph import AgckSaver
    from agck.stores.postgres.store import PostgresStore

    schema = f"bench_lg_{secrets.token_hex(3)}"
    admin = psycopg2.connect(a.dsn)
    admin.autocommit = True
    admin.cursor().execute(f"CREATE SCHEMA {schema}")

    def size_of(pattern: str):
        def f() -> int:
            cur = admin.cursor()
            cur.execute("SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
                        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relkind = 'r' "
                        "AND c.relname LIKE %s", (schema, pattern))
            return int(cur.fetchone()[0])
        return f

    conn = Connection.connect(a.dsn, autocommit=True, prepare_threshold=0, row_factory=dict_row,
                              options=f"-c search_path={schema}")
    lg = PostgresSaver(conn)
    lg.setup()
    store = PostgresStore(a.dsn, prefix="agck", schema=schema, init=True)
    zstore = PostgresStore(a.dsn, prefix="agckz", schema=schema, init=True, compress="zstd")
    subjects = [Subject("LangGraph PostgresSaver", lg, size_of("checkpoint%")),
                Subject("agck AgckSaver (Postgres)", AgckSaver(store), size_of("agck\\_%"))]
    zsubject = Subject('agck AgckSaver (Postgres, compress="zstd")', AgckSaver(zstore), size_of("agckz\\_%"))
    written = {}     # (thread, checkpoint id) -> the values AgckSaver was given there, to read back
    log = lambda m: print(m, file=sys.stderr, flush=True)   # noqa: E731
    results: dict = {"rounds": a.rounds, "cases": {}, "graph_growth": {}}
    try:
        msgs = _messages()
        sizes = [("small (~10 KB of messages)", None) if x == "small" else (f"{int(x)} MiB array", int(x))
                 for x in ([] if a.chat_only else a.sizes.split(","))]
        cases = []
        threads = []     # AgckSaver's
        rng = np.random.default_rng(0)
        admin.cursor().execute(f"CREATE TABLE {schema}.floor_small (b bytea); CREATE TABLE {schema}.floor (b bytea); "
                               f"ALTER TABLE {schema}.floor ALTER b SET STORAGE EXTERNAL; "
                               f"CREATE TABLE {schema}.floor_rows (b bytea); "
                               f"ALTER TABLE {schema}.floor_rows ALTER b SET STORAGE EXTERNAL")
        for label, mb in sizes:
            def values(mb=mb):
                vals = {"messages": msgs}
                if mb:
                    vals["x"] = rng.random(mb * MiB // 4, dtype=np.float32)   # new content each put
                return vals

            for s in subjects:
                t = Subject(s.name, s.saver, s.tables_size)     # a thread of its own per size
                t.written = values()
                t.put(t.written)                                 # so that a get never finds nothing
                t.next = values()                                # made untimed, after each put
                if s is subjects[1]:
                    threads.append(t)

                def renew(t=t, v=values):
                    t.written, t.next = t.next, v()             # what the puts wrote kept, to read back
                inner = 1 if mb else 50    # a few ms each: 50 timed calls a round
                cases.append(benchio.Case(f"put {label} | {s.name}", lambda t=t: t.put(t.next), after=renew,
                                          nbytes=(mb or 0) * MiB, inner=inner))
                cases.append(benchio.Case(f"get {label} | {s.name}", t.get, nbytes=(mb or 0) * MiB, inner=inner))
            if not mb:
                # the floor for a small put: the messages as LangGraph's serializer writes
                # them, one bytea row (the table's default storage: compressed, as
                # PostgresSaver's blobs are), committed; serialized before the clock starts
                from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
                small = JsonPlusSerializer().dumps_typed(msgs)[1]

                def insert_small(b=small):
                    conn.execute("INSERT INTO floor_small (b) VALUES (%b)", [b])
                cases.append(benchio.Case(f"put {label} | one INSERT of its bytes", insert_small, inner=inner))
            else:
                # the floor for a put of new content: the same bytes as one bytea row, sent in
                # binary, committed (synchronous_commit on, as both savers' commits are)
                floor = {"data": values()["x"]}

                def insert(f=floor):
                    conn.execute("INSERT INTO floor (b) VALUES (%b)", [memoryview(f["data"]).cast("B")])

                def clear(f=floor, v=values):
                    conn.execute("TRUNCATE floor")
                    f["data"] = v()["x"]
                cases.append(benchio.Case(f"put {label} | one INSERT of its bytes", insert, after=clear,
                                          nbytes=mb * MiB))

                # a lower floor: the same bytes as 1 MiB rows in one binary COPY, committed (the
                # stream made before the clock starts): the fastest way found here to move them in
                copy_floor = {"stream": _copy_rows(values()["x"])}

                def copy_rows(f=copy_floor):
                    with conn.cursor().copy("COPY floor_rows (b) FROM STDIN (FORMAT binary)") as cp:
                        cp.write(f["stream"])

                def clear_rows(f=copy_floor, v=values):
                    conn.execute("TRUNCATE floor_rows")
                    f["stream"] = _copy_rows(v()["x"])
                cases.append(benchio.Case(f"put {label} | one COPY of its bytes as 1 MiB rows", copy_rows,
                                          after=clear_rows, nbytes=mb * MiB))
        if cases:
            benchio.run_rounds(cases, a.rounds, log, warmup=1)
        written.update({(t.thread, t.parent): t.written for t in threads})
        rows = []
        for c in cases:
            results["cases"][c.name] = c.times
            rows.append((c.name, c.median))
        if cases:
            print(f"## LangGraph checkpointers on one Postgres server, medians of {a.rounds} rounds\n")
            print("| case | saver | median ms | ratio (PostgresSaver / agck) |")
            print("|---|---|---:|---:|")
        med = dict(rows)
        for label, mb in sizes:
            for op in ("put", "get"):
                ref = med[f"{op} {label} | {subjects[0].name}"]
                ours = med[f"{op} {label} | {subjects[1].name}"]
                print(f"| {op} {label} | {subjects[0].name} | {ref * 1e3:.1f} | |")
                print(f"| {op} {label} | {subjects[1].name} | {ours * 1e3:.1f} | {ref / ours:.2f}x |")
                if op == "put":
                    floor = med[f"put {label} | one INSERT of its bytes"]
                    what = "the array's bytes" if mb else "the messages' msgpack bytes"
                    print(f"| {op} {label} | floor: one INSERT of {what} | {floor * 1e3:.1f} | "
                          f"PostgresSaver {ref / floor:.2f}x, agck {ours / floor:.2f}x of it |")
                    if mb:
                        floor = med[f"put {label} | one COPY of its bytes as 1 MiB rows"]
                        print(f"| {op} {label} | floor: one COPY of the array's bytes as 1 MiB rows | "
                              f"{floor * 1e3:.1f} | PostgresSaver {ref / floor:.2f}x, agck {ours / floor:.2f}x of it |")
        if not a.no_chat:
            print(f"\n{100} turns of a chat (add_messages; a checkpoint per turn):\n")
            print("| saver | tables grew by |")
            print("|---|---:|")
            results["chat_growth"] = {}
            for s in subjects + [zsubject]:
                grew, thread, final = _conversation_growth(s)
                results["chat_growth"][s.name] = grew
                print(f"| {s.name} | {grew / 1e6:.2f} MB |")
                if s is subjects[1]:
                    written[(thread, None)] = final
        if not a.no_graph and not a.chat_only:
            print("\n100 super-steps, a 16 MiB channel set once, then only a counter changes:\n")
            print("| saver | tables grew by |")
            print("|---|---:|")
            for s in subjects:
                grew, thread, final = _graph_growth(s)
                results["graph_growth"][s.name] = grew
                print(f"| {s.name} | {grew / MiB:.1f} MiB |")
                if s is subjects[1]:
                    written[(thread, None)] = final      # None: the thread's newest checkpoint
        benchio.readback(lambda: open_store(a.dsn, prefix="agck", schema=schema), written,
                         reader=benchio.langgraph_values, runs=None)
        log(benchio.read_back_note())
    finally:
        conn.close()
        store.close()
        zstore.close()
        admin.cursor().execute(f"DROP SCHEMA {schema} CASCADE")
        admin.close()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
