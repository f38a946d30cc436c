"""A file store's key slots: ``<root>/.keys/<slot id>.json``, one JSON key slot each
(FORMAT.md 18.6). Written whole (temp file, fsync, rename, fsync of the directory),
removed with an fsync of the directory; nothing in them is secret. A removal holds
``<root>/.keys.lock`` (flock) from its check to its unlink (rule 18.12): two processes removing
each other's slot cannot both succeed."""

from __future__ import annotations

import fcntl
import os
import stat

from ... import durable
from ...errors import DurabilityError, StoreError
from .. import encryption

DIRNAME = ".keys"
LOCK_NAME = ".keys.lock"     # beside .keys: a backup of .keys takes only slots


class KeySlots:
    def __init__(self, root: str, fs: durable.FileSystem):
        self.root, self.fs = root, fs
        self.dir = os.path.join(root, DIRNAME)

    def _path(self, slot_id: str) -> str:
        if not slot_id or not all(c in "0123456789abcdef" for c in slot_id):
            raise StoreError(f"a key slot id must be hex digits, not {slot_id!r}"[:120], ref=self.dir)
        return os.path.join(self.dir, f"{slot_id}.json")

    def load(self) -> "list[dict | encryption.DamagedSlot]":
        try:
            names = sorted(n for n in os.listdir(self.dir) if n.endswith(".json"))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise StoreError(f"cannot list the key slots: {e.strerror}", ref=self.dir) from None
        out = []
        for n in names:
            path, slot_id = os.path.join(self.dir, n), n[:-len(".json")]
            try:
                # never blocks (a FIFO planted here), never reads more than a slot can be
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
                try:
                    st = os.fstat(fd)
                    if not stat.S_ISREG(st.st_mode):
                        out.append(encryption.DamagedSlot(slot_id, path, "not a regular file"))
                        continue
                    with os.fdopen(fd, "rb", closefd=False) as f:
                        raw = f.read(encryption.MAX_SLOT + 1)
                finally:
                    os.close(fd)
            except FileNotFoundError:      # removed between the listing and here
                continue
            except OSError as e:
                out.append(encryption.DamagedSlot(slot_id, path, f"cannot be read: {e.strerror}"))
                continue
            out.append(encryption.parse_slot(raw, slot_id, path))
        return out

    def save(self, slot: dict) -> None:
        import json
        durable.make_dir(self.fs, self.dir, self.root, "key slot directory")
        data = json.dumps(slot, sort_keys=True, indent=1).encode()
        durable.write_atomic(self._path(slot["id"]), [data], overwrite=False, size=len(data), fs=self.fs)

    def remove(self, slot_id: str, check) -> None:
        path = self._path(slot_id)
        try:
            fd = os.open(os.path.join(self.root, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise DurabilityError(f"cannot lock the key slots: {e.strerror}", ref=self.dir) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)      # released by the kernel if this process dies
            check(self.load())
            try:
                self.fs.unlink(path)
                self.fs.fsync_dir(self.dir)
            except OSError as e:
                raise DurabilityError(f"cannot remove a key slot: {e.strerror}", ref=path) from None
        finally:
            os.close(fd)
