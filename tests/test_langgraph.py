"""agck.integrations.langgraph: LangGraph's checkpointer conformance suite on every
store, values through agck's codec (no pickle), incremental channel writes,
damaged checkpoints, and a human-in-the-loop graph SIGKILLed and resumed.

Print the conformance reports with:

    python -m pytest tests/test_langgraph.py -k conformance -s -q
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import logging
import operator
import os
import signal
import subprocess
import sys
import textwrap
import threading
import uuid
from typing import Annotated, TypedDict

import numpy as np
import pytest

pytest.importorskip("langgraph")
pytest.importorskip("langgraph.checkpoint.conformance")

import ormsgpack  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage  # noqa: E402
from langgraph.channels.delta import DeltaChannel  # noqa: E402
from langgraph.checkpoint.base import CheckpointTuple  # noqa: E402
from langgraph.checkpoint.base.id import uuid6  # noqa: E402
from langgraph.checkpoint.conformance import checkpointer_test, validate  # noqa: E402
from langgraph.checkpoint.conformance.capabilities import ALL_CAPABILITIES  # noqa: E402
from langgraph.checkpoint.serde import jsonplus  # noqa: E402
from langgraph.graph import END, START, StateGraph  # noqa: E402
from langgraph.graph.message import add_messages  # noqa: E402
from langgraph.types import Command, Interrupt, Send, interrupt  # noqa: E402

import agck  # noqa: E402
from agck.errors import CheckpointExistsError, CorruptCheckpointError, EncodeError, UsageError  # noqa: E402
from agck.integrations import langgraph as lgmod  # noqa: E402
from agck.integrations.langgraph import AgckSaver, DamagedCheckpointError, checkpoint_key  # noqa: E402
from agck.stores import open_store  # noqa: E402

from conftest import BACKENDS, make_spec  # noqa: E402
from storehelpers import corrupt_payload  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _saver(kind, request, tmp_path, **kw) -> AgckSaver:
    _, url, opts = make_spec(kind, request, tmp_path)
    return AgckSaver(url, **opts, **kw)


def _cfg(thread, ns="", cid=None):
    c = {"configurable": {"thread_id": thread, "checkpoint_ns": ns}}
    if cid:
        c["configurable"]["checkpoint_id"] = cid
    return c


def _checkpoint(values, versions, seen=None):
    return {"v": 1, "id": str(uuid6(clock_seq=-1)), "ts": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "channel_values": values, "channel_versions": versions, "versions_seen": seen or {},
            "updated_channels": None}


def _put(saver, thread, values, versions, new, parent=None, ns="", **md):
    cp = _checkpoint(values, versions)
    cfg = _cfg(thread, ns, parent["configurable"]["checkpoint_id"] if parent else None)
    return saver.put(cfg, cp, {"source": "loop", "step": md.pop("step", 0), "parents": {}, **md}, new)


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


# --- the conformance suite --------------------------------------------------------------

@pytest.mark.parametrize("kind", BACKENDS)
def test_conformance(kind, request, tmp_path):
    """Every base and extended capability of langgraph-checkpoint-conformance passes."""
    _, url, opts = make_spec(kind, request, tmp_path)
    store = open_store(url, **opts)

    @checkpointer_test(name=f"AgckSaver on {kind} store")
    async def factory():
        yield AgckSaver(store)

    try:
        report = asyncio.run(validate(factory))
    finally:
        store.close()
    report.print_report()
    print("  tests passed: " + ", ".join(f"{name} {r.tests_passed}/{r.tests_passed + r.tests_failed}"
                                        for name, r in sorted(report.results.items())))
    failures = {name: r.failures for name, r in report.results.items() if r.passed is not True}
    assert not failures, failures
    assert set(report.results) == {c.value for c in ALL_CAPABILITIES}
    assert all(r.detected and r.tests_passed > 0 for r in report.results.values())
    assert report.conformance_level() == "FULL"


# --- names and keys -------------------------------------------------------------------------

def test_checkpoint_keys_order_as_ids():
    ids = [str(uuid6(clock_seq=i % 5)) for i in range(2000)]
    keys = [checkpoint_key(i) for i in ids]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    assert all(0 <= k < 2 ** 63 for k in keys)
    other = sorted(str(uuid.uuid4()) for _ in range(500))
    okeys = [checkpoint_key(i) for i in other]
    assert okeys == sorted(okeys)
    for bad in ("1", "", None, 7, str(uuid.uuid4()).upper(), "{" + str(uuid.uuid4()) + "}", "x" * 36):
        assert checkpoint_key(bad) is None


@pytest.mark.parametrize("kind", BACKENDS)
def test_thread_ids_of_any_form(kind, request, tmp_path):
    saver = _saver(kind, request, tmp_path)
    threads = ["t", "", "a.b", "x" * 500, "ünï/cöde\n", "h" + "0" * 40, "lg.r.r.c", "\ud800lone", "a\x00b"]
    for t in threads:
        _put(saver, t, {"who": t}, {"who": 1}, {"who": 1})
        _put(saver, t, {"who": t + "!"}, {"who": 1}, {"who": 1}, ns="sub:1|deeper:2")
    for t in threads:
        assert saver.get_tuple(_cfg(t)).checkpoint["channel_values"] == {"who": t}
        assert saver.get_tuple(_cfg(t, "sub:1|deeper:2")).checkpoint["channel_values"] == {"who": t + "!"}
        assert len(list(saver.list({"configurable": {"thread_id": t}}))) == 2     # every namespace
    assert len(list(saver.list(None))) == 2 * len(threads)
    for run in saver.store.runs():
        assert len(run) <= 200
    saver.delete_thread("a.b")
    assert saver.get_tuple(_cfg("a.b")) is None and saver.get_tuple(_cfg("t")) is not None


def test_bad_ids_and_configs_are_refused(tmp_path):
    saver = AgckSaver(str(tmp_path / "s"))
    cp = _checkpoint({}, {})
    cp["id"] = "checkpoint-1"
    with pytest.raises(UsageError, match="not a UUID in canonical form") as e:
        saver.put(_cfg("t"), cp, {}, {})
    assert e.value.hint and isinstance(e.value, agck.AgckError)
    with pytest.raises(UsageError, match="thread_id"):
        saver.get_tuple({"configurable": {}})
    with pytest.raises(UsageError, match="strategy"):
        saver.prune(["t"], strategy="keep_some")
    with pytest.raises(UsageError, match="on_damaged"):
        AgckSaver(str(tmp_path / "s"), on_damaged="ignore")
    assert saver.get_tuple(_cfg("t", cid="checkpoint-1")) is None


def test_two_ids_with_one_key_are_refused(tmp_path):
    saver = AgckSaver(str(tmp_path / "s"))
    first = _put(saver, "t", {"a": 1}, {"a": 1}, {"a": 1})
    cid = first["configurable"]["checkpoint_id"]
    twin = str(uuid.UUID(int=uuid.UUID(cid).int ^ 0xABCDEF))    # another node: same time, same key
    assert twin != cid and checkpoint_key(twin) == checkpoint_key(cid)
    cp = _checkpoint({"a": 2}, {"a": 2})
    cp["id"] = twin
    with pytest.raises(CheckpointExistsError, match="same key"):
        saver.put(_cfg("t"), cp, {}, {"a": 2})
    t = saver.get_tuple(_cfg("t"))
    assert t.checkpoint["id"] == cid and t.checkpoint["channel_values"] == {"a": 1}
    # the same id put again replaces it
    cp["id"] = cid
    saver.put(_cfg("t"), cp, {"step": 9}, {"a": 2})
    t = saver.get_tuple(_cfg("t"))
    assert t.checkpoint["channel_values"] == {"a": 2} and t.metadata["step"] == 9


# --- values --------------------------------------------------------------------------------

@dataclasses.dataclass
class Note:
    text: str
    tags: list


class Opaque:
    pass


def _assert_same(a, b):
    assert type(a) is type(b), (a, b)
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    elif type(a).__module__ == "torch":
        import torch
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    else:
        assert a == b


def test_values_round_trip(tmp_path):
    torch = pytest.importorskip("torch")
    saver = AgckSaver(str(tmp_path / "s"))
    msgs = [HumanMessage("hi", id="1"),
            AIMessage("", tool_calls=[{"name": "f", "args": {"x": 1}, "id": "c"}], id="2"),
            ToolMessage("ok", tool_call_id="c", id="3")]
    values = {
        "messages": msgs,
        "plain": {"s": "x", "i": 2 ** 80, "f": -0.0, "c": 1 + 2j, "b": b"\x00\xff", "n": None, "t": (1, (2, "3")),
                  "set": {1, 2}, "fs": frozenset({"a"}), 3: [True, False], (1, 2): "tuple key"},
        "marked": (lgmod._MARK, "m", b"not msgpack"),     # a user tuple that looks like the internal form
        "ba": bytearray(b"abc"),
        "arrays": {"f32": np.arange(12, dtype=np.float32).reshape(3, 4), "i8": np.array([1, -1], np.int8),
                   "scalar": np.float64(2.5)},
        "tensors": [torch.randn(4, 3).to(torch.bfloat16), torch.arange(5), torch.zeros(2, 2, dtype=torch.bool)],
        "objects": [Document(page_content="doc", metadata={"k": 1}), datetime.datetime(2024, 1, 2, 3, 4, 5),
                    uuid.UUID(int=5), Send("node", {"arg": 1}), Interrupt(value={"q": 1}, id="i1"),
                    Command(resume="yes")],
    }
    versions = {k: 1 for k in values}
    cfg = _put(saver, "t", values, versions, versions)
    saver.put_writes(cfg, [("messages", msgs[:1]), ("arrays", values["arrays"])], "task-1")
    t = saver.get_tuple(_cfg("t"))
    got = t.checkpoint["channel_values"]
    serde = jsonplus.JsonPlusSerializer()        # objects come back as LangGraph's own serializer returns them
    values["objects"] = [serde.loads_typed(serde.dumps_typed(o)) for o in values["objects"]]
    for k, v in values.items():
        _assert_same(v, got[k])
    assert [w[:2] for w in t.pending_writes] == [("task-1", "messages"), ("task-1", "arrays")]
    _assert_same(t.pending_writes[0][2], msgs[:1])
    _assert_same(t.pending_writes[1][2], values["arrays"])

    # arrays and tensors are raw blobs of the container, objects LangGraph's msgpack bytes
    runs = lgmod._Runs.of("t", "")
    # the small values a checkpoint changed are in its record: one store entry per put
    entry = saver.store.read(runs.records, checkpoint_key(cfg["configurable"]["checkpoint_id"]))
    assert saver.store.runs() == sorted([runs.records, runs.writes(entry.step)])
    paths = {d["path"] for d in entry.tensors}
    assert "state['values']['arrays']['f32']" in paths and "state['values']['tensors'][0]" in paths
    values = entry.state["values"]
    # a list of objects only is one msgpack value, as LangGraph's savers store a channel
    mark, kind, data = values["messages"]
    assert (mark, kind) == (lgmod._MARK, lgmod._K_MSGPACK) and saver.serde.pickle_fallback is False
    assert saver.serde.loads_typed(("msgpack", data)) == msgs
    # a list that holds a tensor keeps the tensor raw, the objects beside it msgpack
    assert type(values["tensors"]) is list and isinstance(values["tensors"][0], torch.Tensor)


def test_pickle_and_unlisted_classes_are_refused(tmp_path):
    saver = AgckSaver(str(tmp_path / "s"))
    with pytest.raises(EncodeError, match=r"channel 'x'\[0\]\['o'\]: cannot encode .*Opaque without pickle") as e:
        _put(saver, "t", {"x": [{"o": Opaque()}]}, {"x": 1}, {"x": 1})
    assert isinstance(e.value, agck.AgckError) and e.value.ref
    for _ in range(2):   # the second time from the verdicts the saver keeps per payload
        with pytest.raises(EncodeError, match="Note, which is not on the saver's allowlist") as e:
            _put(saver, "t", {"note": Note("a", [1])}, {"note": 1}, {"note": 1})
        assert f"allowed_types=[({Note.__module__!r}, 'Note')]" in e.value.hint
    # in a list of objects (encoded as one value) the refused item is still named
    with pytest.raises(EncodeError, match=r"channel 'x'\[1\]: cannot encode .*Opaque without pickle"):
        _put(saver, "t", {"x": [uuid.UUID(int=1), Opaque()]}, {"x": 1}, {"x": 1})
    with pytest.raises(EncodeError, match=r"channel 'x'\[2\]: holds .*Note, which is not on"):
        _put(saver, "t", {"x": [uuid.UUID(int=1), uuid.UUID(int=2), Note("a", [1])]}, {"x": 1}, {"x": 1})
    with pytest.raises(EncodeError, match=r"channel value state\['x'\]: cannot encode numpy array of object"):
        _put(saver, "t", {"x": np.array([Opaque()])}, {"x": 1}, {"x": 1})
    assert saver.get_tuple(_cfg("t")) is None                     # nothing was written
    cfg = _put(saver, "t", {}, {}, {})
    with pytest.raises(EncodeError, match="pending write 'ch' of task k"):
        saver.put_writes(cfg, [("ch", Opaque())], "k")
    assert saver.get_tuple(_cfg("t")).pending_writes == []

    allowed = AgckSaver(saver.store, allowed_types=[Note])
    _put(allowed, "u", {"note": Note("a", [1])}, {"note": 1}, {"note": 1})
    assert allowed.get_tuple(_cfg("u")).checkpoint["channel_values"]["note"] == Note("a", [1])
    # LangGraph's strict mode adds a graph's state types through with_allowlist
    clone = saver.with_allowlist([(Note.__module__, "Note")])
    assert clone is not saver and clone.store is saver.store
    assert clone.get_tuple(_cfg("u")).checkpoint["channel_values"]["note"] == Note("a", [1])
    # a saver without it refuses to rebuild it, and says which class
    with pytest.raises(DamagedCheckpointError, match=f"{Note.__module__}.Note, which is not on the allowlist"):
        saver.get_tuple(_cfg("u"))


def test_stored_classes_are_never_imported_on_load(tmp_path):
    """A value naming an unlisted class, with valid checksums (a hostile writer), is
    refused on load; the class is neither imported nor called."""
    saver = AgckSaver(str(tmp_path / "s"))
    cfg = _put(saver, "t", {"x": 1}, {"x": 1}, {"x": 1})
    marker = tmp_path / "pwned"
    evil = ormsgpack.packb(ormsgpack.Ext(jsonplus.EXT_CONSTRUCTOR_POS_ARGS, ormsgpack.packb(
        ("os", "system", (f"touch {marker}",)))))
    runs = lgmod._Runs.of("t", "")
    key = checkpoint_key(cfg["configurable"]["checkpoint_id"])
    record = saver.store.read(runs.records, key)
    # in the record (where a put stores a small value), and in the values run (where an
    # earlier layout stored it, and a deleted record's values are kept)
    for place in ("record", "values run"):
        state = {**record.state, "values": {"x": (lgmod._MARK, "m", evil)}}
        if place == "values run":
            saver.store.put(runs.values, key, state.pop("values"))
        saver.store.put(runs.records, key, state, meta=record.meta, parent=record.parent)
        with pytest.raises(DamagedCheckpointError, match=r"os.system, which is not on the allowlist") as e:
            saver.get_tuple(cfg)
        assert e.value.part == "the value of channel 'x'" and isinstance(e.value.cause, agck.MalformedCheckpointError)
        assert e.value.ref == saver.store.ref(runs.records if place == "record" else runs.values, key)
    assert not marker.exists()


def test_unchanged_channels_are_written_once(tmp_path):
    saver = AgckSaver(str(tmp_path / "s"))
    big = np.random.default_rng(0).random(1 << 18)               # 2 MiB: a store checkpoint of its own
    versions = {"big": 1, "n": 1, "cfg": 1}
    cfg = _put(saver, "t", {"big": big, "n": 0, "cfg": "x"}, versions, dict(versions))
    keys = [checkpoint_key(cfg["configurable"]["checkpoint_id"])]
    for i in range(1, 6):
        versions = {"big": 1, "n": i + 1, "cfg": 1}
        cfg = _put(saver, "t", {"big": big, "n": i, "cfg": "x"}, versions, {"n": i + 1}, parent=cfg, step=i)
        keys.append(checkpoint_key(cfg["configurable"]["checkpoint_id"]))
    runs = lgmod._Runs.of("t", "")
    assert saver.store.steps(runs.own("big")) == keys[:1]
    assert saver.store.steps(runs.values) == []                    # small values live in the records
    entries = saver.store.list(runs.records)
    assert [e.step for e in entries] == keys
    assert set(saver.store.read(runs.records, keys[0]).state["values"]) == {"n", "cfg"}
    for info in entries[1:]:
        assert set(saver.store.read(runs.records, info.step).state["values"]) == {"n"} and info.size < 4096
    for i, t in enumerate(reversed(list(saver.list(_cfg("t"))))):
        assert t.checkpoint["channel_values"]["n"] == i and t.checkpoint["channel_values"]["cfg"] == "x"
        assert np.array_equal(t.checkpoint["channel_values"]["big"], big)

    # a large channel that changes is read at its newest version only, though the small
    # channel 'cfg' still lives in the first checkpoint's entry
    for i in range(6, 9):
        versions = {"big": i, "n": i + 1, "cfg": 1}
        cfg = _put(saver, "t", {"big": big + i, "n": i, "cfg": "x"}, versions, {"big": i, "n": i + 1},
                   parent=cfg, step=i)
        keys.append(checkpoint_key(cfg["configurable"]["checkpoint_id"]))
    reads, read = [], saver.store.read
    saver.store.read = lambda run, step, **kw: reads.append((run, step)) or read(run, step, **kw)
    t = saver.get_tuple(_cfg("t"))
    assert np.array_equal(t.checkpoint["channel_values"]["big"], big + 8)
    assert sorted(reads) == sorted([(runs.records, keys[-1]), (runs.own("big"), keys[-1]), (runs.records, keys[0])])


@pytest.mark.parametrize("kind", BACKENDS)
def test_listing(kind, request, tmp_path):
    """Filters are decided on the stores' listed meta (JSON in SQL stores), then confirmed."""
    saver = _saver(kind, request, tmp_path)
    when = datetime.datetime(2024, 5, 6)
    made = []
    for i in range(6):
        ns = "" if i % 2 == 0 else "child:1"
        cfg = _put(saver, "t", {}, {}, {}, ns=ns, step=i, kind="a" if i < 3 else "b", pair=(i, i), at=when,
                   score=float(i), extra=None if i == 5 else [1, {"x": i}])
        made.append(cfg["configurable"]["checkpoint_id"])
    _put(saver, "other", {}, {}, {}, kind="a")

    def ids(config, **kw):
        return [t.checkpoint["id"] for t in saver.list(config, **kw)]

    every = {"configurable": {"thread_id": "t"}}                     # every namespace, newest first
    assert ids(every) == made[::-1]
    assert ids(_cfg("t")) == made[4::-2]
    assert ids(_cfg("t", "child:1")) == made[5::-2]
    assert ids(every, filter={"kind": "a"}) == made[2::-1]
    assert ids(every, filter={"pair": (4, 4)}) == [made[4]]
    assert ids(every, filter={"pair": [4, 4]}) == []                  # as LangGraph's savers compare: ==
    assert ids(every, filter={"at": when}) == made[::-1]            # a value JSON cannot hold
    assert ids(every, filter={"extra": None}) == [made[5]]
    assert ids(every, filter={"missing": None}) == made[::-1]
    assert ids(every, filter={"extra": [1, {"x": 2}]}) == [made[2]]
    assert ids(every, filter={"score": 3}) == [made[3]]             # 3 == 3.0
    assert ids(every, before=_cfg("t", cid=made[3])) == made[2::-1]
    assert ids(every, before=_cfg("t", cid=made[3]), limit=2, filter={"kind": "a"}) == made[2:0:-1]
    assert ids(every, limit=0) == []
    assert ids(_cfg("t", cid=made[2])) == [made[2]]
    assert len(ids(None)) == 7 and ids(None, filter={"kind": "a"})[0] != made[0]
    assert ids(None, filter={"kind": "b"}) == made[:2:-1]
    reads, read = [], saver.store.read                   # the listed meta rules out the others unread
    saver.store.read = lambda run, step, **kw: reads.append(run) or read(run, step, **kw)
    assert ids(every, filter={"kind": "b", "step": 4}) == [made[4]]
    assert [r for r in reads if r.endswith(".c")] == [lgmod._Runs.of("t", "").records]


def test_delete_for_runs_and_prune_free_values(tmp_path):
    saver = AgckSaver(str(tmp_path / "s"))
    runs = lgmod._Runs.of("t", "")
    cfg, keys = None, []
    for i in range(4):
        v = {"a": i + 1, "big": 1 if i < 2 else 3, "huge": 1 if i < 3 else 4}
        new = {c: n for c, n in v.items() if i == 0 or c == "a" or (c, i) in (("big", 2), ("huge", 3))}
        cfg = _put(saver, "t", {"a": np.full(10, i), "big": np.zeros(5) + (i >= 2), "huge": np.full(1 << 14, i)},
                   v, new, parent=cfg, step=i, run_id=f"r{i}")
        keys.append(checkpoint_key(cfg["configurable"]["checkpoint_id"]))
        saver.put_writes(cfg, [("a", i)], f"task{i}")
    saver.delete_for_runs(["r2", "r0"])
    left = list(saver.list(_cfg("t")))
    assert [t.metadata["run_id"] for t in left] == ["r3", "r1"]
    assert np.array_equal(left[0].checkpoint["channel_values"]["big"], np.ones(5))
    assert np.array_equal(left[1].checkpoint["channel_values"]["big"], np.zeros(5))
    assert np.all(left[0].checkpoint["channel_values"]["huge"] == 3)
    assert np.all(left[1].checkpoint["channel_values"]["huge"] == 0)
    # the small values of deleted r0 and r2 that r1 and r3 use ('big') were kept in the values run
    assert saver.store.steps(runs.values) == [keys[0], keys[2]]
    assert saver.store.steps(runs.own("huge")) == [keys[0], keys[3]]
    saver.prune(["t"])
    (only,) = list(saver.list(_cfg("t")))
    assert only.metadata["run_id"] == "r3" and only.pending_writes == [("task3", "a", 3)]
    assert np.array_equal(only.checkpoint["channel_values"]["big"], np.ones(5))
    assert saver.store.steps(runs.values) == [keys[2]]              # r2's, for r3's 'big'; r3's own are in its record
    assert saver.store.steps(runs.own("huge")) == [keys[3]]
    # the pruned checkpoints' runs (pending writes, values) leave no empty run behind
    assert [r for r in saver.store.runs() if ".w" in r] == [runs.writes(keys[3])]
    assert all(saver.store.steps(r) for r in saver.store.runs())
    saver.delete_thread("t")
    assert saver.store.runs() == []


def _extend(state, writes):
    return list(state or []) + [x for w in writes for x in w]


class DeltaState(TypedDict):
    items: Annotated[list, DeltaChannel(_extend, snapshot_frequency=3)]
    n: int


def test_prune_keeps_what_a_delta_channel_needs(tmp_path):
    b = StateGraph(DeltaState)
    b.add_node("step", lambda s: {"items": [s["n"]], "n": s["n"] + 1})
    b.add_edge(START, "step")
    b.add_edge("step", END)
    saver = AgckSaver(str(tmp_path / "s"))
    g = b.compile(checkpointer=saver)
    cfg = {"configurable": {"thread_id": "d"}}
    out = g.invoke({"items": [], "n": 0}, cfg)
    for _ in range(5):
        out = g.invoke({"n": out["n"]}, cfg)
    before = len(list(saver.list(cfg)))
    saver.prune(["d"])
    after = len(list(saver.list(cfg)))
    assert 1 < after < before
    assert g.get_state(cfg).values == {"items": list(range(6)), "n": 6}
    assert g.invoke({"n": 6}, cfg)["items"] == list(range(7))


def test_copy_thread_carries_values_and_writes(tmp_path):
    saver = AgckSaver(str(tmp_path / "s"))
    cfg = _put(saver, "src", {"a": np.arange(3), "m": [HumanMessage("x")]}, {"a": 1, "m": 1}, {"a": 1, "m": 1})
    cfg = _put(saver, "src", {"a": np.arange(3), "m": []}, {"a": 1, "m": 2}, {"m": 2}, parent=cfg, ns="n:1")
    saver.put_writes(cfg, [("m", [AIMessage("y")])], "t1")
    asyncio.run(saver.acopy_thread("src", "dst"))
    for ns in ("", "n:1"):
        s, d = saver.get_tuple(_cfg("src", ns)), saver.get_tuple(_cfg("dst", ns))
        assert d.config["configurable"]["thread_id"] == "dst" and s.checkpoint["id"] == d.checkpoint["id"]
        _assert_same(s.checkpoint["channel_values"], d.checkpoint["channel_values"])
        _assert_same(s.pending_writes, d.pending_writes)
    saver.delete_thread("src")
    assert saver.get_tuple(_cfg("dst", "n:1")).pending_writes[0][2] == [AIMessage("y")]


def test_large_values_of_the_longest_names(tmp_path):
    """A thread, namespace and channel of 64 characters each name a large value's run of
    more than 200 characters: it is hashed; copying the thread to a short id (and back to
    a long one) names the copies afresh, so they are found."""
    saver = AgckSaver(str(tmp_path / "s"))
    thread, ns, chan = "t" * 64, "n" * 64, "c" * 64
    big = np.arange(1 << 14, dtype=np.float64)                    # 128 KiB: a run of its own
    _put(saver, thread, {chan: big}, {chan: 1}, {chan: 1}, ns=ns)
    runs = lgmod._Runs.of(thread, ns)
    assert runs.own(chan).startswith(runs.base + "bh") and len(runs.own(chan)) <= 200
    assert saver.store.steps(runs.own(chan))
    assert np.array_equal(saver.get_tuple(_cfg(thread, ns)).checkpoint["channel_values"][chan], big)
    saver.copy_thread(thread, "s")
    assert saver.store.steps(lgmod._Runs.of("s", ns).base + "br" + chan)     # short enough: not hashed
    saver.copy_thread("s", "u" * 64)
    saver.delete_thread(thread)
    for t in ("s", "u" * 64):
        assert np.array_equal(saver.get_tuple(_cfg(t, ns)).checkpoint["channel_values"][chan], big)


def test_a_child_with_a_lower_id_than_its_parent_keeps_the_unchanged_values(tmp_path):
    """A thread continued on a host whose clock is behind: the child's id sorts before its
    parent's. The channels it did not change are still the parent's values."""
    saver = AgckSaver(str(tmp_path / "s"))
    early, late = sorted(str(uuid6(clock_seq=i)) for i in range(2))
    cp = _checkpoint({"messages": ["hi"], "x": 1}, {"messages": 1, "x": 1})
    cp["id"] = late
    parent = saver.put(_cfg("t"), cp, {"source": "loop", "step": 0, "parents": {}}, {"messages": 1, "x": 1})
    cp = _checkpoint({"messages": ["hi"], "x": 5}, {"messages": 1, "x": 2})
    cp["id"] = early
    saver.put(parent, cp, {"source": "loop", "step": 1, "parents": {}}, {"x": 2})
    child = saver.get_tuple(_cfg("t", cid=early))
    assert child.checkpoint["channel_values"] == {"messages": ["hi"], "x": 5}
    assert child.parent_config["configurable"]["checkpoint_id"] == late


def test_delete_thread_killed_part_way_leaves_whole_older_checkpoints(tmp_path):
    """delete_thread deletes a thread's records newest first: stopped part way, what is
    left is the older checkpoints, each with its parent and values."""
    saver = AgckSaver(str(tmp_path / "s"))
    cfg, ids = None, []
    for i in range(4):
        cfg = _put(saver, "t", {"n": i}, {"n": i + 1}, {"n": i + 1}, parent=cfg, step=i)
        ids.append(cfg["configurable"]["checkpoint_id"])
    deleted, delete = [], saver.store.delete

    def dying(run, step, **kw):
        if len(deleted) == 2:
            raise KeyboardInterrupt     # the process stopped here
        delete(run, step, **kw)
        deleted.append((run, step))
    saver.store.delete = dying
    with pytest.raises(KeyboardInterrupt):
        saver.delete_thread("t")
    saver.store.delete = delete
    left = list(saver.list(_cfg("t")))
    assert [t.checkpoint["id"] for t in left] == ids[:2][::-1]
    for t in left:
        assert t.checkpoint["channel_values"] == {"n": ids.index(t.checkpoint["id"])}
        assert t.parent_config is None or t.parent_config["configurable"]["checkpoint_id"] in ids[:2]


def test_list_of_an_empty_config_and_a_bound_of_the_wrong_type(tmp_path):
    saver = AgckSaver(str(tmp_path / "s"))
    a = _put(saver, "a", {"n": 1}, {"n": 1}, {"n": 1})
    _put(saver, "b", {"n": 2}, {"n": 1}, {"n": 1})
    assert {t.config["configurable"]["thread_id"] for t in saver.list({})} == {"a", "b"}   # as for None
    bound = {"configurable": {"checkpoint_id": uuid.UUID(a["configurable"]["checkpoint_id"])}}
    with pytest.raises(UsageError, match="str"):
        list(saver.list(_cfg("a"), before=bound))


class Counter(TypedDict):
    log: Annotated[list, operator.add]
    big: np.ndarray
    n: int


class Inner(TypedDict):
    n: int


def test_subgraph_interrupt_and_time_travel(tmp_path):
    saver = AgckSaver(str(tmp_path / "s"))

    def ask(s):
        return {"n": s["n"] + int(interrupt("how many?"))}

    inner = StateGraph(Inner)
    inner.add_node("ask", ask)
    inner.add_edge(START, "ask")
    inner.add_edge("ask", END)
    outer = StateGraph(Counter)
    outer.add_node("a", lambda s: {"log": ["a"], "n": s["n"] + 1, "big": np.full(1 << 14, s["n"] + 1.0)})
    outer.add_node("sub", inner.compile())
    outer.add_node("b", lambda s: {"log": ["b"], "n": s["n"] * 10})
    outer.add_edge(START, "a")
    outer.add_edge("a", "sub")
    outer.add_edge("sub", "b")
    outer.add_edge("b", END)
    graph = outer.compile(checkpointer=saver)
    cfg = {"configurable": {"thread_id": "tt"}}

    out = asyncio.run(graph.ainvoke({"log": [], "n": 1}, cfg))
    assert out["__interrupt__"][0].value == "how many?"
    (task,) = graph.get_state(cfg, subgraphs=True).tasks
    assert task.state.config["configurable"]["checkpoint_ns"].startswith("sub:")      # a namespace of its own
    out = graph.invoke(Command(resume="3"), cfg)
    assert out["log"] == ["a", "b"] and out["n"] == 50 and out["big"][0] == 2.0

    # fork from before 'b' with another n: the new branch runs, the old one stays
    (before_b,) = [h for h in graph.get_state_history(cfg) if h.next == ("b",)]
    fork = graph.update_state(before_b.config, {"n": 100})
    out = graph.invoke(None, fork)
    assert out["n"] == 1000 and out["log"] == ["a", "b"] and out["big"][0] == 2.0
    finals = sorted(h.values["n"] for h in graph.get_state_history(cfg) if not h.next)
    assert finals == [50, 1000]


# --- damaged checkpoints ------------------------------------------------------------------------

def _three(saver, thread="t"):
    cfgs, cfg = [], None
    for i in range(3):
        cfg = _put(saver, thread, {"emb": np.full(4096, float(i), np.float32), "n": i}, {"emb": i + 1, "n": i + 1},
                   {"emb": i + 1, "n": i + 1}, parent=cfg, step=i)
        saver.put_writes(cfg, [("n", i)], f"task{i}")
        cfgs.append(cfg)
    return [c["configurable"]["checkpoint_id"] for c in cfgs]


def test_damaged_newest_record(tmp_path, caplog):
    saver = AgckSaver(str(tmp_path / "s"))
    ids = _three(saver)
    runs = lgmod._Runs.of("t", "")
    path = saver.store.ref(runs.records, checkpoint_key(ids[2]))
    _flip(path, os.path.getsize(path) // 2)

    with pytest.raises(DamagedCheckpointError) as e:
        saver.get_tuple(_cfg("t"))
    err = e.value
    assert isinstance(err, CorruptCheckpointError) and isinstance(err, agck.AgckError)
    assert (err.thread_id, err.checkpoint_ns, err.part, err.ref) == ("t", "", "its record", path)
    assert err.checkpoint_id == ids[2]          # from the store's listing, though the record does not verify
    assert isinstance(err.previous, CheckpointTuple) and err.previous.checkpoint["id"] == ids[1]
    assert err.previous.checkpoint["channel_values"]["n"] == 1 and err.previous.pending_writes == [("task1", "n", 1)]
    text = str(err)
    assert ids[2] in text and "'t'" in text and "failed verification" in text and ids[1] in text and path in text
    with pytest.raises(DamagedCheckpointError):
        saver.get_tuple(_cfg("t", cid=ids[2]))
    with pytest.raises(DamagedCheckpointError):
        list(saver.list(_cfg("t")))
    assert saver.get_tuple(_cfg("t", cid=ids[1])).checkpoint["id"] == ids[1]
    assert [t.checkpoint["id"] for t in saver.list(_cfg("t"), before=_cfg("t", cid=ids[2]))] == ids[1::-1]

    lenient = AgckSaver(saver.store, on_damaged="previous")
    with caplog.at_level(logging.WARNING, logger="agck.langgraph"):
        assert lenient.get_tuple(_cfg("t")).checkpoint["id"] == ids[1]
    assert ids[2] in caplog.text and "returning the previous valid checkpoint" in caplog.text
    with pytest.raises(DamagedCheckpointError):
        lenient.get_tuple(_cfg("t", cid=ids[2]))

    # keep_latest keeps the damaged newest one and the newest valid one
    saver.prune(["t"])
    assert saver.store.steps(runs.records) == [checkpoint_key(i) for i in ids[1:]]
    assert saver.get_tuple(_cfg("t", cid=ids[1])).checkpoint["channel_values"]["n"] == 1


def test_damaged_channel_value_walks_back_past_sharers(tmp_path):
    saver = AgckSaver(str(tmp_path / "s"), incremental=False)      # standalone files: payload at known offsets
    ids = _three(saver)
    # a fourth checkpoint that changes only 'n' shares the third's 'emb'
    cfg = _put(saver, "t", {"emb": None, "n": 3}, {"emb": 3, "n": 4}, {"n": 4}, parent=_cfg("t", cid=ids[2]))
    ids.append(cfg["configurable"]["checkpoint_id"])
    runs = lgmod._Runs.of("t", "")
    path = saver.store.ref(runs.records, checkpoint_key(ids[2]))     # its small values are in its record
    (blob,) = [d for d in agck.inspect(path)["tensors"] if d["path"] == "state['values']['emb']"]
    _flip(path, blob["blob_offset"] + 100)

    with pytest.raises(DamagedCheckpointError) as e:
        saver.get_tuple(_cfg("t"))
    err = e.value
    assert err.checkpoint_id == ids[3] and err.part == "the value of channel 'emb'" and err.ref == path
    assert err.section in ("blob", "tensor", "payload") and "emb" in str(err)
    assert err.previous.checkpoint["id"] == ids[1]                   # ids[2] holds the damaged value too
    with pytest.raises(DamagedCheckpointError) as e:
        saver.get_tuple(_cfg("t", cid=ids[2]))
    assert e.value.previous.checkpoint["id"] == ids[1]
    assert np.all(saver.get_tuple(_cfg("t", cid=ids[1])).checkpoint["channel_values"]["emb"] == 1)


def test_damaged_pending_write(tmp_path):
    saver = AgckSaver(str(tmp_path / "s"), incremental=False)
    ids = _three(saver)
    run = lgmod._Runs.of("t", "").writes(checkpoint_key(ids[2]))
    (step,) = saver.store.steps(run)
    path = saver.store.ref(run, step)
    _flip(path, os.path.getsize(path) // 2)
    with pytest.raises(DamagedCheckpointError, match="a pending write failed verification") as e:
        saver.get_tuple(_cfg("t"))
    assert e.value.ref == path and e.value.previous.checkpoint["id"] == ids[1]
    with pytest.raises(DamagedCheckpointError):
        saver.put_writes(_cfg("t", cid=ids[2]), [("n", 5)], "task2")


def test_nothing_valid_left(tmp_path):
    saver = AgckSaver(str(tmp_path / "s"))
    (cid,) = [c["configurable"]["checkpoint_id"] for c in [_put(saver, "t", {"a": 1}, {"a": 1}, {"a": 1})]]
    path = saver.store.ref(lgmod._Runs.of("t", "").records, checkpoint_key(cid))
    _flip(path, 100)
    with pytest.raises(DamagedCheckpointError, match="start the thread over") as e:
        saver.get_tuple(_cfg("t"))
    assert e.value.previous is None
    saver.prune(["t"])                                                 # deletes nothing it cannot judge
    assert os.path.exists(path)


# --- a real graph: interrupt, SIGKILL, resume in another process --------------------------------------

GRAPH = textwrap.dedent('''
    import json, sys, time
    from typing import Annotated, TypedDict
    import numpy as np
    from langchain_core.messages import AIMessage, HumanMessage
    from langgraph.graph import END, START, StateGraph
    from langgraph.graph.message import add_messages
    from langgraph.types import Command, interrupt
    from agck.integrations.langgraph import AgckSaver

    class State(TypedDict):
        messages: Annotated[list, add_messages]
        emb: np.ndarray
        approved: str
        drafts: int

    def draft(s):
        return {"messages": [AIMessage("draft v1")], "emb": np.arange(10000, dtype=np.float32),
                "drafts": s["drafts"] + 1}

    def review(s):
        answer = interrupt({"question": "approve?", "draft": s["messages"][-1].content})
        return {"approved": answer, "messages": [HumanMessage("answer: " + answer)]}

    def finish(s):
        return {"messages": [AIMessage("done")], "emb": s["emb"] * 2}

    b = StateGraph(State)
    for f in (draft, review, finish):
        b.add_node(f)
    for a, z in ((START, "draft"), ("draft", "review"), ("review", "finish"), ("finish", END)):
        b.add_edge(a, z)
    saver = AgckSaver(sys.argv[2], **json.loads(sys.argv[3]))
    graph = b.compile(checkpointer=saver)
    config = {"configurable": {"thread_id": "review/42 ü"}}
    if sys.argv[1] == "start":
        out = graph.invoke({"messages": [HumanMessage("write it")], "drafts": 0}, config)
        print("INTERRUPTED", json.dumps(out["__interrupt__"][0].value), flush=True)
        time.sleep(300)
    else:
        out = graph.invoke(Command(resume="yes"), config)
        print(json.dumps({"messages": [[type(m).__name__, m.content] for m in out["messages"]],
                          "approved": out["approved"], "drafts": out["drafts"],
                          "emb_ok": bool(np.array_equal(out["emb"], np.arange(10000, dtype=np.float32) * 2))}))
''')


@pytest.mark.parametrize("kind", ["file", "sqlite"])
def test_interrupt_sigkill_resume(kind, request, tmp_path):
    _, url, opts = make_spec(kind, request, tmp_path)
    script = tmp_path / "graph.py"
    script.write_text(GRAPH)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    args = [sys.executable, str(script)]
    first = subprocess.Popen(args + ["start", url, json.dumps(opts)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    watchdog = threading.Timer(120, first.kill)      # a child that hangs must not hang the suite
    watchdog.start()
    try:
        line = first.stdout.readline()
        assert line.startswith("INTERRUPTED"), line + first.stderr.read()
        assert json.loads(line.split(" ", 1)[1]) == {"question": "approve?", "draft": "draft v1"}
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        watchdog.cancel()
    assert first.returncode == -signal.SIGKILL

    done = subprocess.run(args + ["resume", url, json.dumps(opts)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {"messages": [["HumanMessage", "write it"], ["AIMessage", "draft v1"],
                                ["HumanMessage", "answer: yes"], ["AIMessage", "done"]],
                   "approved": "yes", "drafts": 1, "emb_ok": True}
    with AgckSaver(url, **opts) as saver:
        latest = saver.get_tuple({"configurable": {"thread_id": "review/42 ü"}})
        assert latest.metadata["source"] == "loop" and latest.checkpoint["channel_values"]["approved"] == "yes"


def test_async_methods_on_postgres_match_the_sync_ones(request, tmp_path):
    """On Postgres the async methods read and write on the event loop; where that path
    does not apply (a large value, a put repeated, a task's second write, a damaged
    checkpoint) they give what the sync methods give."""
    spec = make_spec("postgres", request, tmp_path)
    saver = AgckSaver(spec[1], **spec[2])
    calls = []
    for name in ("put", "put_writes", "get_tuple"):       # the sync methods, as the fallbacks call them
        sync = getattr(saver, name)
        setattr(saver, name, lambda *a, _n=name, _f=sync, **k: calls.append(_n) or _f(*a, **k))

    async def main():
        cfg = None
        for i in range(3):
            cp = _checkpoint({"emb": np.full(64, float(i), np.float32), "n": i}, {"emb": i + 1, "n": i + 1})
            cfg = await saver.aput(cfg or _cfg("t"), cp, {"source": "loop", "step": i, "parents": {}},
                                   {"emb": i + 1, "n": i + 1})
            await saver.aput_writes(cfg, [("n", i)], f"task{i}")
        assert calls == []                                   # all on the event loop
        t = await saver.aget_tuple(_cfg("t"))
        assert t.checkpoint["channel_values"]["n"] == 2 and t.pending_writes == [("task2", "n", 2)]
        assert calls == []
        s = saver.get_tuple(_cfg("t"))
        assert (t.config, t.metadata, t.parent_config, t.pending_writes) == \
            (s.config, s.metadata, s.parent_config, s.pending_writes)
        assert np.array_equal(t.checkpoint["channel_values"]["emb"], s.checkpoint["channel_values"]["emb"])
        calls.clear()
        # a task's second write is merged as the sync method merges it (a regular write once, an error added)
        await saver.aput_writes(cfg, [("x", 1)], "task2")
        await saver.aput_writes(cfg, [("__error__", "boom")], "task2")
        t = await saver.aget_tuple(_cfg("t"))
        assert t.pending_writes == [("task2", "__error__", "boom"), ("task2", "n", 2)]
        # by id, and an id that is not there
        first = (await saver.aget_tuple(_cfg("t", cid=t.parent_config["configurable"]["checkpoint_id"])))
        assert first.checkpoint["channel_values"]["n"] == 1
        assert await saver.aget_tuple(_cfg("t", cid=str(uuid6(clock_seq=-1)))) is None
        assert await saver.aget_tuple(_cfg("nobody")) is None
        # a large value (a store entry of its own) is put off the loop, and read back whole
        big = np.random.default_rng(0).random(1 << 16)
        cp = _checkpoint({"emb": big, "n": 3}, {"emb": 9, "n": 4})
        cfg = await saver.aput(cfg, cp, {"source": "loop", "step": 3, "parents": {}}, {"emb": 9, "n": 4})
        assert calls.count("put") == 1
        assert np.array_equal((await saver.aget_tuple(_cfg("t"))).checkpoint["channel_values"]["emb"], big)
        # a put repeated replaces nothing and fails nothing
        assert (await saver.aput(_cfg("t"), cp, {"source": "loop", "step": 3, "parents": {}}, {"n": 4})) == cfg
        return cfg

    cfg = asyncio.run(main())
    runs = lgmod._Runs.of("t", "")
    corrupt_payload(spec, saver.store, runs.records, checkpoint_key(cfg["configurable"]["checkpoint_id"]))
    with pytest.raises(DamagedCheckpointError) as e:
        asyncio.run(saver.aget_tuple(_cfg("t")))
    assert e.value.previous.checkpoint["channel_values"]["n"] == 2
    saver.close()


class _Conversation(TypedDict):
    messages: Annotated[list, add_messages]
    n: Annotated[int, operator.add]


@pytest.mark.parametrize("kind", ["postgres", "file"])
def test_many_conversations_at_once_on_one_event_loop(kind, request, tmp_path):
    """24 graphs run with ainvoke at once on one saver: every thread's history is whole
    and in order. On Postgres the saver's puts and gets ran on the event loop (the
    store's async methods, connections awaited, no thread); elsewhere on at most 4
    worker threads."""
    _, url, opts = make_spec(kind, request, tmp_path)
    if kind == "postgres":
        opts["pool"] = 3
    saver = AgckSaver(url, **opts)
    threads_used, put = set(), saver.put

    def counting_put(*a, **k):
        threads_used.add(threading.get_ident())
        return put(*a, **k)

    saver.put = counting_put

    def reply(state):
        return {"messages": [AIMessage(content=f"reply {state['n']} " + "x" * 500, id=f"m{state['n']}")], "n": 1}

    g = StateGraph(_Conversation)
    g.add_node("reply", reply)
    g.add_edge(START, "reply")
    g.add_conditional_edges("reply", lambda s: END if s["n"] >= 6 else "reply")
    graph = g.compile(checkpointer=saver)

    async def main():
        return await asyncio.gather(*(graph.ainvoke({"messages": [HumanMessage(content=f"hi {i}", id="h")], "n": 0},
                                                    _cfg(f"conv-{i}")) for i in range(24)))

    outs = asyncio.run(main())
    try:
        assert all(o["n"] == 6 and len(o["messages"]) == 7 for o in outs)
        if kind == "postgres":
            assert threads_used == set() and saver._workers._pool is None     # no worker thread was started
        else:
            assert 1 < len(threads_used) <= 4
        for i in range(24):
            history = list(saver.list(_cfg(f"conv-{i}")))
            assert [t.checkpoint["channel_values"].get("n", 0) for t in history] == list(range(6, -1, -1)) + [0]
            assert history[0].checkpoint["channel_values"]["messages"][0].content == f"hi {i}"
    finally:
        saver.close()


def test_import_agck_does_not_import_langgraph():
    code = "import sys, agck, agck.integrations; assert 'langgraph' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_readme_langgraph_example_runs(tmp_path, monkeypatch, capsys):
    import re
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    readme = open(os.path.join(root, "README.md")).read()
    [example] = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "AgckSaver(" in b]
    monkeypatch.chdir(tmp_path)
    exec(example, {"__name__": "readme_example"})
    assert capsys.readouterr().out.strip() == "{'draft': 'summary of doc-1', 'approved': True}"


def test_thread_ids_differing_in_case_only_never_share_a_run(tmp_path, monkeypatch):
    """On a case-insensitive file system (macOS, Windows) two run names that differ in
    case only are one directory: no two thread ids (or namespaces) may map to such
    names. A thread an earlier version wrote under a name with capitals is still read,
    written on, listed, copied and deleted."""
    from agck.integrations.langgraph import layout
    saver = AgckSaver(str(tmp_path / "s"))
    threads = ["Chat-42", "chat-42", "CHAT-42"]
    for t in threads:
        _put(saver, t, {"who": t}, {"who": 1}, {"who": 1}, ns="Sub:1")
    runs = saver.store.runs()
    assert len({r.lower() for r in runs}) == len(runs), runs
    for t in threads:
        assert saver.get_tuple(_cfg(t, "Sub:1")).checkpoint["channel_values"] == {"who": t}
    # a thread written by an earlier version (capitals kept in its run names)
    monkeypatch.setattr(layout, "_RAW_NAME", layout._LEGACY_RAW_NAME)
    old = AgckSaver(str(tmp_path / "old"))
    cfg = _put(old, "Legacy-Thread", {"n": 1}, {"n": 1}, {"n": 1}, ns="Node:1")
    assert any("rLegacy-Thread" in r for r in old.store.runs())
    monkeypatch.undo()
    now = AgckSaver(str(tmp_path / "old"))
    assert now.get_tuple(_cfg("Legacy-Thread", "Node:1")).checkpoint["channel_values"] == {"n": 1}
    _put(now, "Legacy-Thread", {"n": 2}, {"n": 2}, {"n": 2}, parent=cfg, ns="Node:1")
    assert not any(r.startswith("lg.h") for r in now.store.runs())            # it went on where it was
    assert [t.checkpoint["channel_values"]["n"] for t in now.list(_cfg("Legacy-Thread", "Node:1"))] == [2, 1]
    assert len(list(now.list({"configurable": {"thread_id": "Legacy-Thread"}}))) == 2
    now.copy_thread("Legacy-Thread", "Copied")
    assert now.get_tuple(_cfg("Copied", "Node:1")).checkpoint["channel_values"] == {"n": 2}
    now.delete_thread("Legacy-Thread")
    assert now.get_tuple(_cfg("Legacy-Thread", "Node:1")) is None
    assert not any("Legacy" in r for r in now.store.runs())
