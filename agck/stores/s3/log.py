"""A run's commit log on an object store: records, their bytes, and what they add up to.

An object store has no transactions and no locks; it has create-only puts
(``If-None-Match: *``). So every change to a run (a checkpoint committed, steps
deleted, an epoch begun) is one *record*, created at the next free sequence
number of the run's log (``runs/<run>/log/<seq>``). Two writers racing for
the same number cannot both succeed: the loser reads what won and decides
again (a stale epoch, a step that now exists). A record is never replaced or
deleted while its run lives, so a run's state is the fold of its records in
order (STORAGE.md, "Object stores").

A record's bytes: ``AGCKLOG1``, the msgpack map's length (u32, little
endian), the map, XXH3-64 (little endian) of all that, and then, for a small
checkpoint kept in its record, the container's bytes, which the map's ``size``
and ``xxh3`` check. So damage to those bytes leaves the record readable: the
step is still listed, and fails verification like any damaged checkpoint.
Pure: bytes in, values out.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Iterable

import msgpack
import xxhash

from ... import thresholds
from ...errors import CorruptCheckpointError

MAGIC = b"AGCKLOG1"
SNAP_MAGIC = b"AGCKSNP1"
SEQ_DIGITS = 20
INLINE_MAX = thresholds.INLINE_RECORD     # a container this small is kept in its record: one request per put


def seq_name(seq: int) -> str:
    return f"{seq:0{SEQ_DIGITS}d}"


def parse_seq(name: str) -> int | None:
    return int(name) if len(name) == SEQ_DIGITS and name.isdigit() else None


def _frame(magic: bytes, value: dict, tail: bytes = b"") -> bytes:
    packed = msgpack.packb(value, use_bin_type=True)
    body = magic + struct.pack("<I", len(packed)) + packed
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body)) + tail


def _unframe(magic: bytes, data, ref: str) -> tuple[dict, memoryview]:
    """The map and the bytes after it."""
    v = memoryview(data).cast("B")
    head = len(magic) + 4
    if v.nbytes < head + 8 or bytes(v[:len(magic)]) != magic:
        raise CorruptCheckpointError(f"not an agck {magic[:-1].decode()} object", ref=ref, section="log")
    n = struct.unpack("<I", v[len(magic):head])[0]
    end = head + n
    if end + 8 > v.nbytes or struct.unpack("<Q", v[end:end + 8])[0] != xxhash.xxh3_64_intdigest(v[:end]):
        raise CorruptCheckpointError("its checksum does not match its bytes", ref=ref, section="log")
    try:
        value = msgpack.unpackb(v[head:end], raw=False, strict_map_key=False)
    except Exception as e:   # any malformed msgpack: checksummed garbage from another writer
        raise CorruptCheckpointError(f"undecodable ({type(e).__name__})", ref=ref, section="log") from None
    if not isinstance(value, dict):
        raise CorruptCheckpointError("not a map", ref=ref, section="log")
    return value, v[end + 8:]


def encode_record(record: dict, inline: bytes = b"") -> bytes:
    """A record, and the container it holds inline (its ``size`` and ``xxh3`` describe it)."""
    return _frame(MAGIC, dict(record, inline=bool(inline)) if inline else record, inline)


def record_inline(data, ref: str) -> memoryview:
    """The container bytes a record holds inline (checked by the caller against its map)."""
    return _unframe(MAGIC, data, ref)[1]


def decode_record(data, ref: str) -> dict:
    r, _ = _unframe(MAGIC, data, ref)
    op = r.get("op")
    ok = {"put": ("step", "size", "xxh3"), "delete": ("steps",), "epoch": ("epoch",)}.get(op)
    if ok is None or any(k not in r for k in ok):
        raise CorruptCheckpointError(f"a record of unknown kind or missing fields ({op!r})", ref=ref, section="log")
    return r


@dataclass
class Entry:
    """A committed checkpoint: the record that put it."""

    step: int
    seq: int
    size: int                     # bytes of the stored container (a listing for a chunked one)
    xxh3: int                     # XXH3-64 of those bytes
    key: str | None = None        # the data object holding them; None: they follow the record itself
    created_at: float | None = None
    parent: int | None = None
    length: int | None = None     # the checkpoint's own size (a chunked one's content)
    epoch: int | None = None


@dataclass
class RunState:
    """A run as its records up to ``seq`` say."""

    seq: int = -1                 # the last record folded in
    epoch: int | None = None
    steps: dict[int, Entry] = field(default_factory=dict)
    damaged: list[int] = field(default_factory=list)    # sequence numbers of records that failed their checksum

    def apply(self, seq: int, r: dict | None) -> None:
        """Fold in record ``seq`` (None: a damaged one, skipped and remembered)."""
        self.seq = seq
        if r is None:
            self.damaged.append(seq)
            return
        op = r["op"]
        if op == "put":
            self.steps[r["step"]] = Entry(step=r["step"], seq=seq, size=r["size"], xxh3=r["xxh3"], key=r.get("key"),
                                          created_at=r.get("created_at"), parent=r.get("parent"),
                                          length=r.get("length"), epoch=r.get("epoch"))
        elif op == "delete":
            for s in r["steps"]:
                self.steps.pop(s, None)
        elif op == "epoch":
            self.epoch = r["epoch"]

    def copy(self) -> "RunState":
        return RunState(self.seq, self.epoch, dict(self.steps), list(self.damaged))

    # -- snapshots: the fold at one sequence number, so an open reads few records ----------------
    def encode(self) -> bytes:
        return _frame(SNAP_MAGIC, {"seq": self.seq, "epoch": self.epoch, "damaged": self.damaged,
                                   "steps": [[e.step, e.seq, e.size, e.xxh3, e.key, e.created_at, e.parent,
                                              e.length, e.epoch] for e in self.steps.values()]})

    @classmethod
    def decode(cls, data, ref: str) -> "RunState":
        v, _ = _unframe(SNAP_MAGIC, data, ref)
        try:
            st = cls(v["seq"], v["epoch"], {}, list(v["damaged"]))
            for row in v["steps"]:
                e = Entry(*row)
                st.steps[e.step] = e
        except (KeyError, TypeError) as e:
            raise CorruptCheckpointError(f"a snapshot missing fields ({e})", ref=ref, section="log") from None
        return st


def snapshot_every(live_steps: int) -> int:
    """Records between two snapshots of a run's fold: at least 64, and more as the run
    holds more steps, so writing snapshots costs a bounded share of the commits
    (a snapshot of N steps every N/64 records) while an open reads at most that many."""
    return max(64, live_steps // 64)


def fold(base: RunState, records: Iterable[tuple[int, Any]]) -> RunState:
    st = base.copy()
    for seq, r in records:
        st.apply(seq, r)
    return st
