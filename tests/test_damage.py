"""Damaged chunks: detected, quarantined, written afresh by the next put, on every store.

A chunk is written once and relied on by every later checkpoint holding its bytes.
These tests damage stored chunks of a frozen base (as bit rot or a stray write
would), keep checkpointing, and hold the store to its promise: from the detection
of the damage on (by a read, by verify, by scrub, or by the put itself with
``verify_reused``), every acknowledged checkpoint reads back, and the next put
holding the damaged content heals the earlier checkpoints that list it.
"""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from agck import errors
from agck.recovery import verify_store
from agck.stores import open_store
from agck.stores.damage import SAMPLE_SHARE
from crashtests import chunkrot

FROZEN = np.random.default_rng(7).standard_normal(1 << 18).astype(np.float32)   # 1 MiB: chunks of ~64 KiB


def state(i: int) -> dict:
    return {"frozen": FROZEN, "small": np.full(512, i, np.float32), "step": i}


def _open(spec, **options):
    _, url, opts = spec
    return open_store(url, **{**opts, **options})


def put_two(store, run: str = "r") -> list[bytes]:
    """Steps 1 and 2 of ``run``; returns the chunks of 16 KiB or more both list, largest
    first: the frozen base's (what every later checkpoint will reuse)."""
    store.put(run, 1, state(1))
    first = store.last_put
    store.put(run, 2, state(2))
    second = store.last_put
    sizes = dict(zip(second.addresses, second.sizes))
    return sorted(chunkrot.shared_chunks(store, first, second, 16 << 10), key=lambda a: (-sizes[a], a))


def damage(store, address: bytes, kind: str = "flip") -> None:
    chunkrot.damage(store, address, kind, random.Random(address))


def readable(store, run: str, step: int) -> bool:
    try:
        ck = store.read(run, step)
    except errors.CorruptCheckpointError:
        return False
    np.testing.assert_array_equal(ck.state["frozen"], FROZEN)
    assert ck.state["step"] == step
    return True


# --- the scenario of the report: a frozen base damaged, checkpointing goes on ---------------------

@pytest.mark.parametrize("detect", ["read", "verify", "scrub", "put"])
def test_after_detection_every_checkpoint_of_a_frozen_base_reads_back(store_spec, detect):
    store = _open(store_spec, verify_reused="full" if detect == "put" else "none")
    try:
        victim = put_two(store)[0]
        damage(store, victim)
        if detect == "read":
            with pytest.raises(errors.DamagedChunkError) as e:
                store.read("r", 2)
            assert victim in e.value.damaged and "quarantined" in e.value.reason
        elif detect == "verify":
            rep = verify_store(store, "r")
            assert [r.step for r in rep.rejected] == [1, 2]
        elif detect == "scrub":
            rep = store.scrub()
            assert [d.address for d in rep.damaged] == [victim.hex()]
            assert rep.damaged[0].quarantined == "quarantined"
            assert sorted(rep.damaged[0].checkpoints) == sorted([store.ref("r", 1), store.ref("r", 2)])
        if detect != "put":
            assert [q.address for q in store.quarantined()] == [victim.hex()]
        for s in range(3, 7):
            store.put("r", s, state(s))
            assert readable(store, "r", s), f"step {s}, acknowledged after the damage was detected"
        # the first put after detection wrote the content afresh: the old checkpoints are healed too
        assert all(readable(store, "r", s) for s in (1, 2))
        assert store.scrub().ok
        if detect == "put":
            assert [q.address for q in store.quarantined()] == [victim.hex()]
    finally:
        store.close()


def test_without_detection_the_damage_reaches_later_checkpoints(store_spec):
    """What the checks are for: a put that checks nothing relies on the damaged chunk."""
    store = _open(store_spec, verify_reused="none")
    try:
        damage(store, put_two(store)[0])
        store.put("r", 3, state(3))
        assert not readable(store, "r", 3)
        store.put("r", 4, state(4))     # the read of step 3 detected the damage: step 4 wrote it afresh
        assert readable(store, "r", 4)
    finally:
        store.close()


def test_verify_reused_size_finds_a_truncated_chunk_but_not_a_flipped_byte(store_spec):
    store = _open(store_spec, verify_reused="size")
    try:
        first, second = put_two(store)[:2]
        damage(store, first, "truncate")
        damage(store, second, "flip")
        store.put("r", 3, state(3))
        assert [q.address for q in store.quarantined()] == [first.hex()]
        rep = store.scrub(quarantine=False)
        assert [d.address for d in rep.damaged] == [second.hex()]
        assert store.ref("r", 3) in rep.damaged[0].checkpoints
    finally:
        store.close()


def test_verify_reused_sample_reads_every_reused_chunk_within_its_share_of_puts(store_spec):
    store = _open(store_spec, verify_reused="sample")
    try:
        chunks = put_two(store)
        for a in chunks:
            damage(store, a)
        for s in range(3, 3 + SAMPLE_SHARE):
            store.put("r", s, state(s))
        assert {q.address for q in store.quarantined()} == {a.hex() for a in chunks}
        assert readable(store, "r", 2 + SAMPLE_SHARE)
        assert store.scrub().ok           # every damaged chunk was written afresh: all healed
        assert all(readable(store, "r", s) for s in store.steps("r"))
    finally:
        store.close()


def test_quarantine_rereads_and_leaves_an_intact_chunk(store_spec):
    """A misread (a flipped bit in memory, a transient fault) must not take a good chunk
    out of use: quarantine judges the stored bytes again."""
    store = _open(store_spec)
    try:
        good = put_two(store)[0]
        assert store.quarantine([good, b"\x00" * 32]) == {good: "intact", b"\x00" * 32: "missing"}
        assert store.quarantined() == []
        assert readable(store, "r", 2)
    finally:
        store.close()


def test_a_quarantined_chunk_is_kept_until_healed_then_collected(store_spec):
    store = _open(store_spec)
    try:
        victim = put_two(store)[0]
        damage(store, victim)
        assert store.quarantine([victim]) == {victim: "quarantined"}
        q = store.quarantined()
        assert len(q) == 1 and q[0].reason == "does not match its address" and q[0].detected_at > 0
        store.collect_garbage()
        assert len(store.quarantined()) == 1        # the checkpoints listing it are still broken: evidence kept
        rep = store.scrub()
        assert [d.quarantined for d in rep.missing] == ["quarantined earlier"]
        store.put("r", 3, state(3))                 # heals
        store.collect_garbage()
        assert store.quarantined() == []
        assert all(readable(store, "r", s) for s in (1, 2, 3))
    finally:
        store.close()


def test_scrub_covers_the_parts_of_multi_rank_checkpoints(store_spec):
    """The DCP backend and multi-rank snapshots keep their parts' chunks in a namespace of
    their own; scrub and the parts' own reads quarantine there, and the next part put
    with the same content (another run, as a later dcp.save) heals it."""
    store = _open(store_spec)
    try:
        parts = store.parts_store()
        victim = put_two(parts, "p1")[0]
        damage(parts, victim)
        rep = store.scrub()
        assert [d.address for d in rep.damaged] == [victim.hex()]
        assert rep.damaged[0].quarantined == "quarantined"
        parts.put("p2", 1, state(1))
        assert readable(parts, "p2", 1) and readable(parts, "p1", 2)
        assert store.scrub().ok
    finally:
        store.close()


def test_cli_scrub(store_spec, capsys):
    from agck.cli import main
    _, url, opts = store_spec
    store = _open(store_spec)
    try:
        victim = put_two(store)[0]
        cli_url = url if "prefix" not in opts else f"{url}?agck_prefix={opts['prefix']}&agck_schema={opts['schema']}"
        assert main(["scrub", cli_url, "-q"]) == 0
        assert "no damage" in capsys.readouterr().out
        damage(store, victim)
        assert main(["scrub", cli_url, "-q", "--no-quarantine"]) == 1
        out = capsys.readouterr().out
        assert f"DAMAGED chunk {victim.hex()[:16]}" in out and "breaks 2 checkpoints" in out
        assert "left in place" in out and store.quarantined() == []
        assert main(["scrub", cli_url, "-q"]) == 1
        assert "quarantined now" in capsys.readouterr().out
        assert main(["scrub", cli_url, "-q"]) == 1
        assert "quarantined earlier as damaged" in capsys.readouterr().out
    finally:
        store.close()


def test_verify_reused_is_checked(tmp_path):
    with pytest.raises(errors.UsageError, match="verify_reused"):
        open_store(str(tmp_path / "s"), verify_reused="always")
    assert open_store(str(tmp_path / "s")).verify_reused == "sample"


# --- concurrent writers, a collector, and damage detected while they run -----------------------

def _writer(spec, worker: int, rounds: int, log: list, failures: list, stop: threading.Event,
            events: list) -> None:
    """``rounds`` puts, and more (up to ten times as many) until the damage has been
    injected and detected a few times while they ran: on a loaded machine a scrub of
    an object store can take longer than the puts."""
    store = _open(spec, **({"init": False} if spec[0] == "postgres" else {}), verify_reused="none")
    run = f"w{worker}"
    try:
        for i in range(1, 10 * rounds + 1):
            if stop.is_set() or (i > rounds and len(events) >= 4):
                break
            began = time.monotonic()
            store.put(run, i, state(i))
            ok = readable(store, run, i)
            log.append((run, i, began, time.monotonic(), ok))
            if i > 2:
                store.delete(run, i - 2)        # garbage for the collector
    except BaseException as e:  # noqa: BLE001 - reported by the test
        failures.append(e)
    finally:
        store.close()


def test_damage_detected_beside_writers_and_a_collector(store_spec):
    """Two writers reusing a frozen base (checking nothing themselves), a collector, and
    a third party that damages a stored chunk of the base and then scrubs, over and
    over. A checkpoint that does not read back right after its put is allowed only if
    some damage made before that read had not been detected when its put began."""
    kind = store_spec[0]
    first = _open(store_spec)
    base = put_two(first, "seed")
    log: list = []
    failures: list = []
    events: list = []        # (injected at, detected by when)
    stop = threading.Event()
    rounds = 60 if kind != "sqlite" else 40
    # between a detection and the next damage: long enough to hold whole puts and reads
    # (a put to an object store, or through a catalog over one, takes several round trips)
    gap = 0.5 if "s3" in kind else 0.1
    writers = [threading.Thread(target=_writer, args=(store_spec, w, rounds, log, failures, stop, events))
               for w in range(2)]

    def rot_and_scrub():
        s = _open(store_spec, **({"init": False} if kind == "postgres" else {}))
        rng = random.Random(5)
        try:
            while not stop.is_set():
                a = rng.choice(base)
                injected = time.monotonic()
                try:
                    chunkrot.damage(s, a, "flip", rng)
                except (LookupError, FileNotFoundError):
                    pass      # quarantined and not yet written again: nothing to damage
                s.scrub()
                events.append((injected, time.monotonic()))
                stop.wait(gap)
        except BaseException as e:  # noqa: BLE001
            failures.append(e)
        finally:
            s.close()

    def collect():
        g = _open(store_spec, **({"init": False} if kind == "postgres" else {}))
        try:
            while not stop.is_set():
                g.collect_garbage()
                stop.wait(0.01)
        except BaseException as e:  # noqa: BLE001
            failures.append(e)
        finally:
            g.close()

    helpers = [threading.Thread(target=rot_and_scrub), threading.Thread(target=collect)]
    for t in writers + helpers:
        t.start()
    for t in writers:
        t.join(300)
    stop.set()
    for t in helpers:
        t.join(60)
    assert not failures, failures
    assert len(events) >= 3, "the damage was never injected while the writers ran"
    lost, held = [], 0
    for run, step, began, read_at, ok in log:
        undetected = any(inj < read_at and det > began for inj, det in events)
        held += not undetected        # a put the claim constrains: it must read back
        if not ok and not undetected:
            lost.append((run, step))
    assert not lost, f"acknowledged after every earlier damage was detected, yet unreadable: {lost}"
    assert held >= 5, f"only {held} puts began after a detection with no damage pending: the race was not exercised"
    # once the damage stops: one last scrub, one more put each, and everything kept reads back
    first.scrub()
    for w in range(2):
        first.put(f"w{w}", rounds + 1, state(rounds + 1))
    for w in range(2):
        for s in first.steps(f"w{w}"):
            assert readable(first, f"w{w}", s), (w, s)
    first.close()


def test_readme_scrub_example_runs(tmp_path):
    from readme_examples import run_as_script
    last = run_as_script('verify_reused="sample"', tmp_path, times=2)
    assert all(line.endswith("broken: []") and line.split()[0] != "0" for line in last), last


@pytest.mark.filterwarnings("ignore::UserWarning")     # DCP warns on every no_dist call
def test_dcp_saves_after_a_detected_damage_read_back(store_spec):
    """The report's DCP case: saves of other runs with the same content, after a damaged
    chunk was detected, must load."""
    torch = pytest.importorskip("torch")
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.api import CheckpointException
    from agck.dcp import StorageReader, StorageWriter
    store = _open(store_spec, verify_reused="none")
    frozen = torch.from_numpy(FROZEN.copy())

    def save(run, step):
        dcp.save({"frozen": frozen, "step": torch.tensor(step)}, storage_writer=StorageWriter(store, run),
                 checkpoint_id=step, no_dist=True)
        return store.parts_store().last_put

    def loads(run, step) -> bool:
        target = {"frozen": torch.zeros_like(frozen), "step": torch.tensor(0)}
        try:
            dcp.load(target, storage_reader=StorageReader(store, run, step=step), no_dist=True)
        except CheckpointException:      # (a BaseException) what the rank raised: the part does not verify
            return False
        return torch.equal(target["frozen"], frozen) and int(target["step"]) == step

    try:
        first, second = save("a", 1), save("b", 1)
        victim = chunkrot.shared_chunks(store, first, second, 16 << 10)[0]
        damage(store.parts_store(), victim)
        assert not loads("b", 1)           # the read detects and quarantines it
        assert [q.address for q in store.parts_store().quarantined()] == [victim.hex()]
        save("c", 1)
        assert loads("c", 1) and loads("a", 1) and loads("b", 1)    # written afresh: all healed
    finally:
        store.close()


def test_scrub_reports_a_directory_where_a_chunk_file_should_be(tmp_path, capsys):
    """A chunk path that is a directory stopped the scrub with an error: it is a missing chunk."""
    import os
    from agck.cli import main
    url = str(tmp_path / "s")
    with open_store(url) as s:
        s.put("r", 1, {"w": np.arange(1 << 19, dtype=np.float32)})
        chunk = next(path for path, _ in s.objects.entries())
    os.remove(chunk)
    os.mkdir(chunk)
    capsys.readouterr()
    assert main(["scrub", url]) == 1
    out = capsys.readouterr().out
    assert "MISSING" in out and "1 missing" in out, out
