"""Keys under misuse, races and kills: valid calls at the wrong moment (FORMAT.md rules 18.9-18.12).

The invariant after every case: every acknowledged checkpoint and journal result reads
back with some key acknowledged as present; nothing is quarantined or deleted that a
healthy read would keep; nothing is written in the clear to an encrypted store; nothing
is written by a read-only call. Each case here was a defect once:

- slots moved away (a backup tool, a renamed table) read as "not encrypted": a scrub
  quarantined every chunk, a Journal re-ran acknowledged steps and wrote in the clear;
- a DataKey passed as ``key=`` wrote past the slots (the real key then walked back);
- two processes each removing the other's slot left none;
- read-only commands (``ls``, ``verify``, ``scrub``, ``journal``, ``create=False``) made a slot;
- one damaged slot locked every key out; a planted slot cost 4 GiB and a minute;
- hostile slots and keys: deep nesting, a callable returning itself, a FIFO, a huge file.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import signal
import sqlite3
import time

import pytest

import agck
from agck import cipher
from agck.cli import main as cli_main
from agck.errors import EncryptionKeyError, UsageError
from agck.stores import open_store

from conftest import FULL, make_spec, open_spec, reopen_spec

KEY = "correct horse battery staple"
OTHER = "a second passphrase, also long"
BACKENDS = ["file", "sqlite", "postgres", "s3"]


@pytest.fixture(params=BACKENDS)
def spec(request, tmp_path):
    return make_spec(request.param, request, tmp_path)


def cli_url(spec) -> str:
    """The URL the CLI opens this store by (Postgres: its prefix and schema in the URL)."""
    kind, url, opts = spec
    if kind == "postgres":
        return url + ("&" if "?" in url else "?") + f"agck_prefix={opts['prefix']}&agck_schema={opts['schema']}"
    return url


# -- what a store holds, byte for byte, and moving its slots away ---------------------------

def fingerprint(spec, store) -> str:
    """A digest of everything the store holds: every file, row or object."""
    kind, url, opts = spec
    h = hashlib.sha256()
    if kind == "file":
        for d, dirs, files in sorted(os.walk(url)):
            dirs.sort()
            for f in sorted(files):
                p = os.path.join(d, f)
                h.update(p.encode() + open(p, "rb").read())
    elif kind == "sqlite":
        c = sqlite3.connect(url[len("sqlite:///"):])
        for line in c.iterdump():
            h.update(line.encode())
        c.close()
    elif kind == "postgres":
        import psycopg2
        c = psycopg2.connect(url)
        cur = c.cursor()
        cur.execute("SELECT tablename FROM pg_tables WHERE schemaname = %s AND tablename LIKE %s ORDER BY 1",
                    (opts["schema"], opts["prefix"] + "%"))
        for (t,) in cur.fetchall():
            cur.execute(f"SELECT md5(coalesce(string_agg(x::text, ',' ORDER BY x::text), '')) "
                        f"FROM {opts['schema']}.{t} x")
            h.update(t.encode() + cur.fetchone()[0].encode())
        c.close()
    else:
        for o in sorted(store.c.list(""), key=lambda o: o.key):
            h.update(o.key.encode() + bytes(store.c.get(o.key)))
    return h.hexdigest()


def move_slots(spec, store, back: bool = False) -> None:
    """Move the store's key slots out of its sight (or ``back``), as a backup tool or a
    renamed table does."""
    kind, url, opts = spec
    if kind == "file":
        a, b = os.path.join(url, ".keys"), os.path.join(os.path.dirname(url), "keys-moved")
        os.rename(*((b, a) if back else (a, b)))
    elif kind == "sqlite":
        c = sqlite3.connect(url[len("sqlite:///"):])
        t = store._slots.table
        c.execute(f"ALTER TABLE {t + '_moved' if back else t} RENAME TO {t if back else t + '_moved'}")
        c.commit()
        c.close()
    elif kind == "postgres":
        import psycopg2
        c = psycopg2.connect(url)
        c.autocommit = True
        t = f"{opts['prefix']}_keys"
        c.cursor().execute(f"ALTER TABLE {opts['schema']}.{t + '_moved' if back else t} "
                           f"RENAME TO {t if back else t + '_moved'}")
        c.close()
    else:
        src, dst = ("moved-keys/", "keys/") if back else ("keys/", "moved-keys/")
        for o in list(store.c.list(src)):
            store.c.put(dst + o.key[len(src):], bytes(store.c.get(o.key)))
            store.c.delete(o.key)


def state(i: int) -> dict:
    import numpy as np
    return {"w": np.arange(300_000, dtype=np.float32) * i, "i": i, "note": "x" * 100}


# -- 1. slots missing: the store knows it is encrypted from what it holds ----------------------

def test_a_store_whose_slots_are_gone_is_refused_and_nothing_is_touched(spec, monkeypatch):
    """FORMAT.md 18.9: a store knows it is encrypted from what it holds."""
    s = open_spec(spec, key=KEY)
    s.put("r", 1, state(1))
    s.put("r", 2, state(2))
    with agck.Journal(s, "j") as j:
        for i in range(5):
            j.step("square", lambda x: x * x, i)
    move_slots(spec, s)
    s.close()
    before = fingerprint(spec, s)
    for key in (None, KEY, OTHER):
        with pytest.raises(EncryptionKeyError, match="sealed .* none of its key slots"):
            reopen_spec(spec, key=key)
    with pytest.raises(EncryptionKeyError):
        agck.Journal(cli_url(spec), "j", **({k: v for k, v in spec[2].items() if k != "init"}
                                            if spec[0] != "postgres" else {}))
    monkeypatch.delenv("AGCK_KEY", raising=False)
    for argv in (["scrub", cli_url(spec)], ["verify", cli_url(spec), "--run", "r"], ["ls", cli_url(spec)],
                 ["recover", cli_url(spec), "--run", "r"]):
        assert cli_main(argv) == 4, argv
    monkeypatch.setenv("AGCK_KEY", KEY)
    assert cli_main(["scrub", cli_url(spec)]) == 4
    assert fingerprint(spec, s) == before          # nothing quarantined, deleted or written
    move_slots(spec, s, back=True)
    s2 = reopen_spec(spec, key=KEY)
    assert s2.get("r").step == 2 and s2.get("r", 1).state["i"] == 1
    assert not s2.scrub().damaged
    ran = []
    with agck.Journal(s2, "j") as j:
        assert [j.step("square", lambda x: ran.append(x) or x * x, i) for i in range(5)] == [0, 1, 4, 9, 16]
    assert ran == []                                # replayed, not re-run
    s2.close()


def test_a_journal_only_store_without_its_slots_is_refused(tmp_path):
    root = str(tmp_path / "j")
    with agck.Journal(root, "run", key=KEY) as j:
        j.step("one", lambda: 1)
    os.rename(os.path.join(root, ".keys"), str(tmp_path / "moved"))
    with pytest.raises(EncryptionKeyError, match="sealed"):
        agck.Journal(root, "run")


# -- 2. a DataKey is not a key ---------------------------------------------------------------------

def test_a_data_key_passed_as_key_is_refused_on_every_store(spec):
    s = open_spec(spec, key=KEY)
    s.put("r", 1, state(1))
    for target in (spec,):
        with pytest.raises(UsageError, match="DataKey"):
            reopen_spec(target, key=cipher.DataKey.new())
        with pytest.raises(UsageError, match="DataKey"):
            reopen_spec(target, key=s.sealer)
    assert reopen_spec(spec, key=KEY).get("r").step == 1
    s.close()


# -- 3. two admins at once never remove the last slot -------------------------------------------

def _remove_other(spec, mine: str, theirs_id: str, barrier, out) -> None:
    try:
        s = reopen_spec(spec, key=mine)
        barrier.wait(30)
        s.remove_key(theirs_id)
        out.put("removed")
    except agck.AgckError as e:
        out.put(type(e).__name__)


@pytest.mark.parametrize("trials", [4 if not FULL else 12])
def test_two_processes_each_removing_the_others_slot_leave_one(spec, trials):
    """FORMAT.md 18.12: the last-slot check and the removal are one step on every backend."""
    ctx = mp.get_context("spawn")
    for trial in range(trials):
        kind, url, opts = spec
        t_spec = make_spec_again(spec, trial)
        s = open_spec(t_spec, key=KEY)
        s.put("r", 1, state(1))
        a_id = s.sealer.slot_id
        b_id = s.add_key(OTHER)["id"]
        barrier, out = ctx.Barrier(2), ctx.Queue()
        ps = [ctx.Process(target=_remove_other, args=(t_spec, KEY, b_id, barrier, out)),
              ctx.Process(target=_remove_other, args=(t_spec, OTHER, a_id, barrier, out))]
        for p in ps:
            p.start()
        for p in ps:
            p.join(60)
        results = sorted(out.get(timeout=5) for _ in ps)
        assert results.count("removed") == 1, results      # the other was refused: the last slot
        opened = []
        for k in (KEY, OTHER):
            try:
                opened.append(reopen_spec(t_spec, key=k).get("r").step)
            except EncryptionKeyError:
                pass
        assert opened == [1], (trial, results)
        s.close()


def make_spec_again(spec, trial: int):
    """A fresh store of ``spec``'s kind beside it (one per trial)."""
    kind, url, opts = spec
    if kind == "file":
        return kind, f"{url}-{trial}", opts
    if kind == "sqlite":
        return kind, url.replace("store.db", f"store-{trial}.db"), opts
    if kind == "postgres":
        return kind, url, dict(opts, prefix=f"{opts['prefix']}_{trial}")
    path, _, query = url.partition("?")
    return kind, f"{path}-{trial}?{query}", opts


def _rotate_forever(spec, log_path: str) -> None:
    """Rotate keys k0 -> k1 -> ...: add the next, log it, remove the previous, log it."""
    s = reopen_spec(spec, key="key number 0 of the rotation")
    i = 0
    with open(log_path, "a") as log:
        while True:
            nxt = f"key number {i + 1} of the rotation"
            s.add_key(nxt)
            log.write(f"add {i + 1}\n")
            log.flush()
            os.fsync(log.fileno())
            old = s.sealer.slot_id
            s2 = reopen_spec(spec, key=nxt)
            s.remove_key(old)
            log.write(f"rm {i}\n")
            log.flush()
            os.fsync(log.fileno())
            s.close()
            s, i = s2, i + 1


@pytest.mark.parametrize("backend", ["file", "sqlite", "postgres"])
def test_key_rotation_killed_at_random_instants_keeps_every_acknowledged_key(backend, request, tmp_path):
    """SIGKILL a process rotating keys at random instants: every key acknowledged added and
    not acknowledged removed still opens the store (the one whose removal was in flight may
    or may not), and the checkpoint reads back."""
    import random
    rng = random.Random(52)
    ctx = mp.get_context("spawn")
    base = make_spec(backend, request, tmp_path)
    for trial in range(3 if not FULL else 20):
        spec = make_spec_again(base, trial)
        s = open_spec(spec, key="key number 0 of the rotation")
        s.put("r", 1, state(1))
        s.close()
        log_path = str(tmp_path / f"acks-{trial}")
        open(log_path, "w").write("add 0\n")
        p = ctx.Process(target=_rotate_forever, args=(spec, log_path))
        p.start()
        time.sleep(1.5 + rng.random() * 2.0)
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        added, removed = set(), set()
        for line in open(log_path):
            what, i = line.split()
            (added if what == "add" else removed).add(int(i))
        present = sorted(added - removed)
        must = present[1:] if len(present) > 1 else present    # the oldest one's removal may have been under way
        assert must, (added, removed)
        for i in must:
            got = reopen_spec(spec, key=f"key number {i} of the rotation")
            assert got.get("r").state["i"] == 1
            got.close()


# -- 4. nothing read-only writes -------------------------------------------------------------------

def test_read_only_commands_and_opens_write_no_key_slot(tmp_path, monkeypatch):
    """FORMAT.md 18.11: an empty store opened with a key becomes encrypted at its first write."""
    root = tmp_path / "empty"
    root.mkdir()
    monkeypatch.setenv("AGCK_KEY", "x" * 12)
    for argv in (["ls", str(root)], ["verify", str(root)], ["scrub", str(root)], ["journal", str(root), "run"]):
        cli_main(argv)
        assert os.listdir(root) == [], argv
    s = open_store(str(root), create=False, key=KEY)
    assert os.listdir(root) == [] and s.key_slots() == []
    s.put("r", 1, {"x": 1})                 # the first write makes it encrypted
    assert [x["id"] for x in s.key_slots()] == ["00000000"]
    assert open_store(str(root), key=KEY).get("r").state == {"x": 1}
    with pytest.raises(EncryptionKeyError):
        open_store(str(root))


def test_read_only_opens_of_empty_sql_stores_write_no_slot(spec):
    if spec[0] == "file":
        pytest.skip("the file store's case is above")
    s = open_spec(spec)                       # made, unencrypted and empty
    before = fingerprint(spec, s)
    r = reopen_spec(spec, key=KEY)
    r.runs()
    r.list()
    assert fingerprint(spec, s) == before and r.key_slots() == []
    r.put("r", 1, {"x": 1})
    assert len(r.key_slots()) == 1
    assert reopen_spec(spec, key=KEY).get("r").state == {"x": 1}


def _first_write(spec, key, barrier, out) -> None:
    try:
        s = reopen_spec(spec, key=key)
        barrier.wait(30)
        s.put("r", os.getpid(), {"pid": os.getpid()})
        out.put(("ok", s.sealer.key_id))
    except agck.AgckError as e:
        out.put((type(e).__name__, None))


def test_two_processes_making_one_store_encrypted_end_with_one_data_key(tmp_path):
    ctx = mp.get_context("spawn")
    for keys in ((KEY, KEY), (KEY, OTHER)):
        spec = ("file", str(tmp_path / f"s-{len(set(keys))}"), {})
        os.makedirs(spec[1])
        barrier, out = ctx.Barrier(2), ctx.Queue()
        ps = [ctx.Process(target=_first_write, args=(spec, k, barrier, out)) for k in keys]
        for p in ps:
            p.start()
        for p in ps:
            p.join(60)
        got = [out.get(timeout=5) for _ in ps]
        oks = [g for g in got if g[0] == "ok"]
        assert len({k for _, k in oks}) == 1, got          # one data key
        if keys[0] == keys[1]:
            assert len(oks) == 2
        else:
            assert len(oks) == 1 and ("EncryptionKeyError", None) in got
        try:
            s = open_store(spec[1], key=KEY)
        except EncryptionKeyError:
            s = open_store(spec[1], key=OTHER)
        steps = s.steps("r")
        assert len(steps) == len(oks)
        for st in steps:
            assert s.get("r", st).state == {"pid": st}


# -- 5 and 6. damaged and hostile slots ------------------------------------------------------------

def test_one_damaged_slot_does_not_lock_out_the_others(tmp_path, capsys):
    """FORMAT.md 18.10: a damaged slot is set aside and named; the other keys still open."""
    root = str(tmp_path / "s")
    s = open_store(root, key=KEY)
    s.put("r", 1, {"x": 1})
    s.add_key(OTHER)
    with open(os.path.join(root, ".keys", "00000000.json"), "w") as f:
        f.write("garbage{")
    assert open_store(root, key=OTHER).get("r").state == {"x": 1}
    with pytest.raises(EncryptionKeyError, match="damaged, not tried: 00000000"):
        open_store(root, key=KEY)
    os.environ["AGCK_KEY"] = OTHER
    try:
        capsys.readouterr()
        assert cli_main(["key", "list", root]) == 0
        out = capsys.readouterr().out
        assert "00000000  damaged" in out
    finally:
        del os.environ["AGCK_KEY"]


@pytest.mark.parametrize("n, r, p", [(1 << 20, 32, 1), (1 << 18, 8, 16), (1 << 22, 1, 1)])
def test_a_planted_slot_of_hostile_cost_is_refused_before_deriving(tmp_path, n, r, p):
    """FORMAT.md 18.10: a slot whose scrypt would cost over the bounds is damaged, never derived."""
    import resource
    root = str(tmp_path / "s")
    s = open_store(root, key=KEY)
    s.put("r", 1, {"x": 1})
    slot = json.load(open(os.path.join(root, ".keys", "00000000.json")))
    slot.update(id="0", kdf=dict(slot["kdf"], n=n, r=r, p=p))
    # planted first in the listing order, so it would be derived first
    with open(os.path.join(root, ".keys", "0.json"), "w") as f:
        json.dump(slot, f)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.monotonic()
    assert open_store(root, key=KEY).get("r").state == {"x": 1}
    assert time.monotonic() - t < 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 200 << 10    # KiB: no 256 MiB+ derivation
    assert [d.id for d in open_store(root, key=KEY).damaged_key_slots()] == ["0"]


def test_hostile_slots_and_keys_are_one_clear_error(tmp_path, monkeypatch, capsys):
    root = str(tmp_path / "s")
    s = open_store(root, key=KEY)
    s.put("r", 1, {"x": 1})
    # a slot of 100k nested brackets: damaged, never a RecursionError
    with open(os.path.join(root, ".keys", "0000dead.json"), "w") as f:
        f.write("[" * 100_000)
    assert open_store(root, key=KEY).get("r").state == {"x": 1}
    monkeypatch.setenv("AGCK_KEY", KEY)
    capsys.readouterr()
    assert cli_main(["ls", root]) == 0
    os.unlink(os.path.join(root, ".keys", "0000dead.json"))
    # a slot whose id holds control characters: damaged, never printed raw
    with open(os.path.join(root, ".keys", "0000beef.json"), "w") as f:
        json.dump(dict(json.load(open(os.path.join(root, ".keys", "00000000.json"))), id="\x1b]0;x\x07"), f)
    capsys.readouterr()
    assert cli_main(["key", "list", root]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    os.unlink(os.path.join(root, ".keys", "0000beef.json"))
    monkeypatch.delenv("AGCK_KEY")

    def itself():
        return itself
    with pytest.raises(UsageError, match="another callable"):
        open_store(root, key=itself)

    def leaks():
        raise RuntimeError("token=SECRET-VALUE-123")
    with pytest.raises(EncryptionKeyError) as e:
        open_store(root, key=leaks)
    assert "SECRET-VALUE-123" not in str(e.value)
    with pytest.raises(UsageError, match="seal_meta"):
        open_store(f"sqlite:///{tmp_path}/plain.db", seal_meta=True)
    big = tmp_path / "big-key"
    big.write_bytes(b"k" * (64 << 10 + 1))
    with pytest.raises(EncryptionKeyError, match="bytes"):
        cipher.key_from_file(big)
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    t = time.monotonic()
    with pytest.raises(EncryptionKeyError, match="not a regular file"):
        cipher.key_from_file(fifo)
    assert time.monotonic() - t < 2


def test_the_key_command_refuses_what_would_rotate_nothing(tmp_path, monkeypatch, capsys):
    root = str(tmp_path / "s")
    k1, k2 = tmp_path / "k1", tmp_path / "k2"
    k1.write_text("the first passphrase here")
    k2.write_text("the second passphrase here")
    assert cli_main(["key", "init", root, "--new-key-file", str(k1)]) == 0
    monkeypatch.setenv("AGCK_KEY_FILE", str(k1))
    assert cli_main(["key", "add", root, "--new-key-file", str(k1)]) == 2     # the key it has already
    assert cli_main(["key", "add", root, "abcd", "--new-key-file", str(k2)]) == 2     # an extra argument
    assert len(open_store(root).key_slots()) == 1
    assert cli_main(["key", "rotate", root, "--new-key-file", str(k2)]) == 0
    monkeypatch.setenv("AGCK_KEY_FILE", str(k1))
    assert cli_main(["ls", root]) == 4          # the old key opens it no more: bad credentials exit 4
    monkeypatch.setenv("AGCK_KEY_FILE", str(k2))
    assert cli_main(["ls", root]) == 0


def test_a_huge_sparse_file_in_place_of_a_chunk_is_not_read_whole(tmp_path):
    """A 2 GiB sparse file where a 1 MiB chunk belongs: get, verify and scrub judge it by
    its length, reading at most a chunk's bound (64 MiB) of it, never 2 GiB."""
    import resource
    import numpy as np
    root = str(tmp_path / "s")
    s = open_store(root)
    s.put("r", 1, {"w": np.random.default_rng(1).random(1 << 21, dtype=np.float32)})     # 8 MiB: 1 MiB chunks
    objects = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(root, ".objects")) for f in fs
               if len(f) > 40 and os.path.getsize(os.path.join(d, f)) >= 1 << 19]
    victim = objects[0]
    with open(victim, "r+b") as f:
        f.truncate(2 << 30)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.monotonic()
    report = open_store(root).scrub(quarantine=False)
    assert report.damaged
    assert cli_main(["verify", root, "--run", "r"]) != 0
    with pytest.raises(agck.AgckError):
        open_store(root).get("r", 1)
    assert time.monotonic() - t < 10
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 600 << 10    # KiB: far below 2 GiB


def test_a_journal_on_an_empty_store_seals_under_the_key_another_process_made_first(tmp_path):
    """FORMAT.md 18.11: the first slot is written before anything is sealed, whoever seals:
    a journal seals its records before it appends them, and another store object made the
    store encrypted first; the journal's records are sealed under that store's data key."""
    root = str(tmp_path / "s")
    a = open_store(root, key=KEY)                      # empty: its data key pending
    j = agck.Journal(a, "run")
    b = open_store(root, key=KEY)
    b.put("r", 1, {"x": 1})                            # b made the store encrypted first
    assert j.step("square", lambda x: x * x, 7) == 49
    j.close()
    ran = []
    with agck.Journal(open_store(root, key=KEY), "run") as again:
        assert again.step("square", lambda x: ran.append(x) or x * x, 7) == 49
    assert ran == [] and not again.damaged             # replayed: it opened under the store's key
