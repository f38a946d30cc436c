"""A file store's key slots: ``<root>/.keys/<slot id>.json``, one JSON key slot each
(FORMAT.md 18.6). Written whole (temp file, fsync, rename, fsync of the directory),
removed with an fsync of the directory; nothing in them is secret."""

from __future__ import annotations

import json
import os

from ... import cipher, durable
from ...errors import DurabilityError, StoreError

DIRNAME = ".keys"


class KeySlots:
    def __init__(self, root: str, fs: durable.FileSystem):
        self.root, self.fs = root, fs
        self.dir = os.path.join(root, DIRNAME)

    def _path(self, slot_id: str) -> str:
        if not slot_id or not all(c in "0123456789abcdef" for c in slot_id):
            raise StoreError(f"a key slot id must be hex digits, not {slot_id!r}", ref=self.dir)
        return os.path.join(self.dir, f"{slot_id}.json")

    def load(self) -> list[dict]:
        try:
            names = sorted(n for n in os.listdir(self.dir) if n.endswith(".json"))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise StoreError(f"cannot list the key slots: {e.strerror}", ref=self.dir) from None
        out = []
        for n in names:
            path = os.path.join(self.dir, n)
            try:
                with open(path, "rb") as f:
                    slot = json.loads(f.read(1 << 16))
            except (OSError, ValueError) as e:
                raise StoreError(f"cannot read a key slot: {e}", ref=path,
                                 hint="restore the file from a backup; the other slots may still open the store") \
                    from None
            out.append(cipher.check_slot(slot))
        return out

    def save(self, slot: dict) -> None:
        durable.make_dir(self.fs, self.dir, self.root, "key slot directory")
        data = json.dumps(slot, sort_keys=True, indent=1).encode()
        durable.write_atomic(self._path(slot["id"]), [data], overwrite=False, size=len(data), fs=self.fs)

    def remove(self, slot_id: str) -> None:
        path = self._path(slot_id)
        try:
            self.fs.unlink(path)
            self.fs.fsync_dir(self.dir)
        except OSError as e:
            raise DurabilityError(f"cannot remove a key slot: {e.strerror}", ref=path) from None
