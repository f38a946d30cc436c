"""Encryption at rest on the file store (agck/cipher.py, FORMAT.md section 18).

A marker planted in a state is in no byte of the store; the same content in two
stores of different keys has different chunk names; every byte of a stored chunk and
of a checkpoint file flipped in turn is caught; a chunk swapped for another of the
same store, and a checkpoint file copied to another step, do not open; keys are added,
rotated and removed without rewriting data; a wrong or missing key is one clear error.
"""

from __future__ import annotations

import json
import os
import random
import shutil

import numpy as np
import pytest
import torch

import agck
from agck import cipher
from agck.cli import main as cli_main
from agck.errors import (CorruptCheckpointError, DamagedChunkError, EncryptionKeyError, UnsupportedVersionError,
                         UsageError)
from agck.recovery import verify_store
from agck.stores import open_store

MARK = b"AGCK-PLANTED-MARKER-5e1d"
KEY = "correct horse battery staple"


def state(i: int = 0) -> dict:
    g = torch.Generator().manual_seed(i)
    return {"w": torch.randn(300_000, generator=g) * 0.02, "note": MARK.decode() * 50 + str(i),
            "raw": np.frombuffer(MARK * 2000, np.uint8).copy(), "turns": [{"text": MARK.decode(), "i": i}] * 20,
            "i": i}


def same(a: dict, b: dict) -> bool:
    return (torch.equal(a["w"], b["w"]) and a["note"] == b["note"] and np.array_equal(a["raw"], b["raw"])
            and a["turns"] == b["turns"] and a["i"] == b["i"])


def files(root) -> list[str]:
    return sorted(os.path.join(r, f) for r, _, fs in os.walk(root) for f in fs)


def chunk_files(root) -> list[str]:
    objects = os.path.join(root, ".objects")
    return [p for p in files(objects) if not os.path.relpath(p, objects).startswith("quarantine")
            and os.path.basename(p) not in ("lock", "generation")]


@pytest.mark.parametrize("compress", ["none", "zstd"])
def test_a_planted_marker_is_in_no_byte_of_the_store_and_everything_reads_back(tmp_path, compress):
    root = str(tmp_path / "s")
    s = open_store(root, key=KEY, compress=compress)
    for i in (1, 2, 3):
        s.put("run", i, state(i), meta={"step": i})
    for p in files(root):
        with open(p, "rb") as f:
            assert MARK not in f.read(), p
    fresh = open_store(root, key=KEY)
    for i in (1, 2, 3):
        assert same(fresh.get("run", i).state, state(i))
    assert [c.step for c in fresh.list("run")] == [1, 2, 3] and fresh.list("run")[0].meta == {"step": 1}
    assert fresh.scrub().ok
    verified = verify_store(fresh)
    assert len(verified.ok) == 3 and not verified.rejected
    assert agck.recover(fresh, "run").step == 3
    fresh.delete("run", 1)
    got = fresh.collect_garbage()
    assert got.listings == 2 and not got.unreadable
    assert same(open_store(root, key=KEY).get("run", 3).state, state(3))


def test_the_same_content_has_other_names_under_another_key_and_one_within_a_store(tmp_path):
    a, b, plain = str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "plain")
    for root, key in ((a, KEY), (b, os.urandom(32)), (plain, None)):
        s = open_store(root, key=key)
        s.put("run", 1, state(1))
    names = {root: {os.path.relpath(p, os.path.join(root, ".objects")) for p in chunk_files(root)}
             for root in (a, b, plain)}
    assert not names[a] & names[b] and not names[a] & names[plain] and not names[b] & names[plain]
    s = open_store(a, key=KEY)
    s.put("run", 2, state(1) | {"i": 2})
    assert s.last_put.new_bytes < 64 << 10          # the weights found stored under their names


def test_every_byte_of_a_chunk_and_of_a_checkpoint_file_flipped_in_turn_is_caught(tmp_path):
    root = str(tmp_path / "s")
    key = os.urandom(32)
    s = open_store(root, key=key)
    s.put("run", 1, {"text": MARK.decode() * 40, "i": 1})       # small: a few chunks of a few hundred bytes
    s.put("run", 2, {"text": MARK.decode() * 40, "i": 2})
    smallest = min(chunk_files(root), key=os.path.getsize)
    good = open(smallest, "rb").read()
    assert len(good) < 4096
    judge = open_store(root, key=key)
    for i in range(len(good)):
        bad = bytearray(good)
        bad[i] ^= 1 << (i % 8)
        with open(smallest, "wb") as f:
            f.write(bad)
        report = judge.scrub(quarantine=False)
        assert report.damaged or report.missing, i
    with open(smallest, "wb") as f:
        f.write(good)
    listing = s.path("run", 2)
    good = open(listing, "rb").read()
    for i in range(len(good)):
        bad = bytearray(good)
        bad[i] ^= 1 << (i % 8)
        with open(listing, "wb") as f:
            f.write(bad)
        # the version and algorithm bytes changed read as a newer format (FORMAT.md 18.5): refused, no verdict
        with pytest.raises(UnsupportedVersionError if i in (4, 5) and bad[i] > good[i] else CorruptCheckpointError):
            judge.get("run", 2)
    assert agck.recover(judge, "run").step == 1      # walked back past it


def test_a_swapped_chunk_and_a_replayed_checkpoint_file_do_not_open(tmp_path):
    root = str(tmp_path / "s")
    s = open_store(root, key=KEY)
    s.put("run", 1, state(1))
    s.put("run", 2, state(2))
    chunks = chunk_files(root)
    victim, other = chunks[0], chunks[1]
    saved = open(victim, "rb").read()
    shutil.copyfile(other, victim)           # a valid ciphertext of this store, at another name
    report = open_store(root, key=KEY).scrub(quarantine=False)
    assert len(report.damaged) == 1 and report.damaged[0].checkpoints
    failed = 0
    for step in (1, 2):
        try:
            open_store(root, key=KEY).get("run", step)
        except DamagedChunkError:
            failed += 1
    assert failed
    with open(victim, "wb") as f:
        f.write(saved)
    assert open_store(root, key=KEY).scrub().ok
    shutil.copyfile(s.path("run", 1), s.path("run", 2))      # step 1's listing replayed as step 2
    with pytest.raises(CorruptCheckpointError):
        open_store(root, key=KEY).get("run", 2)


def test_keys_are_added_rotated_and_removed_without_rewriting_data(tmp_path):
    root = str(tmp_path / "s")
    s = open_store(root, key=KEY)
    s.put("run", 1, state(1))
    before = {p: open(p, "rb").read() for p in files(os.path.join(root, ".objects")) + files(os.path.join(root, "run"))}
    new = os.urandom(32)
    slot = s.add_key(new)
    assert [x["id"] for x in s.key_slots()] == sorted([slot["id"], s.key_slots()[0]["id"]]) or len(s.key_slots()) == 2
    assert same(open_store(root, key=new).get("run", 1).state, state(1))
    old_id = next(x["id"] for x in s.key_slots() if x["id"] != slot["id"])
    s.remove_key(old_id)
    with pytest.raises(EncryptionKeyError, match="opens none"):
        open_store(root, key=KEY)
    s2 = open_store(root, key=new)
    assert same(s2.get("run", 1).state, state(1))
    with pytest.raises(UsageError, match="last"):
        s2.remove_key(slot["id"])
    with pytest.raises(UsageError, match="no key slot"):
        s2.remove_key("00000000")
    after = {p: open(p, "rb").read() for p in before}
    assert after == before                     # no data rewritten
    for p in files(os.path.join(root, ".keys")):
        text = open(p).read()
        assert KEY not in text and new.hex() not in text
        json.loads(text)


def test_the_key_from_the_environment_and_a_key_file(tmp_path, monkeypatch):
    root = str(tmp_path / "s")
    raw = os.urandom(32)
    key_file = tmp_path / "k"
    key_file.write_text(raw.hex() + "\n")
    monkeypatch.setenv("AGCK_KEY_FILE", str(key_file))
    open_store(root).put("run", 1, state(1))
    monkeypatch.delenv("AGCK_KEY_FILE")
    with pytest.raises(EncryptionKeyError, match="no key was given"):
        open_store(root)
    assert same(open_store(root, key=raw).get("run", 1).state, state(1))
    monkeypatch.setenv("AGCK_KEY", "not the key")
    with pytest.raises(EncryptionKeyError, match=r"\$AGCK_KEY"):
        open_store(root)
    monkeypatch.setenv("AGCK_KEY_FILE", str(key_file))
    monkeypatch.delenv("AGCK_KEY")
    assert cli_main(["verify", root]) == 0       # the CLI takes the key the same way
    assert same(open_store(root, key=lambda: raw).get("run", 1).state, state(1))   # a KMS-like callable


def test_what_an_encrypted_store_refuses(tmp_path):
    plain = str(tmp_path / "plain")
    open_store(plain).put("run", 1, {"x": 1})
    with pytest.raises(UsageError, match="unencrypted checkpoints"):
        open_store(plain, key=KEY)
    root = str(tmp_path / "s")
    open_store(root, key=KEY)
    for opts in ({"incremental": False}, {"full_every": 5}):
        with pytest.raises(UsageError, match="every checkpoint as chunks"):
            open_store(root, key=KEY, **opts)
    with pytest.raises(UsageError, match="in the clear"):     # the journal seals its records; raw ones are refused
        open_store(root, key=KEY).log_append("run", [b"raw bytes"])
    for bad in ("", b"short", 12):
        with pytest.raises(UsageError):
            open_store(str(tmp_path / "x"), key=bad)
    assert not os.path.exists(tmp_path / "x" / ".keys")


def test_a_damaged_key_slot_or_every_slot_lost_is_said_plainly(tmp_path):
    root = str(tmp_path / "s")
    open_store(root, key=KEY).put("run", 1, {"x": 1})
    [slot] = files(os.path.join(root, ".keys"))
    text = open(slot).read()
    with open(slot, "w") as f:
        f.write(text.replace('"scrypt"', '"argon9"'))
    with pytest.raises(EncryptionKeyError, match="every key slot of the store is damaged.*unknown key derivation"):
        open_store(root, key=KEY)
    os.unlink(slot)
    # every slot gone: the store knows it is encrypted from what it holds (FORMAT.md 18.9),
    # and is refused with a key or without one; nothing is read, quarantined or written
    before = sorted(files(root))
    for key in (None, KEY):
        with pytest.raises(EncryptionKeyError, match="sealed .* none of its key slots"):
            open_store(root, key=key)
    assert sorted(files(root)) == before


def test_the_key_command_inits_lists_adds_rotates_and_removes(tmp_path, monkeypatch, capsys):
    root = str(tmp_path / "s")
    k1, k2, k3 = tmp_path / "k1", tmp_path / "k2", tmp_path / "k3"
    k1.write_text(os.urandom(32).hex())
    k2.write_text("the second passphrase")
    k3.write_text(os.urandom(32).hex())
    assert cli_main(["key", "init", root, "--new-key-file", str(k1)]) == 0
    monkeypatch.setenv("AGCK_KEY_FILE", str(k1))
    open_store(root).put("run", 1, state(1))
    assert cli_main(["key", "add", root, "--new-key-file", str(k2)]) == 0
    capsys.readouterr()
    assert cli_main(["key", "list", root, "--json"]) == 0
    slots = json.loads(capsys.readouterr().out)
    assert sorted(x["kind"] for x in slots) == ["passphrase", "raw"]
    assert cli_main(["key", "rotate", root, "--new-key-file", str(k3)]) == 0     # k1's slot goes
    with pytest.raises(EncryptionKeyError):
        open_store(root)
    monkeypatch.setenv("AGCK_KEY_FILE", str(k3))
    assert same(open_store(root).get("run", 1).state, state(1))
    passphrase = next(x["id"] for x in slots if x["kind"] == "passphrase")
    assert cli_main(["key", "remove", root, passphrase]) == 0
    assert len(open_store(root).key_slots()) == 1
    assert cli_main(["key", "remove", root, open_store(root).key_slots()[0]["id"]]) != 0   # never the last
    assert cli_main(["key", "init", root, "--new-key-file", str(k1)]) != 0              # not an empty directory


def test_multi_rank_parts_are_sealed_with_the_store_s_data_key(tmp_path):
    root = str(tmp_path / "s")
    s = open_store(root, key=KEY)
    parts = s.parts_store()
    parts.put("run.e1.r0", 1, state(1))
    for p in files(root):
        with open(p, "rb") as f:
            assert MARK not in f.read(), p
    assert same(open_store(root, key=KEY).parts_store().get("run.e1.r0", 1).state, state(1))
    assert not os.path.isdir(os.path.join(root, ".parts", ".keys"))     # one data key, the store's


def test_processes_making_one_encrypted_store_at_once_end_with_one_data_key(tmp_path):
    """Rule 18.6: the first slot has a fixed id and is written only if absent, so the ranks
    of a job opening a new store together agree on its data key."""
    import subprocess
    import sys
    root = str(tmp_path / "s")
    script = ("import sys, agck\n"
              "s = agck.open_store(sys.argv[1], key=sys.argv[2])\n"
              "s.put('r' + sys.argv[3], 1, {'rank': int(sys.argv[3]), 'note': 'x' * 5000})\n")
    procs = [subprocess.Popen([sys.executable, "-c", script, root, KEY, str(r)]) for r in range(4)]
    assert [p.wait(timeout=120) for p in procs] == [0] * 4
    slots = open_store(root, key=KEY).key_slots()
    assert [x["id"] for x in slots] == ["00000000"]
    fresh = open_store(root, key=KEY)
    assert [fresh.get(f"r{r}", 1).state["rank"] for r in range(4)] == [0, 1, 2, 3]


def test_slots_of_two_data_keys_are_refused(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    open_store(a, key=KEY).put("run", 1, {"x": 1})
    slot = open_store(b, key=KEY).add_key(os.urandom(32))     # b made encrypted, under another data key
    other = os.path.join(b, ".keys", f"{slot['id']}.json")
    shutil.copyfile(other, os.path.join(a, ".keys", f"{slot['id']}.json"))     # directories merged
    with pytest.raises(EncryptionKeyError, match="2 different data keys"):
        open_store(a, key=KEY)


def test_the_langgraph_saver_on_an_encrypted_store_leaks_nothing(tmp_path):
    pytest.importorskip("langgraph")
    from typing import Annotated, TypedDict

    from langchain_core.messages import AIMessage, HumanMessage
    from langgraph.graph import END, START, StateGraph
    from langgraph.graph.message import add_messages

    from agck.integrations.langgraph import AgckSaver

    root = str(tmp_path / "s")
    State = TypedDict("State", {"messages": Annotated[list, add_messages], "turn": int})

    def chat(s):
        return {"messages": [HumanMessage(content=MARK.decode() + " asks"), AIMessage(content="an answer " * 40)],
                "turn": s["turn"] + 1}

    b = StateGraph(State)
    b.add_node("chat", chat)
    b.add_edge(START, "chat")
    b.add_conditional_edges("chat", lambda s: "chat" if s["turn"] < 5 else END)
    out = b.compile(checkpointer=AgckSaver(open_store(root, key=KEY))).invoke(
        {"messages": [], "turn": 0}, {"configurable": {"thread_id": "t"}})
    assert out["turn"] == 5
    for p in files(root):
        with open(p, "rb") as f:
            assert MARK not in f.read(), p
    again = b.compile(checkpointer=AgckSaver(open_store(root, key=KEY)))
    assert len(again.get_state({"configurable": {"thread_id": "t"}}).values["messages"]) == 10


def test_a_quarantined_chunk_keeps_its_keyed_name_and_is_kept_until_healed(tmp_path):
    """No file name in an encrypted store is a chunk's address, the quarantine's included;
    a collection keeps a quarantined chunk while a checkpoint lists it unhealed."""
    from agck import chunking
    root = str(tmp_path / "s")
    s = open_store(root, key=KEY)
    st = state(1)
    s.put("run", 1, st)
    victim = max(chunk_files(root), key=os.path.getsize)
    with open(victim, "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 8)
    with pytest.raises(DamagedChunkError) as e:
        open_store(root, key=KEY).get("run", 1)
    [address] = e.value.damaged
    [q] = open_store(root, key=KEY).quarantined()
    assert address.hex() not in q.ref and q.address == os.path.basename(os.path.dirname(victim)) + \
        os.path.basename(victim)
    assert chunking.address(b"x").hex() not in "".join(files(root))
    assert open_store(root, key=KEY).collect_garbage().deleted_chunks == 0       # listed, unhealed: kept
    assert open_store(root, key=KEY).quarantined()
    open_store(root, key=KEY).put("run", 2, st)                                  # heals it
    assert same(open_store(root, key=KEY).get("run", 1).state, st)
    open_store(root, key=KEY).collect_garbage()
    assert open_store(root, key=KEY).quarantined() == []
