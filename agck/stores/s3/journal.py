"""The object store's step-journal logs (:mod:`agck.journal`): ``log_append``,
``log_read``, ``log_runs`` and ``log_ref`` of :class:`~agck.stores.s3.store.S3Store`.

    <prefix>/runs/<run>/journal/<seq:020d>     one appended batch of records, create-only

An object store cannot append to an object, so each batch of records (they
delimit and check themselves, :mod:`agck.journalrec`) is an object of its own,
created at the run's next number with ``If-None-Match: *``: a batch is durable
when its PUT returns, two writers of one run never take the same number, and a
writer that finds its number taken takes the next one free. The numbers are
dense: a writer only moves past a number it saw taken, so a reader that lists
number n has every number before it. Reading lists the objects after the last
number read and gets them in parallel.

A journal shared between processes needs claims on its steps, which an object
store cannot give with the liveness of a lock (a holder that dies must release
at once): ``log_claims`` is refused here (the base's UsageError).
"""

from __future__ import annotations

from ..base import check_position, check_records
from ... import failpoints
from ...errors import DurabilityError, StoreError
from ...names import check_run
from . import log as s3log
from .client import ObjectExists

_APPEND_TRIES = 1000       # numbers taken by other writers of the run, one after another


class JournalLogs:
    """The journal-log methods of :class:`~agck.stores.s3.store.S3Store` (``self.c``: its
    bucket client; ``self._map``: its parallel map)."""

    @staticmethod
    def _journal_key(run: str, seq: int) -> str:
        return f"runs/{run}/journal/{s3log.seq_name(seq)}"

    def log_ref(self, run: str) -> str:
        return self.c.ref(f"runs/{check_run(run)}/journal/")

    def _journal_seqs(self, run: str, after: int = 0) -> list[int]:
        """The numbers of the run's batches after ``after``, in order."""
        start = self._journal_key(run, after) if after > 0 else None
        seqs = (s3log.parse_seq(o.key.rsplit("/", 1)[1]) for o in self.c.list(f"runs/{run}/journal/", after=start))
        return [s for s in seqs if s is not None and s > after]

    def log_append(self, run: str, records, *, sync: bool = True) -> tuple[int, int]:
        """Append a batch of records as the run's next object (see :meth:`Store.log_append`;
        every batch is durable when this returns, ``sync`` or not). Returns the numbers
        before and after it."""
        records = check_records(records)
        check_run(run)
        self._refuse_sealed_log(self.log_ref(run), records)
        body = b"".join(records)
        with self._journal_lock:
            seq = self._journal_heads.get(run)
        if seq is None:
            seq = (self._journal_seqs(run) or [0])[-1]
        for _ in range(_APPEND_TRIES):
            seq += 1
            key = self._journal_key(run, seq)
            try:
                failpoints.hit("journal.s3.before_put")
                self.c.put(key, body, create=True)
                failpoints.hit("journal.s3.after_put")
                break
            except ObjectExists:
                if self._journal_holds(key, body):      # a retried request whose first try went through
                    break
                seq = (self._journal_seqs(run, seq) or [seq])[-1]
            except DurabilityError:
                if self._journal_holds(key, body):
                    break
                raise DurabilityError(f"journal append failed at batch {seq}", ref=self.c.ref(key),
                                      hint="the records of this batch are not acknowledged; write them again"
                                      ) from None
        else:
            raise StoreError(f"could not append to the journal of run {run!r}: {_APPEND_TRIES} other batches came "
                             "first", ref=self.log_ref(run), hint="too many writers on one run; retry")
        with self._journal_lock:
            if self._journal_heads.get(run, 0) < seq:
                self._journal_heads[run] = seq
        return seq - 1, seq

    def _journal_holds(self, key: str, body: bytes) -> bool:
        try:
            got = self.c.get(key)
        except StoreError:
            return False
        return got is not None and bytes(got) == body

    def log_read(self, run: str, start: int = 0) -> tuple[bytes, int]:
        start = check_position(start)
        check_run(run)
        seqs = self._journal_seqs(run, start)
        if not seqs:
            return b"", start
        bodies = self._map(lambda s: self.c.get(self._journal_key(run, s)), seqs)
        out = []
        for s, b in zip(seqs, bodies):
            if b is None:       # listed, then gone: journals are never deleted, so the bucket was changed
                raise StoreError(f"batch {s} of the journal of run {run!r} was listed and then not found",
                                 ref=self.c.ref(self._journal_key(run, s)),
                                 hint="a journal's objects must not be deleted by hand")
            out.append(bytes(b))
        return b"".join(out), seqs[-1]

    def log_runs(self) -> list[str]:
        names = self._run_names()
        has = self._map(lambda r: next(iter(self.c.list(f"runs/{r}/journal/")), None) is not None, names)
        return [r for r, h in zip(names, has) if h]
