"""Fault kind ``chunkrot``: stored chunks damaged between the checkpoints of a running workload.

Content addressing writes a chunk once and lets every later checkpoint holding the
same bytes list it. A trial checkpoints the pipeline's snapshot trees (its encoder
is frozen: its chunks are reused from step to step) and, between checkpoints,
damages a stored chunk that the last two checkpoints share, behind the store's
back: a flipped byte, a truncation, a zeroed range or the chunk deleted (bit rot,
a bad sector, a stray write, a lost file). Then the trial's detector runs: a read
of the newest checkpoint, ``store.scrub()``, ``agck.recovery.verify_store``, or none
but the puts' own ``verify_reused`` (``full``: the next put checks every chunk it
reuses; ``sample``: a share of them, so its detection is not counted on).

Judged from what the harness knows, as the rest of the campaign is:

* right after each acknowledged put, the checkpoint is checked without touching the
  store (``scrub(quarantine=False)``): if it lists a damaged chunk although every
  damage made so far had been detected before the put began, it is **lost** (the
  put relied on a chunk known to be damaged);
* at the end, after one last scrub and one more put of the newest step, every
  acknowledged checkpoint must read back bit-identical to the reference, except one
  listing a damaged chunk whose content no later put held (nothing could heal it:
  the fault destroyed its only copy; reported as damaged, not lost); and recovery
  must find the newest step, bit-identical.

Each trial has a store of its own; with the large profile one of
:mod:`crashtests.trialstores`, dropped once judged. A trial not started before the
campaign's time limit is skipped (not judged).
"""

from __future__ import annotations

import random
import sqlite3
import time

from agck.stores.s3.chunks import chunk_key

KINDS = ("flip", "truncate", "zero", "delete")
DETECTORS = ("read", "scrub", "verify", "put-full", "put-sample")


def damage(store, address: bytes, kind: str = "flip", rng: random.Random | None = None) -> str:
    """Damage one stored chunk of ``store`` behind its back; returns a label. Raises
    LookupError when the store holds no such chunk (quarantined, not yet written again)."""
    rng = rng or random.Random(0)
    data = _stored(store, address)
    if data is None:
        raise LookupError(address.hex())
    data = bytearray(data)
    n = len(data)
    if kind == "flip":
        i = rng.randrange(n)
        data[i] ^= 1 << rng.randrange(8)
        label = f"flip@{i}"
    elif kind == "truncate":
        cut = rng.randrange(n)
        del data[cut:]
        label = f"truncate@{cut}"
    elif kind == "zero":
        i = rng.randrange(n)
        k = min(4096, n - i)
        if any(data[i:i + k]):
            data[i:i + k] = bytes(k)
        else:
            data[i] = 1       # zeros already: zeroing would change nothing
        label = f"zero@{i}+{k}"
    elif kind == "delete":
        data = None
        label = "delete"
    else:
        raise ValueError(kind)
    _store_raw(store, address, None if data is None else bytes(data))
    return label


def _row_key(store, address: bytes) -> bytes:
    """What the chunk's row is keyed by: its address, or in an encrypted store its keyed
    name (FORMAT.md 18.3); the damage goes to the bytes as stored (sealed, there)."""
    sealer = getattr(store, "sealer", None)
    return address if sealer is None else sealer.name(address)


def _stored(store, address: bytes):
    kind = type(store).__name__
    if kind == "FileStore":
        try:
            with open(store.objects.path(address), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
    address = _row_key(store, address)
    if kind == "SqliteStore":
        c = sqlite3.connect(store.path, timeout=30)
        try:
            row = c.execute(f"SELECT data FROM {store._t_objects} WHERE address = ?", (address,)).fetchone()
        finally:
            c.close()
        return None if row is None else bytes(row[0])
    if kind == "S3Store":
        data = store.c.get(chunk_key(address))
        return None if data is None else bytes(data)
    rows = store._query(f"SELECT data FROM {store.names.objects} WHERE address = %s", (address,))
    if rows and rows[0][0] is None:     # a catalog whose chunks are in an object store
        data = store._objects.c.get(chunk_key(address))
        return None if data is None else bytes(data)
    return bytes(rows[0][0]) if rows else None


def _store_raw(store, address: bytes, data: bytes | None) -> None:
    kind = type(store).__name__
    if kind == "FileStore":
        path = store.objects.path(address)
        if data is None:
            import os
            os.unlink(path)
            return
        with open(path, "r+b") as f:     # in place, as bit rot would: same inode, same name
            f.write(data)
            f.truncate(len(data))
        return
    address = _row_key(store, address)
    if kind == "S3Store":
        if data is None:
            store.c.delete(chunk_key(address))
        else:
            store.c.put(chunk_key(address), data)
        return
    if kind == "SqliteStore":
        c = sqlite3.connect(store.path, timeout=30)
        try:
            if data is None:
                c.execute(f"DELETE FROM {store._t_objects} WHERE address = ?", (address,))
            else:
                c.execute(f"UPDATE {store._t_objects} SET data = ? WHERE address = ?", (data, address))
            c.commit()
        finally:
            c.close()
        return
    rows = store._query(f"SELECT data IS NULL FROM {store.names.objects} WHERE address = %s", (address,))
    if rows and rows[0][0]:       # a catalog whose chunks are in an object store: its bytes are there
        if data is None:
            store._objects.c.delete(chunk_key(address))
        else:
            store._objects.c.put(chunk_key(address), data)
        return
    import psycopg2
    conn = psycopg2.connect(store._dsn)
    conn.autocommit = True
    try:
        cur = conn.cursor()
        if data is None:
            cur.execute(f"DELETE FROM {store.names.objects} WHERE address = %s", (address,))
        else:
            cur.execute(f"UPDATE {store.names.objects} SET data = %s WHERE address = %s",
                        (psycopg2.Binary(data), address))
    finally:
        conn.close()


def shared_chunks(store, older, newer, min_size: int = 4096) -> list[bytes]:
    """Chunks of at least ``min_size`` bytes that two puts' :class:`Chunks` both list."""
    sizes = dict(zip(newer.addresses, newer.sizes))
    both = set(older.addresses) & set(newer.addresses)
    return sorted(a for a in both if sizes[a] >= min_size)


def trials(c) -> None:
    """The ``chunkrot`` trials of campaign ``c`` (a :class:`crashtests.trialkit.TrialKit`)."""
    from agck.stores.file.store import FileStore
    from agck.stores.sqlite.store import SqliteStore
    from crashtests.trialkit import log     # (imports torch: damage() and its kin are used without it)
    cfg = c.cfg
    if not c.starts("chunkrot"):
        return
    trees = c.trees()
    for s in cfg.stores:
        n = cfg.n(s, "chunkrot")
        log(cfg, f"chunk damage trials on {s}: {n}")
        for j in range(n):
            if not c.time_left():
                c.skip_rest(s, "chunkrot", n - j)
                break
            # a store of its own per trial: the check after each put scrubs the whole store
            i = c.last_id + 1
            if cfg.profile == "large":
                from agck.stores import open_store
                url = c.own.url(s, db="corrupt")
                def opener(mode, url=url): return open_store(url, verify_reused=mode)
            elif s == "file":
                url = f"{c.work}/chunkrot-{i}"
                def opener(mode, url=url): return FileStore(url, verify_reused=mode)
            elif s == "sqlite":
                url = f"sqlite:///{c.work}/chunkrot-{i}.db"
                def opener(mode, url=url): return SqliteStore(url, verify_reused=mode)
            elif s == "s3":
                from agck.stores.s3.store import S3Store
                url = c.s3_url(f"chunkrot-{i}")
                def opener(mode, url=url): return S3Store(url, verify_reused=mode)
            elif s == "pgs3":
                from agck.stores.postgres.store import PostgresStore
                url = c.catalog_url("corrupt", f"catrot{i}", f"catrot-{i}")
                objects = c.s3_url(f"catrot-{i}")
                def opener(mode, i=i, objects=objects):
                    return PostgresStore(c.cluster.dsn("corrupt"), prefix=f"catrot{i}", init=True,
                                         verify_reused=mode, objects=objects)
            else:
                from agck.stores.postgres.store import PostgresStore
                url = c.cluster.dsn("corrupt") + f"&agck_prefix=rot{i}"
                def opener(mode, i=i): return PostgresStore(c.cluster.dsn("corrupt"), prefix=f"rot{i}", init=True,
                                                            verify_reused=mode)
            t = c.new_trial(s, "chunkrot", "rot", url)
            try:
                trial(c, t, opener, trees)
                c.own.done(t)
            except Exception as e:
                t.reasons.append(f"harness error: {type(e).__name__}: {e}")
                t.recovered = "raised"


def trial(c, t, opener, trees: dict) -> None:
    from agck.recovery import verify_store
    from crashtests import checker
    from crashtests.workload import state_hash
    rng = c.rng
    detector = rng.choice(DETECTORS)
    mode = {"put-full": "full", "put-sample": "sample"}.get(detector, rng.choice(("none", "size")))
    store = opener(mode)
    steps = sorted(trees)
    events: list[dict] = []        # each damage: address, injected, detected (monotonic time or None)
    puts: list[tuple] = []         # (step, began, addresses listed)
    labels = []
    try:
        last = None
        for j, k in enumerate(steps):
            began = time.monotonic()
            store.put(t.run, k, trees[k], meta={"snapshot": True}, parent=steps[j - 1] if j else None)
            t.acked.append(k)
            chunks = store.last_put
            puts.append((k, began, set(chunks.addresses) if chunks is not None else set()))
            broken = set(store.scrub(quarantine=False).broken)
            known = all(e["detected"] is not None and e["detected"] < began for e in events)
            if store.ref(t.run, k) in broken and known:
                t.unreadable.append(k)
                t.reasons.append(f"step {k}, put after every damage was detected, lists a damaged chunk")
            if j + 1 < len(steps) and last is not None and chunks is not None and rng.random() < 0.8:
                targets = shared_chunks(store, last, chunks)
                if targets:
                    a = rng.choice(targets)
                    kind = rng.choice(KINDS)
                    try:
                        labels.append(kind)
                        ev = {"address": a, "injected": time.monotonic(), "detected": None,
                              "label": damage(store, a, kind, rng)}
                    except LookupError:
                        ev = None
                    if ev is not None:
                        events.append(ev)
                        _detect(store, t.run, k, detector, verify_store)
                        if detector not in ("put-sample",):
                            ev["detected"] = time.monotonic()
            last = chunks if chunks is not None else last
        # the damage stops: detect what is left, and put the newest step once more (a resumed run)
        store.scrub()
        for ev in events:
            ev["detected"] = ev["detected"] or time.monotonic()
        began = time.monotonic()
        store.put(t.run, steps[-1], trees[steps[-1]], meta={"snapshot": True},
                  parent=steps[-2] if len(steps) > 1 else None)
        puts.append((steps[-1], began, set(store.last_put.addresses) if store.last_put else set()))
        t.reached = bool(events)
        t.point = f"{detector}/{mode}:" + ",".join(sorted(set(labels))) if labels else f"{detector}/{mode}:none"
        t.detail = "; ".join(f"{e['label']} of {e['address'].hex()[:12]}" for e in events)
        # which damaged contents no put after their detection held: their checkpoints are the fault's
        unhealed = {e["address"] for e in events
                    if not any(b > e["detected"] and e["address"] in listed for _, b, listed in puts)}
        listed_by = {}
        for k, _, listed in puts:
            listed_by[k] = listed      # the newest put of each step
        for k in sorted(set(t.acked)):
            try:
                ck = store.read(t.run, k)
                if state_hash(ck.state) != c.full.get(k):
                    t.hash_ok = False
                    t.reasons.append(f"step {k} read back with state hash {state_hash(ck.state)}")
            except Exception as e:
                if listed_by.get(k, set()) & unhealed:
                    t.damaged.append(k)
                    continue
                t.unreadable.append(k)
                t.reasons.append(f"acknowledged step {k} cannot be read: {type(e).__name__}: {e}")
        checker.check_library(store, t, c.full)
    finally:
        store.close()


def _detect(store, run: str, step: int, detector: str, verify_store) -> None:
    if detector == "read":
        try:
            store.read(run, step)
        except Exception:
            pass          # the damage: found, and quarantined by the read
    elif detector == "scrub":
        store.scrub()
    elif detector == "verify":
        verify_store(store, run)
