"""Damaged chunks: put-time checks of reused chunks, quarantine, scrub.

A chunk is written once and then relied on by every later checkpoint holding its
bytes, so damage to it (bit rot, a bad sector, a stray write) would break each of
them the moment it is acknowledged. Three defences, in the manner of ZFS's scrub
and self-healing:

* detection: any read that rebuilds a chunked checkpoint, `agck verify`, and
  `agck scrub` (:meth:`Store.scrub`, every stored chunk re-hashed) name the chunks
  whose bytes do not match their address (DamagedChunkError);
* quarantine: the store re-reads each such chunk under its collector's lock and,
  if the stored bytes are indeed damaged, moves them out of the object table, so
  no writer can rely on them any more and the next put holding that content
  writes it afresh, which heals every checkpoint that lists it;
* at put time (``verify_reused``): a put checks what it reuses before relying on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

from .. import chunkcodec, chunking
from ..errors import AgckError, CorruptCheckpointError, FormatError, StoreError, UnsupportedVersionError, UsageError

VERIFY_REUSED = ("none", "size", "sample", "full")
DEFAULT_VERIFY_REUSED = "sample"
SAMPLE_SHARE = 16     # "sample": a put re-reads the reused chunks of one address bucket in this many


def check_verify_reused(mode) -> str:
    if mode not in VERIFY_REUSED:
        raise UsageError(f"verify_reused must be one of {', '.join(map(repr, VERIFY_REUSED))}, not {mode!r}",
                         hint="'size' checks each reused chunk's stored size, 'sample' re-reads one "
                              f"address bucket in {SAMPLE_SHARE} per put, 'full' re-reads every one")
    return mode


def reread(address: bytes, mode: str, turn: int) -> bool:
    """Whether a put re-reads and hashes this reused chunk's stored bytes before
    relying on it: never (``none``, ``size``), always (``full``), or (``sample``) when
    the address falls in bucket ``turn`` of ``SAMPLE_SHARE``: addresses are uniform,
    so each put reads about 1/16 of what it reuses, and 16 consecutive puts of a
    store object read every chunk a run keeps reusing."""
    if mode == "full":
        return True
    return mode == "sample" and address[0] % SAMPLE_SHARE == turn % SAMPLE_SHARE


def checks_size(mode: str) -> bool:
    """Whether a put looks at the stored size of every chunk it reuses (``sample``
    trusts existence as ``none`` does, and reads its share whole)."""
    return mode in ("size", "full")


def intact(address: bytes, data) -> bool:
    """Whether the stored chunk ``data`` holds the bytes named by ``address``."""
    return verdict(address, data) is None


def _decoded(data, size: int | None):
    """The chunk a compressed chunk's bytes decode to (``size``: its listed size, else
    what its frame says); None if ``data`` is not a frame that decodes (FORMAT.md 12.9)."""
    view = memoryview(data).cast("B")
    if view.nbytes < chunkcodec.HEADER_SIZE or bytes(view[:4]) != chunkcodec.MAGIC:
        return None
    try:
        raw_size = chunkcodec.read_header(view).raw_size if size is None else size
        return chunkcodec.decode(view, encoded=True, raw_size=raw_size)
    except AgckError:
        return None


def verdict(address: bytes, data, size: int | None = None) -> str | None:
    """Why a stored chunk cannot stand for its address, or None if it can. A chunk
    stored compressed is judged by what it decodes to: shorter than its listed
    ``size`` it must be a frame (rule 12.9); with no size known, bytes that are a
    frame decoding to the address are intact, and any others are judged as they are."""
    if data is None:
        return "missing"
    n = memoryview(data).nbytes
    if size is not None and n > size:
        return f"holds {n} bytes, {size} expected"
    if size is None or n < size:
        raw = _decoded(data, size)
        if raw is not None and chunking.address(raw) == address:
            return None
        if size is not None:
            return f"holds {n} bytes, {size} expected" + (" (a compressed chunk that does not match its address)"
                                                          if raw is not None else "")
    if chunking.address(data) != address:
        return "does not match its address"
    return None


def judge(wanted: Iterable[bytes], found: dict) -> tuple[dict[bytes, str], dict[bytes, str]]:
    """For a quarantine: each of ``wanted``'s verdict given the bytes re-read under the
    collector's lock (``found``: address -> bytes; absent: missing), and the damaged
    ones with why."""
    out: dict[bytes, str] = {}
    bad: dict[bytes, str] = {}
    for a in wanted:
        why = verdict(a, found.get(a))
        out[a] = "intact" if why is None else "missing" if a not in found else "quarantined"
        if out[a] == "quarantined":
            bad[a] = why
    return out, bad


def reused_damage(stored: dict[bytes, int | None], want: Callable[[bytes], int], mode: str, turn: int,
                  read: Callable[[list[bytes]], dict]) -> dict[bytes, str]:
    """Of the chunks a put found stored (address -> stored size, None where it was not
    looked at), those that ``verify_reused`` finds damaged, and why: a size other than
    ``want(address)``, or (the share :func:`reread` picks) bytes that
    ``read(addresses)`` (address -> bytes) returns not matching their address."""
    bad: dict[bytes, str] = {}
    if mode == "none":
        return bad
    short = set()     # fewer bytes than listed: compressed (rule 12.9) or cut short; read and judged
    for a, n in stored.items():
        if n is not None and checks_size(mode) and n != want(a):
            if n > want(a):
                bad[a] = f"holds {n} bytes, {want(a)} expected"
            else:
                short.add(a)
    again = [a for a in stored if a not in bad and (a in short or reread(a, mode, turn))]
    if again:
        found = read(again)
        for a in again:
            why = verdict(a, found.get(a), want(a))
            if why is not None:
                bad[a] = why
    return bad


@dataclass
class QuarantinedChunk:
    """A chunk found damaged and moved out of the object table."""

    address: str          # hex
    size: int             # bytes kept (the damaged ones)
    detected_at: float    # seconds since the epoch
    reason: str
    ref: str              # where the damaged bytes are kept

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Damage:
    """One chunk a scrub found unusable, and the checkpoints it breaks."""

    address: str          # hex
    reason: str           # "does not match its address", "holds N bytes, M expected", "missing"
    ref: str | None       # where the stored bytes are (None when missing)
    checkpoints: list = field(default_factory=list)   # refs of the checkpoints listing it
    quarantined: str | None = None   # the store's verdict: quarantined, missing, intact (re-read fine)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class ScrubReport:
    """What :meth:`Store.scrub` checked and found."""

    url: str
    chunks: int = 0                 # stored chunks re-hashed
    bytes: int = 0
    listings: int = 0               # chunked checkpoints whose listings were read
    damaged: list = field(default_factory=list)            # Damage, stored chunks with wrong bytes or size
    missing: list = field(default_factory=list)            # Damage, listed chunks the store lacks
    damaged_listings: list = field(default_factory=list)   # refs of listings that fail verification
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not (self.damaged or self.missing or self.damaged_listings)

    def absorb(self, other: "ScrubReport") -> None:
        """Add another namespace's findings (a store's multi-rank parts) to these."""
        self.chunks += other.chunks
        self.bytes += other.bytes
        self.listings += other.listings
        self.damaged += other.damaged
        self.missing += other.missing
        self.damaged_listings += other.damaged_listings
        self.seconds += other.seconds

    @property
    def broken(self) -> list[str]:
        """The checkpoints that cannot be read until the content they lack is put again."""
        out = {r for d in self.damaged + self.missing for r in d.checkpoints}
        return sorted(out | set(self.damaged_listings))

    def as_dict(self) -> dict:
        return {"url": self.url, "ok": self.ok, "chunks": self.chunks, "bytes": self.bytes,
                "listings": self.listings, "damaged": [d.as_dict() for d in self.damaged],
                "missing": [d.as_dict() for d in self.missing], "damaged_listings": list(self.damaged_listings),
                "broken_checkpoints": self.broken, "seconds": round(self.seconds, 3)}


def scrub(url: str, listings: Iterable[tuple[str, Callable[[], list[bytes] | None]]],
          stored: Iterable[tuple[bytes, int | None, str, Callable[[], object]]],
          progress: Callable[[int], None] | None = None,
          name: Callable[[bytes], bytes] | None = None) -> ScrubReport:
    """Check every stored chunk against its address and map the bad ones to the
    checkpoints that list them. ``listings``: (ref, listed) of each checkpoint,
    ``listed()`` returning the addresses its verified listing lists (None for a
    standalone container; CorruptCheckpointError or FormatError for a damaged one);
    ``stored``: (address, recorded size or None, ref, read) of each stored chunk,
    ``read()`` returning its bytes (None if it is gone). ``name``: an encrypted store's
    keyed names (FORMAT.md 18.3), which ``stored`` gives in place of addresses: a chunk a
    listing names is judged by its address, one none names by whether its content's
    name is the one it is stored under (and reported by that name)."""
    import time as _time
    t0 = _time.monotonic()
    rep = ScrubReport(url=url)
    users: dict[bytes, list[str]] = {}
    for ref, listed in listings:
        try:
            addresses = listed()
        except UnsupportedVersionError as e:
            raise StoreError(f"a checkpoint of a newer format: {e.reason}", ref=ref,
                             hint="scrub with the agck version that wrote it") from None
        except (CorruptCheckpointError, FormatError):
            rep.damaged_listings.append(ref)
            continue
        if addresses is None:
            continue
        rep.listings += 1
        for a in dict.fromkeys(addresses):
            users.setdefault(a, []).append(ref)
    by_name = {name(a): a for a in users} if name is not None else {}
    seen: set[bytes] = set()
    for address, size, ref, read in stored:
        data = read()
        if data is None:          # collected while scrubbed
            continue
        if name is not None:      # a name: the address a listing gives it, or judged by its name
            stored_as, address = address, by_name.get(address)
            if address is None:
                rep.chunks += 1
                rep.bytes += memoryview(data).nbytes
                raw = _decoded(data, None)
                raw = data if raw is None else raw
                if name(chunking.address(raw)) != stored_as:
                    rep.damaged.append(Damage(stored_as.hex(), "does not match its name (listed by no "
                                                               "checkpoint)", ref, []))
                continue
        seen.add(address)
        rep.chunks += 1
        rep.bytes += memoryview(data).nbytes
        why = verdict(address, data, size)
        if why is not None:
            rep.damaged.append(Damage(address.hex(), why, ref, users.get(address, [])))
        if progress is not None:
            progress(memoryview(data).nbytes)
    for a, refs in users.items():
        if a not in seen:
            rep.missing.append(Damage(a.hex(), "missing", None, refs))
    rep.seconds = _time.monotonic() - t0
    return rep
