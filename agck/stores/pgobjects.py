"""The objects of a Postgres store: the content its incremental checkpoints share.

Each distinct chunk of content is one row of ``{prefix}_objects``, keyed by its
BLAKE3-256 address (:mod:`agck.stores.content`). :class:`SharedObjects` is the
part of :class:`~agck.stores.postgres.PostgresStore` that works on that table:
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

:class:`SharedObjects` is a mixin of the store: it uses the store's ``names``
(:class:`~agck.stores.pgschema.Names`), ``_transaction``, ``_query``, ``ref``,
``url``, ``verify_reused`` and ``_reread_turn``, and the store calls
:meth:`SharedObjects._forget_objects` whenever it opens a connection. Methods
taking a cursor run inside the caller's transaction and never end it.
"""

from __future__ import annotations

from functools import partial

import psycopg2
import psycopg2.errors

from ..errors import DurabilityError
from . import content, pgschema
from .pgcopy import COPY_IO_SIZE, ObjectsIn, ObjectsOut
from .pgschema import XACT_LOCK
from .sqlrows import check_checksum

# How often collect_garbage (or a quarantine) starts over when writers got in its way.
GC_RETRIES = 5
# How often a put sends its missing objects again after another writer sent one of them first.
_OBJECT_ROUNDS = 8
# Objects a store object remembers having committed (32 bytes each), so a put asks the
# database only about the others while no collection has run (the gc generation).
_KNOWN_OBJECTS_MAX = 1 << 22


class Refused(Exception):
    """The database refused a put's objects in a way a new attempt gets past."""


class SharedObjects:
    """The objects table of a :class:`~agck.stores.postgres.PostgresStore` (see the module)."""

    # -- what this store object knows of the objects table ------------------------------
    def _forget_objects(self) -> None:
        """Forget every object this store object committed (a new connection: a failover
        or a restore may have lost them)."""
        self._known_objects: set[bytes] = set()
        self._known_generation = None

    def _still_known(self, cur, generation: int, addresses: list[bytes]) -> list[bytes]:
        """Those of ``addresses`` this store object committed itself and the store still
        holds, as of gc ``generation``: while no collection (or quarantine) ran, all it
        knows; after one, those of them a query finds."""
        if generation != self._known_generation:    # a collection ran: what this store knew may be gone
            known_before = self._known_objects
            self._known_objects = set()
            self._known_generation = generation
            return list(self._present(cur, [a for a in addresses if a in known_before]))
        return [a for a in addresses if a in self._known_objects]

    def _committed_objects(self, plans: list["content.Plan"]) -> None:
        """After a put's COMMIT: its objects are in the store until a collection runs."""
        if not plans:
            return
        if len(self._known_objects) > _KNOWN_OBJECTS_MAX:
            self._known_objects = set()
        for plan in plans:
            self._known_objects.update(plan.distinct)

    def _present(self, cur, addresses: list[bytes]) -> set[bytes]:
        cur.execute(f"SELECT address FROM {self.names.objects} WHERE address = ANY(%s::bytea[])", (addresses,))
        return {bytes(a) for (a,) in cur.fetchall()}

    def _read_objects(self, cur, addresses: list[bytes]) -> dict:
        """The listed objects the store holds (address -> bytes), in one COPY."""
        sink = ObjectsOut()
        query = cur.mogrify(f"COPY (SELECT address, data FROM {self.names.objects} WHERE address = ANY(%s::bytea[])) "
                            f"TO STDOUT (FORMAT binary)", (list(dict.fromkeys(addresses)),)).decode("utf-8")
        cur.copy_expert(query, sink, size=COPY_IO_SIZE)
        return sink.finish()

    # -- a put's objects ----------------------------------------------------------------
    def _put_objects(self, cur, plans: list["content.Plan"], present: set[bytes]) -> None:
        """Send the objects of ``plans`` the store lacks (not in ``present``). The store
        lock is held shared: no collector deletes an object before this transaction
        ends. Another writer may send one of them first: the COPY then fails on its
        key, and is done again, in a savepoint, without the ones that have arrived."""
        n = self.names
        for _ in range(_OBJECT_ROUNDS):
            missing, seen = [], set(present)
            for plan in plans:      # an object two of them hold is sent once
                m = plan.missing(seen)
                seen.update(a for a, _ in m)
                missing += m
            if not missing:
                return
            missing.sort()      # writers sending the same new objects meet them in one order: no deadlock
            stream = ObjectsIn(missing)
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

    def _heal_reused(self, cur, plans: list["content.Plan"], stored: dict[bytes, int], found: list[bytes]) -> None:
        """``verify_reused``: check the objects the put relies on (``stored``: address ->
        stored size); quarantine the damaged ones, in this transaction, and drop them
        from ``found`` so they are sent afresh."""
        sizes = {}
        for plan in plans:
            for a in plan.distinct:
                sizes.setdefault(a, plan.size(a))
        bad = content.reused_damage(stored, sizes.__getitem__, self.verify_reused, self._reread_turn(),
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
        cur.execute("SAVEPOINT agck_quarantine")
        try:     # two first quarantines may race to create the table
            cur.execute(pgschema.quarantine_ddl(n) + "; RELEASE SAVEPOINT agck_quarantine")
        except (psycopg2.errors.UniqueViolation, psycopg2.errors.DuplicateTable, psycopg2.errors.DuplicateObject):
            cur.execute("ROLLBACK TO SAVEPOINT agck_quarantine")
        addresses, reasons = list(bad), list(bad.values())
        cur.execute(f"INSERT INTO {n.quarantine} (address, size, data, reason) SELECT o.address, octet_length(o.data), "
                    f"o.data, r.reason FROM {n.objects} o JOIN unnest(%s::bytea[], %s::text[]) AS r(address, reason) "
                    f"ON o.address = r.address; DELETE FROM {n.objects} WHERE address = ANY(%s::bytea[]); "
                    f"UPDATE {n.gc} SET generation = generation + 1", (addresses, reasons, addresses))

    def quarantine(self, addresses) -> dict[bytes, str]:
        wanted = list(dict.fromkeys(bytes(a) for a in addresses))

        def body(cur):
            out, bad = content.judge(wanted, self._read_objects(cur, wanted))
            if bad:
                self._quarantine_rows(cur, bad)
            elif "missing" in out.values():   # writers that knew it stored look again
                cur.execute(f"UPDATE {self.names.gc} SET generation = generation + 1")
            return out

        out = self._exclusive(body, "quarantining damaged objects failed")
        self._known_objects.difference_update(wanted)
        return out

    def quarantined(self) -> list[content.QuarantinedChunk]:
        n = self.names
        if not self._query("SELECT to_regclass(%s) IS NOT NULL", (n.quarantine,))[0][0]:
            return []
        rows = self._query(f"SELECT ctid::text, address, size, extract(epoch FROM detected_at)::float8, reason "
                           f"FROM {n.quarantine} ORDER BY detected_at, ctid")
        return [content.QuarantinedChunk(address=bytes(a).hex(), size=size, detected_at=t, reason=why,
                                          ref=f"{n.quarantine_ref}(ctid='{tid}')")
                for tid, a, size, t, why in rows]

    def _scrub(self, progress) -> content.ScrubReport:
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
                        yield a, size, f"{n.objects_ref}(address='\\x{a.hex()}')", (lambda d=data: d)
                    after = bytes(rows[-1][0])

            listings = [(self.ref(r, s), partial(listed, r, s, c, self.ref(r, s))) for r, s, c in keys]
            return content.scrub(self.url, listings, stored(), progress)

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
        for it. A damaged listing keeps nothing alive (nothing could ever rebuild
        its content); one that cannot be read here (a newer format) stops the
        collection before anything is deleted."""
        n = self.names

        def body(cur):
            live, listings, damaged = self._live_objects(cur)
            cur.execute("CREATE TEMP TABLE agck_live (address bytea PRIMARY KEY) ON COMMIT DROP")
            cur.execute("INSERT INTO agck_live SELECT unnest(%s::bytea[])", (list(live),))
            cur.execute(
                f"WITH gone AS (DELETE FROM {n.objects} o WHERE NOT EXISTS "
                f"(SELECT 1 FROM agck_live l WHERE l.address = o.address) RETURNING o.size) "
                f"SELECT count(*), coalesce(sum(size), 0)::bigint FROM gone")
            deleted, nbytes = cur.fetchone()
            if deleted:   # what writers know to be present may be gone: they look again
                cur.execute(f"UPDATE {n.gc} SET generation = generation + 1")
            cur.execute("SELECT to_regclass(%s) IS NOT NULL", (n.quarantine,))
            if cur.fetchone()[0]:     # quarantined objects are kept until healed or listed by no checkpoint
                cur.execute(f"DELETE FROM {n.quarantine} q WHERE NOT EXISTS (SELECT 1 FROM agck_live l WHERE "
                            f"l.address = q.address) OR EXISTS (SELECT 1 FROM {n.objects} o WHERE o.address = q.address)")
            return content.Collected(listings=listings, live_chunks=len(live), deleted_chunks=deleted,
                                     deleted_bytes=int(nbytes), damaged=damaged)

        return self._exclusive(body, "collecting garbage failed")

    def _live_objects(self, cur) -> tuple[set[bytes], int, list[str]]:
        """What every listing lists (:func:`content.live_chunks`), read in this transaction."""
        cur.execute(f"SELECT run, step, checksum FROM {self.names.manifest} WHERE listing ORDER BY run, step")
        refs = [(self.ref(r, s), r, s, c) for r, s, c in cur.fetchall()]
        return content.live_chunks([(ref, partial(self._listing, cur, r, s, c, ref)) for ref, r, s, c in refs])

    def _listing(self, cur, run: str, step: int, checksum: str, ref: str) -> bytes:
        """A listing's container, read in this transaction and checked against its manifest row."""
        cur.execute(f"SELECT data FROM {self.names.chunks} WHERE run = %s AND step = %s ORDER BY idx", (run, step))
        buf = b"".join(bytes(d) for (d,) in cur.fetchall())
        check_checksum(buf, checksum, ref)
        return buf
