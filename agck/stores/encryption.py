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

    def load(self) -> list[dict]: ...
    def save(self, slot: dict) -> None: ...
    def remove(self, slot_id: str) -> None: ...


def given_key(key) -> "cipher.UserKey | cipher.DataKey | None":
    """The user key a store is opened with: ``key`` (a DataKey passes through: a store's
    parts namespace shares its data key), else the environment's, else None."""
    if isinstance(key, cipher.DataKey):
        return key
    if key is not None:
        return cipher.user_key(key)
    if os.environ.get(ENV_KEY):
        return cipher.user_key(os.environ[ENV_KEY], source=f"${ENV_KEY}")
    if os.environ.get(ENV_KEY_FILE):
        return cipher.key_from_file(os.environ[ENV_KEY_FILE])
    return None


def data_key(slots: SlotFiles, key, *, empty: Callable[[], bool], where: str) -> cipher.DataKey | None:
    """The store's data key (None: the store is not encrypted and no key was given)."""
    user = given_key(key)
    found = slots.load()
    if isinstance(user, cipher.DataKey):
        return user
    if found:
        if user is None:
            raise EncryptionKeyError(f"the store is encrypted ({len(found)} key slot(s)) and no key was given",
                                     ref=where, hint=f"pass key=... to open_store, or set ${ENV_KEY} (a passphrase) "
                                                     f"or ${ENV_KEY_FILE} (a key file)")
        return cipher.open_slots(found, user, where)[0]
    if user is None:
        return None
    if not empty():
        raise UsageError("a key was given for a store that holds unencrypted checkpoints: they would stay in the "
                         "clear", ref=where, hint="open it without a key, or copy its checkpoints into a new "
                                                  "encrypted store (agck export, then put)")
    # the first slot has a fixed id and is written only if absent: two processes making the
    # store at once (the ranks of a job) end with one data key, the first one's
    new = cipher.DataKey.new()
    slot = cipher.wrap(new, user, slot_id=FIRST_SLOT)
    try:
        slots.save(slot)
    except CheckpointExistsError:
        return cipher.open_slots(slots.load(), user, where)[0]
    new.slot_id, new.made_now = slot["id"], True
    return new


def add_key(slots: SlotFiles, current: cipher.DataKey | None, new, where: str) -> dict:
    """Wrap the store's data key under one more user key; the new slot."""
    if current is None:
        raise UsageError("the store is not encrypted: it has no data key to add a key for", ref=where)
    slot = cipher.wrap(current, cipher.user_key(new, source="the new key"))
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


def remove_key(slots: SlotFiles, current: cipher.DataKey | None, slot_id: str, where: str) -> None:
    """Remove one key slot; the last one is never removed (the data would be lost)."""
    found = slots.load() if slots is not None and current is not None else []
    if not found:
        raise UsageError("the store is not encrypted: it has no key slots", ref=where)
    if not isinstance(slot_id, str):
        raise UsageError(f"a key slot id is a string of hex digits, not {type(slot_id).__name__}", ref=where)
    if slot_id not in {s["id"] for s in found}:
        raise UsageError(f"no key slot {slot_id!r}", ref=where,
                         hint=f"the store's slots: {', '.join(s['id'] for s in found)}")
    if len(found) == 1:
        raise UsageError(f"key slot {slot_id!r} is the store's last: without it nothing could be read", ref=where,
                         hint="add another key first (store.add_key), then remove this one")
    slots.remove(slot_id)


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
    return seal_meta


def slot_json(slot: dict) -> str:
    import json
    return json.dumps(slot, sort_keys=True)


def slot_from_json(text, where: str) -> dict:
    """A key slot kept as JSON text (a row, an object), checked (FORMAT.md 18.6)."""
    import json
    try:
        slot = json.loads(text)
    except (TypeError, ValueError) as e:
        from ..errors import StoreError
        raise StoreError(f"cannot read a key slot: {e}", ref=where,
                         hint="restore it from a backup; the other slots may still open the store") from None
    return cipher.check_slot(slot)
