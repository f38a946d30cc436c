"""How a store finds its data key: its ``key`` option, the environment, its key slots.

A store is encrypted when it holds key slots (:mod:`agck.cipher`, FORMAT.md 18.6;
where a backend keeps them is its own: the file store in ``<root>/.keys/``). Opening
one needs a user key that opens a slot: the ``key`` option (a passphrase, 32 raw
bytes, a callable returning one: a KMS client), else ``$AGCK_KEY`` (a passphrase),
else ``$AGCK_KEY_FILE`` (a file holding 64 hex digits or a passphrase). An
encrypted store opened without one, or with one that opens no slot, is
:class:`~agck.errors.EncryptionKeyError`: nothing is read.

A store with no slots is not encrypted; given a key, an empty one becomes encrypted
(a new random data key, wrapped under that key in its first slot), and one that
already holds checkpoints is refused: its data would stay in the clear.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

from .. import cipher
from ..errors import (CheckpointExistsError, CorruptCheckpointError, EncryptionKeyError, UnsupportedVersionError,
                      UsageError)

log = logging.getLogger("agck")

ENV_KEY = "AGCK_KEY"
FIRST_SLOT = "00000000"     # the id of the slot that makes a store encrypted
ENV_KEY_FILE = "AGCK_KEY_FILE"


class SlotFiles(Protocol):
    """Where a backend keeps its key slots."""

    def load(self) -> "list[dict | DamagedSlot]": ...
    def save(self, slot: dict) -> None: ...
    def remove(self, slot_id: str, check: Callable[["list[dict | DamagedSlot]"], None]) -> None:
        """Remove ``slot_id`` atomically with ``check`` (called on the slots as they are
        then, under the backend's lock or in its transaction; it raises to refuse)."""


@dataclass
class DamagedSlot:
    """A key slot that cannot be read (FORMAT.md rule 18.10): garbage, a field out of
    bounds, a cost refused as hostile. The store's other slots are tried all the same."""

    id: str
    where: str
    reason: str


MAX_SLOT = 64 << 10     # not a threshold: a key slot is about 400 bytes of JSON; more is not one


def parse_slot(raw, slot_id: str, where: str) -> "dict | DamagedSlot":
    """A key slot as a backend keeps it (JSON text or bytes), checked (FORMAT.md 18.6); a
    damaged one is a :class:`DamagedSlot` naming why, never an exception: one bad slot
    does not lock the store's other keys out."""
    import json
    try:
        if len(raw) > MAX_SLOT:
            raise ValueError(f"{len(raw)} bytes, more than a key slot's {MAX_SLOT}")
        slot = cipher.check_slot(json.loads(raw))
    except RecursionError:
        return DamagedSlot(slot_id, where, "nested too deeply to be a key slot")
    except (TypeError, ValueError, UnicodeDecodeError) as e:
        return DamagedSlot(slot_id, where, f"not JSON: {e}"[:200])
    except (CorruptCheckpointError, UnsupportedVersionError) as e:
        return DamagedSlot(slot_id, where, e.reason)
    if slot["id"] != slot_id:
        return DamagedSlot(slot_id, where, f"it names itself {slot['id']!r}")
    return slot


def split_slots(found) -> tuple[list[dict], list[DamagedSlot]]:
    intact = [s for s in found if isinstance(s, dict)]
    return intact, [s for s in found if isinstance(s, DamagedSlot)]


class Inherited:
    """A data key handed by a store to a namespace of its own (its multi-rank parts),
    which keeps no slots: the store opened it from its slots. Never a user's key."""

    def __init__(self, key: cipher.DataKey):
        self.key = key


def given_key(key) -> "cipher.UserKey | Inherited | None":
    """The user key a store is opened with: ``key``, else the environment's, else None.
    A :class:`~agck.cipher.DataKey` is refused: only a key that opens one of the store's
    slots (or makes its first) may write (FORMAT.md rule 18.9)."""
    if isinstance(key, Inherited):
        return key
    if isinstance(key, cipher.DataKey):
        raise UsageError("a DataKey is not a key a store opens with: it would bypass the store's key slots",
                         hint="pass the passphrase or raw key that one of its slots was made with")
    if key is not None:
        return cipher.user_key(key)
    if os.environ.get(ENV_KEY):
        return cipher.user_key(os.environ[ENV_KEY], source=f"${ENV_KEY}")
    if os.environ.get(ENV_KEY_FILE):
        return cipher.key_from_file(os.environ[ENV_KEY_FILE])
    return None


def data_key(slots: SlotFiles, key, *, sealed_found: Callable[[], "bool | None"], where: str
             ) -> cipher.DataKey | None:
    """The store's data key (None: the store is not encrypted and no key was given).

    Whether a store is encrypted is read from its slots and, where it has none, from
    what it holds (rule 18.9): a store whose checkpoints or journal records are sealed
    and whose slots are gone (moved by a backup tool, a table renamed) is refused,
    with or without a key, and nothing is read, quarantined or written. An empty store
    given a key is made encrypted by its first write, not by its opening (rule 18.11):
    a read-only command writes nothing."""
    user = given_key(key)
    if isinstance(user, Inherited):
        return user.key
    intact, damaged = split_slots(slots.load())
    if intact or damaged:
        if user is None:
            raise EncryptionKeyError(f"the store is encrypted ({len(intact) + len(damaged)} key slot(s)) and no "
                                     "key was given", ref=where,
                                     hint=f"pass key=... to open_store, or set ${ENV_KEY} (a passphrase) "
                                          f"or ${ENV_KEY_FILE} (a key file)")
        return cipher.open_slots(intact, user, where, damaged)
    sealed = sealed_found()
    if sealed:
        raise EncryptionKeyError("the store holds sealed (encrypted) data but none of its key slots: they were "
                                 "moved, deleted or renamed away", ref=where,
                                 hint="put the key slots back (the file store's .keys directory, the SQL "
                                      "stores' <prefix>_keys table, s3's keys/ objects) from where they went or a "
                                      "backup, then open it with its key; nothing was read or changed")
    if user is None:
        return None
    if sealed is False:
        raise UsageError("a key was given for a store that holds unencrypted checkpoints: they would stay in the "
                         "clear", ref=where, hint="open it without a key, or copy its checkpoints into a new "
                                                  "encrypted store (agck export, then put)")
    new = cipher.DataKey.new()
    new._first_slot = (slots, user, where, sealed_found)   # written by the first write (commit_first_slot)
    # and before anything is sealed under it, whoever seals (a journal seals its records
    # before it appends them): never a byte sealed under a key another process replaces
    new.before_seal = lambda: commit_first_slot(new)
    return new


_FIRST_SLOT_LOCK = threading.Lock()


def commit_first_slot(key: "cipher.DataKey | None") -> None:
    """Before the first write of a store that an open made encrypted: its first slot,
    ``FIRST_SLOT``, written only if absent. Two processes making the store at once end
    with one data key, the first one's: the other adopts it (nothing was sealed under its
    own yet), or is refused if its key does not open it."""
    if key is None or getattr(key, "_first_slot", None) is None:
        return
    with _FIRST_SLOT_LOCK:
        pending = getattr(key, "_first_slot", None)
        if pending is None:
            return
        slots, user, where, sealed_found = pending
        intact, damaged = split_slots(slots.load())
        if not intact and not damaged:
            if sealed_found() is not None:      # data came in the clear since the open (a process without a key)
                raise UsageError("the store was empty when it was opened with a key, and holds checkpoints in "
                                 "the clear now: it cannot be made encrypted", ref=where,
                                 hint="write encrypted checkpoints to a new, empty store")
            try:
                slots.save(cipher.wrap(key, user, slot_id=FIRST_SLOT))
                key.slot_id, key.made_now, key._first_slot, key.before_seal = FIRST_SLOT, True, None, None
                return
            except CheckpointExistsError:
                intact, damaged = split_slots(slots.load())
        key.adopt(cipher.open_slots(intact, user, where, damaged))
        key._first_slot = key.before_seal = None


def add_key(slots: SlotFiles, current: cipher.DataKey | None, new, where: str) -> dict:
    """Wrap the store's data key under one more user key; the new slot. A key that
    already opens one of the store's slots is refused: added again, it would still open
    the store once the slot it was added for is removed (a rotation that rotates nothing)."""
    if current is None:
        raise UsageError("the store is not encrypted: it has no data key to add a key for", ref=where)
    commit_first_slot(current)
    user = cipher.user_key(new, source="the new key")
    intact, _ = split_slots(slots.load())
    for slot in intact:
        if cipher.unwrap(slot, user) is not None:
            raise UsageError(f"the new key opens the store's key slot {slot['id']} already", ref=where,
                             hint="give a key the store does not have (agck key list STORE shows its slots)")
    slot = cipher.wrap(current, user)
    slots.save(slot)
    return slot


ENV_NEW_KEY = "AGCK_NEW_KEY"


def new_key(path: str | None) -> "cipher.UserKey":
    """The key ``agck key add`` adds: a key file (``--new-key-file``), else ``$AGCK_NEW_KEY``
    (a passphrase), else a passphrase typed twice at the terminal."""
    if path:
        return cipher.key_from_file(path)
    if os.environ.get(ENV_NEW_KEY):
        return cipher.user_key(os.environ[ENV_NEW_KEY], source=f"${ENV_NEW_KEY}")
    import getpass
    import sys
    if not sys.stdin.isatty():
        raise UsageError("no new key: give --new-key-file, or set $AGCK_NEW_KEY, or run at a terminal to type one")
    first = getpass.getpass("new passphrase: ")
    if first != getpass.getpass("again: "):
        raise UsageError("the two passphrases differ; nothing was changed")
    return cipher.user_key(first, source="the terminal")


def remove_key(slots: SlotFiles | None, current: cipher.DataKey | None, slot_id: str, where: str) -> None:
    """Remove one key slot. The last intact slot of the store's data key is never
    removed (the data would be lost), and that holds under races (rule 18.12): the
    check and the removal are one step, under the backend's lock or in its transaction."""
    if not isinstance(slot_id, str):
        raise UsageError(f"a key slot id is a string of hex digits, not {type(slot_id).__name__}", ref=where)
    if slots is None or current is None or getattr(current, "_first_slot", None) is not None:
        raise UsageError("the store is not encrypted: it has no key slots", ref=where)

    def check(found) -> None:
        intact, damaged = split_slots(found)
        if slot_id not in {s["id"] for s in intact} | {d.id for d in damaged}:
            raise UsageError(f"no key slot {slot_id!r}"[:120], ref=where,
                             hint=f"the store's slots: {', '.join(s['id'] for s in intact) or 'none'}")
        if not any(s["id"] != slot_id and s["data_key"] == current.key_id for s in intact):
            raise UsageError(f"key slot {slot_id!r} is the store's last intact slot: without it nothing could be "
                             "read", ref=where, hint="add another key first (agck key add), then remove this one")
    slots.remove(slot_id, check)


class SealedObjects:
    """An encrypted store's object table as its rows hold it: each chunk under its keyed
    name (FORMAT.md 18.3), sealed (18.2, 18.4), opened on the way out (18.5). The stores
    that keep chunks in rows or objects (SQLite, Postgres) translate at their table's
    edge, so everything above it sees addresses and the bytes the store encoded."""

    def __init__(self, key: "cipher.DataKey"):
        self.key = key

    def names(self, addresses) -> dict[bytes, bytes]:
        """name -> address, for ``addresses``."""
        return {self.key.name(a): a for a in addresses}

    def sealed(self, rows) -> Iterator[tuple[bytes, int, object]]:
        """``rows`` (address, raw size, bytes to store), as the table keeps them: (name,
        raw size, sealed bytes), one at a time (a put's new chunks are not held sealed at once)."""
        for address, size, data in rows:
            name = self.key.name(address)
            yield name, size, self.key.seal(cipher.Kind.CHUNK, cipher.chunk_context(name), data)

    def opened(self, found: dict, names: dict[bytes, bytes], *, quiet: bool = False) -> dict:
        """``found`` (name -> stored bytes) keyed by address, each opened. One that does
        not open stays sealed: 48 bytes longer than what was stored, it is judged damaged
        by its address like any chunk of the wrong size, and quarantined by that address."""
        out = {}
        for name, data in found.items():
            address = names.get(bytes(name))
            if address is None:
                continue
            try:
                out[address] = self.key.open(cipher.Kind.CHUNK, cipher.chunk_context(bytes(name)), data,
                                             what="a chunk")
            except (UnsupportedVersionError, CorruptCheckpointError) as e:
                if not quiet:     # scrub reports it; a read says it here, then judges it damaged
                    log.warning("chunk %s (stored as %s) %s", address.hex()[:16], bytes(name).hex()[:16], e.reason)
                out[address] = data
        return out

    @staticmethod
    def by_address(found: dict, names: dict[bytes, bytes]) -> dict:
        """``found`` (name -> stored bytes) keyed by address, still sealed (:meth:`found_into` opens them)."""
        return {names[bytes(n)]: d for n, d in found.items() if bytes(n) in names}

    def found_into(self, found: dict):
        """A ``fetch_into`` for :func:`agck.stores.content.decode` over sealed chunks
        already read (``found``: address -> sealed bytes): each opened straight into its
        place, on the reading threads, with no copy. One that does not open is reported
        one byte longer than its place, so it is judged damaged by its address."""
        def into(address: bytes, view: memoryview) -> int | None:
            data = found.get(address)
            if data is None:
                return None
            n = memoryview(data).nbytes - cipher.OVERHEAD
            if 0 < n <= view.nbytes:
                try:
                    self.key.open(cipher.Kind.CHUNK, cipher.chunk_context(self.key.name(address)), data,
                                  what="a chunk", out=view[:n])
                    return n
                except (UnsupportedVersionError, CorruptCheckpointError) as e:
                    log.warning("chunk %s %s", address.hex()[:16], e.reason)
            return view.nbytes + 1

        return into

    def sizes(self, stored: dict[bytes, int | None], names: dict[bytes, bytes]) -> dict[bytes, int | None]:
        """Stored sizes by name -> the sizes sealed, by address (a sealed chunk is 48 bytes longer)."""
        return {names[bytes(n)]: (None if k is None else k - cipher.OVERHEAD) for n, k in stored.items()
                if bytes(n) in names}


def check_seal_meta(seal_meta, given) -> bool:
    """``seal_meta``: whether an encrypted store leaves its ``meta`` column empty, so that
    ``meta`` is kept only inside the sealed listing (then not queryable: ``list()`` and
    SQL see None; ``read().meta`` is exact). Without it the column holds meta's JSON in
    the clear, as the store's run names, steps, sizes and times are."""
    if not isinstance(seal_meta, bool):
        raise UsageError(f"seal_meta must be True or False, not {seal_meta!r}")
    if seal_meta and given is None:
        raise UsageError("seal_meta=True seals meta under the store's key, and no key was given",
                         hint="pass key=... (or set $AGCK_KEY), or leave seal_meta out")
    return seal_meta


def slot_json(slot: dict) -> str:
    import json
    return json.dumps(slot, sort_keys=True)
