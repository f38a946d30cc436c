"""The objects of a Postgres store: the content its incremental checkpoints share.

Each distinct chunk of content is one row of ``{prefix}_objects``, keyed by its
BLAKE3-256 address (:mod:`agck.stores.content`). :class:`SharedObjects` is the
part of :class:`~agck.stores.postgres.store.PostgresStore` that works on that table:
which objects a put can rely on, sending those the store lacks, checking the
reused ones (``verify_reused``), quarantine, garbage collection and scrub.

Writers and the collector exclude each other with one transaction advisory
lock per store (:mod:`agck.stores.content`, rule 2): a put holds it shared
from the moment it looks for the objects it relies on until its COMMIT; the
collector holds it exclusively while it reads every listing and deletes the
objects none lists. So no object a put relies on can be deleted before its
listing commits, and a collection sees every listing committed before it
began, with no per-object row or lock per checkpoint (a checkpoint's cost
stays proportional to what it sends). A collection that deleted anything,
and a quarantine, increment ``{prefix}_gc.generation``; a store object asks the database only
about objects it has not itself committed while the generation it read is
current. Schema 2 kept a ``refs`` row per listed object instead; ``migrate``
drops it.

Objects in an object store (``agck_objects``, :mod:`agck.stores.s3.chunks`): an object's
row has ``data`` NULL and its bytes are a chunk object there. A put uploads
the chunks it lacks while it holds the lock shared, and commits their rows
with its listing; a put killed before COMMIT leaves chunks no row names. The
collector decides under the lock exclusively, in two transactions: the first
deletes the rows of dead objects, and names in ``{prefix}_doomed`` every one
of them and every chunk in the store that no row names (under the exclusive
lock no put is between its upload and its COMMIT); the second deletes from
the object store those doomed addresses that still have no row (a put that
needed one again since has uploaded it anew and committed its row), then
forgets them. A collector killed between or during the two leaves chunks to be
deleted by the next one, and never a row without its chunk.

:class:`SharedObjects` is a mixin of the store: it uses the store's ``names``
(:class:`~agck.stores.postgres.schema.Names`), ``_transaction``, ``_query``, ``ref``,
``url``, ``verify_reused``, ``_reread_turn``, ``_known_lock`` (the threads of a
store share what it knows), ``_claims`` and ``_claimed`` (the objects its threads
are sending), and the store calls :meth:`SharedObjects._forget_objects` whenever
its pool drops a broken connection, and :meth:`SharedObjects._release_claims`
when a put's transaction has ended. Methods
taking a cursor run inside the caller's transaction and never end it.
"""

from __future__ import annotations

import threading
from functools import partial
from typing import Callable

import psycopg2
import psycopg2.errors

from ... import cipher, failpoints
from ...args import check_addresses
from ...errors import DurabilityError
from .. import content, damage
from . import schema as pgschema
from .copy import COPY_IO_SIZE, ObjectsIn, ObjectsOut
from .schema import XACT_LOCK

# How often collect_garbage (or a quarantine) starts over when writers got in its way.
GC_RETRIES = 5
# How often a put sends its missing objects again after another writer sent one of them first.
_OBJECT_ROUNDS = 8
# How long a put waits for another thread of its store sending the same objects (then sends them too).
_CLAIM_WAIT = 60.0
# Objects a store object remembers having committed (32 bytes each), so a put asks the
# database only about the others while no collection has run (the gc generation).
_KNOWN_OBJECTS_MAX = 1 << 22


def _itemsizes(plans: list["content.Plan"]) -> Callable[[bytes], int | None]:
    """A chunk's float element size, from the first of ``plans`` holding it."""
    def itemsize(address: bytes) -> int | None:
        for plan in plans:
            if address in plan.distinct:
                return plan.itemsize(address)
        return None
    return itemsize


def _missing(plans: list["content.Plan"], present: set[bytes]) -> list:
    """(address, bytes) of the objects ``plans`` hold that are not in ``present``; an
    object two of them hold comes once."""
    missing, seen = [], set(present)
    for plan in plans:
        m = plan.missing(seen)
        seen.update(a for a, _ in m)
        missing += m
    return missing


class Refused(Exception):
    """The database refused a put's objects in a way a new attempt gets past."""


class SharedObjects:
    """The objects table of a :class:`~agck.stores.postgres.store.PostgresStore` (see the module)."""

    # -- what this store object knows of the objects table ------------------------------
    def _forget_objects(self) -> None:
        """Forget every object this store object committed (a new connection: a failover
        or a restore may have lost them)."""
        with self._known_lock:
            self._known_objects: set[bytes] = set()
            self._known_generation = None

    def _still_known(self, cur, generation: int, addresses: list[bytes]) -> list[bytes]:
        """Those of ``addresses`` this store object committed itself and the store still
        holds, as of gc ``generation``: while no collection (or quarantine) ran, all it
        knows; after one, those of them a query finds."""
        with self._known_lock:
            current = generation == self._known_generation
            if not current:     # a collection ran: what this store knew may be gone
                known_before = self._known_objects
                self._known_objects = set()
                self._known_generation = generation
            known = self._known_objects if current else known_before
            mine = [a for a in addresses if a in known]
        return mine if current else list(self._present(cur, mine))

    def _committed_objects(self, plans: list["content.Plan"]) -> None:
        """After a put's COMMIT: its objects are in the store until a collection runs."""
        if not plans:
            return
        with self._known_lock:
            if len(self._known_objects) > _KNOWN_OBJECTS_MAX:
                self._known_objects = set()
            for plan in plans:
                self._known_objects.update(plan.distinct)

    def _present(self, cur, addresses: list[bytes]) -> set[bytes]:
        names = self._sealed.names(addresses) if self._sealed is not None else None
        cur.execute(f"SELECT address FROM {self.names.objects} WHERE address = ANY(%s::bytea[])",
                    (addresses if names is None else list(names),))
        found = {bytes(a) for (a,) in cur.fetchall()}
        return found if names is None else {names[a] for a in found}

    def _read_objects(self, cur, addresses: list[bytes], *, external: bool = True, sealed: bool = False) -> dict:
        """The listed objects the store holds (address -> bytes): those in the database
        in one COPY, then (``external``) the rest from the object store, if it has one."""
        sink = ObjectsOut()
        wanted = list(dict.fromkeys(addresses))
        names = self._sealed.names(wanted) if self._sealed is not None else None
        query = cur.mogrify(f"COPY (SELECT address, data FROM {self.names.objects} WHERE address = ANY(%s::bytea[]) "
                            f"AND data IS NOT NULL) TO STDOUT (FORMAT binary)",
                            (wanted if names is None else list(names),)).decode("utf-8")
        cur.copy_expert(query, sink, size=COPY_IO_SIZE)
        found = sink.finish()
        if external and self._objects is not None:    # (in an encrypted catalog, by name)
            found.update(self._objects.fetch([a for a in (wanted if names is None else names) if a not in found]))
        if names is not None:    # rows and objects keyed by name, sealed: opened, or left sealed for found_into
            return self._sealed.by_address(found, names) if sealed else self._sealed.opened(found, names)
        return found

    def _fetch_into(self, found: dict):
        """A ``fetch_into`` for :func:`content.decode`: an object read from the database
        (``found``) copied into place, any other read from the object store straight into it.
        Encrypted: each sealed chunk, from ``found`` or the object store, opened into place."""
        if self._sealed is not None:
            return self._sealed_into(found)
        ext, held = self._objects, content.found_into(found)

        def into(address: bytes, view: memoryview) -> int | None:
            got = held(address, view)
            return ext.fetch_into(address, view) if got is None else got

        return into

    def _sealed_into(self, found: dict):
        ext, opened = self._objects, self._sealed.found_into(found)

        def into(address: bytes, view: memoryview) -> int | None:
            if address not in found and ext is not None:
                name = self.sealer.name(address)
                data = ext.fetch([name]).get(name)
                return None if data is None else self._sealed.found_into({address: data})(address, view)
            return opened(address, view)

        return into

    def _object_sizes(self, addresses: list[bytes]) -> dict[bytes, int | None]:
        """The object store's sizes of ``addresses`` (None where absent); in an encrypted
        catalog looked up by name, the 48 bytes of sealing taken off."""
        if self._sealed is None:
            return self._objects.sizes(addresses)
        names = self._sealed.names(addresses)
        return self._sealed.sizes(self._objects.sizes(list(names)), names)

    # -- a put's objects ----------------------------------------------------------------
    def _put_objects(self, cur, plans: list["content.Plan"], present: set[bytes]) -> None:
        """Send the objects of ``plans`` the store lacks (not in ``present``). The store
        lock is held shared: no collector deletes an object before this transaction
        ends. Another writer may send one of them first: the COPY then fails on its
        key, and is done again, in a savepoint, without the ones that have arrived."""
        n = self.names
        if self._objects is not None:
            self._put_external(cur, plans, present)
            return
        encoded: dict = {}      # address -> (raw size, stored bytes), kept across rounds
        for _ in range(_OBJECT_ROUNDS):
            missing = _missing(plans, present)
            if not missing:
                return
            busy = self._claim([a for a, _ in missing])
            if busy:    # another thread of this store is sending some of them: once it ends, those it committed
                for done in busy:
                    done.wait(_CLAIM_WAIT)
                present |= self._present(cur, [a for a, _ in missing])
                continue
            missing.sort()      # writers sending the same new objects meet them in one order: no deadlock
            todo = [(a, v) for a, v in missing if a not in encoded]
            encoded.update((a, e) for a, *e in content.encode_chunks(todo, self.compression, _itemsizes(plans)))
            rows = [(a, *encoded[a]) for a, _ in missing]
            # sealed one at a time as the COPY streams them: no second copy of the new chunks held at once
            stream = ObjectsIn(rows if self._sealed is None else self._sealed.sealed(rows))
            try:     # the savepoint stays open to COMMIT, which commits what it holds
                cur.copy_expert(f"SAVEPOINT agck_objects; COPY {n.objects} (address, size, data) FROM STDIN "
                                "(FORMAT binary)", stream, size=COPY_IO_SIZE)
            except psycopg2.errors.UniqueViolation:
                if stream.error is not None:
                    raise
                cur.execute("ROLLBACK TO SAVEPOINT agck_objects")
                present |= self._present(cur, [a for a, _ in missing])
                continue
            except psycopg2.Error:
                if stream.error is not None:
                    raise stream.error from None
                raise
            if stream.error is not None:
                raise stream.error
            return
        raise Refused("other writers kept sending the same objects")

    def _claim(self, addresses: list[bytes]) -> list:
        """Claim ``addresses`` for this thread's put, all of them, or none when another
        thread of this store object is sending some (its put not yet ended): then the
        events that tell when those puts end. Two threads that would send the same new
        content at once (LangGraph writes a large value as a pending write and as a
        channel beside it) send it once: the other waits, then finds it committed,
        instead of sending it too, blocking on the first one's rows, failing, and
        leaving the bytes it sent as dead rows. :meth:`_release_claims` ends them."""
        with self._known_lock:
            mine = getattr(self._claimed, "event", None)
            busy = {id(e): e for a in addresses if (e := self._claims.get(a)) is not None and e is not mine}
            if busy:
                return list(busy.values())
            if mine is None:
                mine = self._claimed.event = threading.Event()
                self._claimed.addresses = []
            for a in addresses:
                self._claims[a] = mine
            self._claimed.addresses += addresses
        return []

    def _release_claims(self) -> None:
        """After this thread's put transaction ended (committed or rolled back)."""
        mine = getattr(self._claimed, "event", None)
        if mine is None:
            return
        with self._known_lock:
            for a in self._claimed.addresses:
                if self._claims.get(a) is mine:
                    del self._claims[a]
            self._claimed.event = None
            self._claimed.addresses = []
        mine.set()

    def _put_external(self, cur, plans: list["content.Plan"], present: set[bytes]) -> None:
        """The objects the store lacks uploaded to the object store (each durable when
        its PUT returns), then their rows (``data`` NULL) inserted in this transaction.
        Another writer's row for one of them, committed or not, is left as it is: its
        bytes are the same."""
        missing = _missing(plans, present)
        if not missing:
            return
        itemsize = _itemsizes(plans)
        if self._sealed is None:
            self._objects.upload(missing, lambda a, v: self.compression.encode(a, v, itemsize(a)).stored)
        else:     # under its name, compressed then sealed (FORMAT.md 18.3, 18.7)
            names = {a: self.sealer.name(a) for a, _ in missing}
            address_of = {n: a for a, n in names.items()}

            def sealed(name: bytes, view: memoryview):
                a = address_of[name]
                return self.sealer.seal(cipher.Kind.CHUNK, cipher.chunk_context(name),
                                        self.compression.encode(a, view, itemsize(a)).stored)

            self._objects.upload([(names[a], v) for a, v in missing], sealed)
            missing = [(names[a], v) for a, v in missing]
        failpoints.hit("pgobj.after_upload")
        missing.sort()      # writers inserting the same new rows meet them in one order: no deadlock
        cur.execute(f"INSERT INTO {self.names.objects} (address, size, data) SELECT * FROM "
                    f"unnest(%s::bytea[], %s::bigint[], %s::bytea[]) ON CONFLICT (address) DO NOTHING",
                    ([a for a, _ in missing], [v.nbytes for _, v in missing], [None] * len(missing)))

    def _heal_reused(self, cur, plans: list["content.Plan"], stored: dict[bytes, int], found: list[bytes]) -> None:
        """``verify_reused``: check the objects the put relies on (``stored``: address ->
        stored size); quarantine the damaged ones, in this transaction, and drop them
        from ``found`` so they are sent afresh."""
        sizes = {}
        for plan in plans:
            for a in plan.distinct:
                sizes.setdefault(a, plan.size(a))
        bad = damage.reused_damage(stored, sizes.__getitem__, self.verify_reused, self._reread_turn(),
                                    lambda addresses: self._read_objects(cur, addresses))
        if bad:
            self._quarantine_rows(cur, bad)
            found[:] = [a for a in found if a not in bad]
            self._known_objects.difference_update(bad)

    # -- damaged objects ----------------------------------------------------------------
    def _quarantine_rows(self, cur, bad: dict[bytes, str]) -> None:
        """In a write transaction: move the objects ``bad`` names (address -> why) to the
        quarantine table, and move the gc generation on: every store object forgets
        what it knew to be stored, so none relies on them without looking."""
        n = self.names
        if self._sealed is not None:     # rows and objects keyed by name (FORMAT.md 18.3)
            bad = {self.sealer.name(a): why for a, why in bad.items()}
        cur.execute("SAVEPOINT agck_quarantine")
        try:     # two first quarantines may race to create the table
            cur.execute(pgschema.quarantine_ddl(n) + "; RELEASE SAVEPOINT agck_quarantine")
        except (psycopg2.errors.UniqueViolation, psycopg2.errors.DuplicateTable, psycopg2.errors.DuplicateObject):
            cur.execute("ROLLBACK TO SAVEPOINT agck_quarantine")
        outside: dict[bytes, object] = {}
        if self._objects is not None:    # damaged bytes in the object store: kept here, deleted there
            cur.execute(f"SELECT address FROM {n.objects} WHERE address = ANY(%s::bytea[]) AND data IS NULL",
                        (list(bad),))
            held = [bytes(a) for (a,) in cur.fetchall()]
            outside = {a: None for a in held}
            outside.update(self._objects.fetch(held))
        addresses, reasons = list(bad), list(bad.values())
        kept = [None if outside.get(a) is None else psycopg2.Binary(outside[a]) for a in addresses]
        cur.execute(f"INSERT INTO {n.quarantine} (address, size, data, reason) SELECT o.address, "
                    f"coalesce(octet_length(o.data), octet_length(r.data), o.size), coalesce(o.data, r.data), "
                    f"r.reason FROM {n.objects} o JOIN unnest(%s::bytea[], %s::text[], %s::bytea[]) "
                    f"AS r(address, reason, data) ON o.address = r.address; "
                    f"DELETE FROM {n.objects} WHERE address = ANY(%s::bytea[]); "
                    f"UPDATE {n.gc} SET generation = generation + 1", (addresses, reasons, kept, addresses))
        if outside:    # the next put holding their content uploads good bytes under their names
            self._objects.delete(list(outside))

    def quarantine(self, addresses) -> dict[bytes, str]:
        addresses = check_addresses(addresses)
        wanted = list(dict.fromkeys(bytes(a) for a in addresses))

        def body(cur):
            out, bad = damage.judge(wanted, self._read_objects(cur, wanted))
            gone = [a for a, v in out.items() if v == "missing"]
            if gone and self._objects is not None:
                # a row whose object the bucket lost: the catalog no longer holds it, so the
                # next put holding its content uploads it again (and heals what lists it)
                cur.execute(f"DELETE FROM {self.names.objects} WHERE address = ANY(%s::bytea[]) AND data IS NULL",
                            (gone if self._sealed is None else list(self._sealed.names(gone)),))
            if bad:
                self._quarantine_rows(cur, bad)
            elif gone:   # writers that knew it stored look again
                cur.execute(f"UPDATE {self.names.gc} SET generation = generation + 1")
            return out

        out = self._exclusive(body, "quarantining damaged objects failed")
        self._known_objects.difference_update(wanted)
        return out

    def quarantined(self) -> list[damage.QuarantinedChunk]:
        n = self.names
        if not self._query("SELECT to_regclass(%s) IS NOT NULL", (n.quarantine,))[0][0]:
            return []
        rows = self._query(f"SELECT ctid::text, address, size, extract(epoch FROM detected_at)::float8, reason "
                           f"FROM {n.quarantine} ORDER BY detected_at, ctid")
        return [damage.QuarantinedChunk(address=bytes(a).hex(), size=size, detected_at=t, reason=why,
                                          ref=f"{n.quarantine_ref}(ctid='{tid}')")
                for tid, a, size, t, why in rows]

    def _scrub(self, progress) -> damage.ScrubReport:
        """In one snapshot (REPEATABLE READ): every listing, then every object, read in
        batches in address order."""
        n = self.names

        def body(cur):
            keys = cur.fetchall()

            def listed(run, step, checksum, ref):
                return content.listed_addresses(self._listing(cur, run, step, checksum, ref), verify=True, ref=ref)

            def stored():
                after = b""
                while True:
                    cur.execute(f"SELECT address, size, data FROM {n.objects} WHERE address > %s "
                                "ORDER BY address LIMIT 16", (after,))
                    rows = cur.fetchall()
                    if not rows:
                        return
                    for a, size, data in rows:
                        a = bytes(a)
                        load = (lambda a=a, d=data: self._opened_object(a, d)) if data is not None else \
                            (lambda a=a: self._opened_object(a, self._objects.fetch([a]).get(a))
                             if self._objects is not None else None)
                        yield a, size, f"{n.objects_ref}(address='\\x{a.hex()}')", load
                    after = bytes(rows[-1][0])

            listings = [(self.ref(r, s), partial(listed, r, s, c, self.ref(r, s))) for r, s, c in keys]
            return damage.scrub(self.url, listings, stored(), progress,
                                name=None if self.sealer is None else self.sealer.name)

        return self._transaction("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY; "
                                 f"SELECT run, step, checksum FROM {n.manifest} WHERE listing ORDER BY run, step", None,
                                 body, "scrub failed", n.where)

    # -- collection ---------------------------------------------------------------------
    def _exclusive(self, body, what: str):
        """``body(cur)`` in one durable transaction holding the store lock exclusively
        (it waits for puts in flight to commit, and puts wait for it), started over on
        a deadlock or serialization failure; COMMIT after it returns."""
        return self._transaction("BEGIN; SET LOCAL synchronous_commit = on; " + XACT_LOCK, (self.names.store_lock,),
                                 body, what, self.names.where, DurabilityError,
                                 retry=(psycopg2.errors.DeadlockDetected, psycopg2.errors.SerializationFailure),
                                 retries=GC_RETRIES, pause=0.01)

    def collect_garbage(self) -> content.Collected:
        """Delete the objects no listing refers to, in one transaction holding the
        store lock exclusively: it waits for puts in flight to commit, and puts wait
        for it. Every object a listing names is kept, whatever the listing's verdict;
        a listing nothing can be read from, or one of a newer format, stops the
        collection before anything is deleted (:func:`content.live_chunks`)."""
        n = self.names

        def body(cur):
            live = self._live_objects(cur)
            if not live.complete:
                return live.collected()
            cur.execute("CREATE TEMP TABLE agck_live (address bytea PRIMARY KEY) ON COMMIT DROP")
            kept = live.addresses if self._sealed is None else self._sealed.names(live.addresses)
            cur.execute("INSERT INTO agck_live SELECT unnest(%s::bytea[])", (list(kept),))
            cur.execute(     # an object whose bytes are in the object store is doomed there (the module)
                f"WITH gone AS (DELETE FROM {n.objects} o WHERE NOT EXISTS "
                f"(SELECT 1 FROM agck_live l WHERE l.address = o.address) RETURNING o.address, o.size, "
                f"o.data IS NULL AS outside), doomed AS (INSERT INTO {n.doomed} SELECT address FROM gone "
                f"WHERE outside ON CONFLICT DO NOTHING) "
                f"SELECT count(*), coalesce(sum(size), 0)::bigint FROM gone")
            deleted, nbytes = cur.fetchone()
            if self._objects is not None:
                stray, stray_bytes = self._doom_strays(cur)
                deleted, nbytes = deleted + stray, nbytes + stray_bytes
            if deleted:   # what writers know to be present may be gone: they look again
                cur.execute(f"UPDATE {n.gc} SET generation = generation + 1")
            cur.execute("SELECT to_regclass(%s) IS NOT NULL", (n.quarantine,))
            if cur.fetchone()[0]:     # quarantined objects are kept until healed or listed by no checkpoint
                cur.execute(f"DELETE FROM {n.quarantine} q WHERE NOT EXISTS (SELECT 1 FROM agck_live l WHERE "
                            f"l.address = q.address) OR EXISTS (SELECT 1 FROM {n.objects} o WHERE o.address = q.address)")
            return live.collected(deleted, int(nbytes))

        collected = self._exclusive(body, "collecting garbage failed")
        if self._objects is not None:
            failpoints.hit("gc.pg_doomed")
            self._exclusive(self._delete_doomed, "deleting collected objects from the object store failed")
        return collected

    def _doom_strays(self, cur) -> tuple[int, int]:
        """Name in ``doomed`` every chunk in the object store that no row names: uploads
        of puts that died before their COMMIT. Returns how many and their bytes."""
        stored = self._objects.stored()
        cur.execute("CREATE TEMP TABLE agck_stored (address bytea PRIMARY KEY, size bigint) ON COMMIT DROP")
        cur.execute("INSERT INTO agck_stored SELECT * FROM unnest(%s::bytea[], %s::bigint[])",
                    (list(stored), list(stored.values())))
        cur.execute(f"WITH stray AS (INSERT INTO {self.names.doomed} SELECT s.address FROM agck_stored s "
                    f"WHERE NOT EXISTS (SELECT 1 FROM {self.names.objects} o WHERE o.address = s.address) "
                    f"ON CONFLICT DO NOTHING RETURNING address) SELECT count(*), coalesce(sum(s.size), 0)::bigint "
                    f"FROM stray JOIN agck_stored s USING (address)")
        return cur.fetchone()

    def _delete_doomed(self, cur) -> None:
        """Delete from the object store the doomed objects no row names (again), then
        forget every doomed address: those with a row were needed again meanwhile."""
        n = self.names
        cur.execute(f"SELECT address FROM {n.doomed} d WHERE NOT EXISTS "
                    f"(SELECT 1 FROM {n.objects} o WHERE o.address = d.address)")
        self._objects.delete([bytes(a) for (a,) in cur.fetchall()])
        cur.execute(f"DELETE FROM {n.doomed}")

    def _live_objects(self, cur) -> "content.Live":
        """What every listing lists (:func:`content.live_chunks`), read in this transaction."""
        cur.execute(f"SELECT run, step, checksum FROM {self.names.manifest} WHERE listing ORDER BY run, step")
        refs = [(self.ref(r, s), r, s, c) for r, s, c in cur.fetchall()]
        return content.live_chunks([(ref, partial(self._listing, cur, r, s, c, ref)) for ref, r, s, c in refs])

    def _listing(self, cur, run: str, step: int, checksum: str, ref: str) -> bytes:
        """A listing's container as stored (opened, in an encrypted store), read in this
        transaction. Not checked against its manifest row: the collector keeps what it
        names whatever its verdict."""
        cur.execute(f"SELECT data FROM {self.names.chunks} WHERE run = %s AND step = %s ORDER BY idx", (run, step))
        return self._opened_listing(run, step, b"".join(bytes(d) for (d,) in cur.fetchall()), ref)
