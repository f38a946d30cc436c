"""Encryption at rest: the sealed object, the keyed chunk name, and the key slots that
wrap a store's data key (FORMAT.md section 18).

Pure: bytes in, bytes out; no I/O, and nothing about stores. A store that encrypts
(:mod:`agck.stores`) holds one random 256-bit **data key**. From it come, by BLAKE3's
key derivation, an AEAD key and a name key:

- every object the store writes (a chunk, a container) is **sealed**: AES-256-GCM
  under a key of its own, derived from the AEAD key and 24 random bytes kept in the
  object's header (so no two objects share a key and nonce, however many a store
  writes), with the header and the object's *context* (a chunk's name, a
  container's run and step) as associated data. Opening checks the tag before
  anything is decoded: a flipped byte, a truncation, an object moved to another
  name or step, or one sealed under another data key is refused the same way;
- a chunk is stored under its **name**, ``BLAKE3-256(address, key=name key)``, not
  its address: equal content still has one name in the store (deduplication), and
  nobody without the key can compute the name of a known file to test for it.

The data key is stored only **wrapped**, in key slots: AES-256-GCM under a key
derived from a user key (a passphrase through scrypt, or a raw 256-bit key through
BLAKE3). Several slots may wrap the same data key, so keys are added, removed and
rotated without touching any data. Losing every user key loses the data: nothing
else can unwrap the data key.

The sealed object, version 1 (every integer little-endian; 32 bytes, then the
ciphertext and its 16-byte tag):

====== ====== ==================================================================
offset size   field
====== ====== ==================================================================
0      4      magic ``b"AGCE"``
4      1      version: 1 (a larger one is a newer format: UnsupportedVersionError)
5      1      algorithm: 1 = AES-256-GCM with a per-object key
6      1      kind: 1 a chunk, 2 a container, 3 a journal record batch
7      1      reserved: 0
8      24     salt: random; the object's key is BLAKE3(salt, key=AEAD key), 32 bytes
32     n+16   the ciphertext of the n plaintext bytes, then the GCM tag; the nonce
              is 12 zero bytes (each key seals one object), the associated data
              the 32 header bytes followed by the object's context
====== ====== ==================================================================
"""

from __future__ import annotations

import base64
import json
import numbers
import os
import struct
import time
from dataclasses import dataclass

import blake3
import numpy as np

from .errors import AgckError, CorruptCheckpointError, EncryptionKeyError, UnsupportedVersionError, UsageError

MAGIC = b"AGCE"
VERSION = 1
ALG_AES256GCM = 1
HEADER = struct.Struct("<4sBBBB24s")
HEADER_SIZE = HEADER.size          # 32
TAG_SIZE = 16
OVERHEAD = HEADER_SIZE + TAG_SIZE  # 48 bytes per sealed object
KEY_SIZE = 32
_NONCE = bytes(12)                 # every object has a key of its own (its salt): the nonce may be fixed
_PAGE = 4096                       # not a threshold: the alignment O_DIRECT writes want
_ALIGNED_MIN = 64 << 10            # not a threshold: smaller sealed objects are plain bytes (no direct write)


class Kind:
    """What a sealed object is (its header's kind byte)."""
    CHUNK = 1
    CONTAINER = 2
    RECORDS = 3


KINDS = {Kind.CHUNK: "chunk", Kind.CONTAINER: "container", Kind.RECORDS: "journal records"}

# BLAKE3 key-derivation contexts (FORMAT.md 18.1): one per use of the data key
AEAD_CONTEXT = "agck 2026-12 sealed objects v1"
NAME_CONTEXT = "agck 2026-12 chunk names v1"
JOURNAL_KEY_CONTEXT = "agck 2026-12 journal keys v1"
RAW_KEY_CONTEXT = "agck 2026-12 raw user key v1"

# scrypt for passphrases (FORMAT.md 18.6): 2^15 x 8 costs 32 MiB and about 0.1 s here
SCRYPT_N, SCRYPT_R, SCRYPT_P = 1 << 15, 8, 1   # not a threshold: the scrypt cost parameters
# what a key slot may ask of scrypt before anything is derived (FORMAT.md 18.6): a slot is
# not secret and anyone who can write the store can plant one, so its cost is bounded:
# memory 128·n·r at most 256 MiB (0.7 s here) and work 128·n·r·p at most 1 GiB (about 3 s)
MAX_SCRYPT_MEMORY = 256 << 20    # not a threshold: a bound on a slot's scrypt memory
MAX_SCRYPT_WORK = 1 << 30        # not a threshold: a bound on a slot's scrypt work
MAX_KEY_FILE = 64 << 10          # not a threshold: a key file is 64 hex digits or a passphrase, never larger


def _aesgcm():
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError as e:     # pragma: no cover - a dependency of agck
        from .errors import DependencyError
        raise DependencyError(f"encryption needs the cryptography package ({e})",
                              hint="pip install cryptography") from None
    return AESGCM


def derive(data_key: bytes, context: str) -> bytes:
    """A 256-bit key for one use of ``data_key`` (BLAKE3's derive_key mode, FORMAT.md 18.1)."""
    return blake3.blake3(data_key, derive_key_context=context).digest()


def _bytes(data, what: str) -> memoryview:
    try:
        view = memoryview(data)
    except TypeError:
        raise UsageError(f"{what} must be a bytes-like object, not {type(data).__name__}") from None
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class DataKey:
    """A store's data key, and what is derived from it. ``key_id``: the 8 hex digits
    naming it in messages (its BLAKE3 hash's first bytes; says nothing of the key)."""

    def __init__(self, data_key: bytes):
        if not isinstance(data_key, (bytes, bytearray)) or len(data_key) != KEY_SIZE:
            raise UsageError(f"a data key is {KEY_SIZE} bytes")
        self._key = bytes(data_key)
        self._aead = derive(self._key, AEAD_CONTEXT)
        self._names = derive(self._key, NAME_CONTEXT)
        self._journal = derive(self._key, JOURNAL_KEY_CONTEXT)
        # names the data key in its slots and in messages (64 bits of a one-way derivation: says nothing of it)
        self.key_id = blake3.blake3(self._key, derive_key_context="agck 2026-12 key id v1").hexdigest()[:16]
        self.slot_id: str | None = None      # the key slot this data key was opened from, if any
        self.made_now = False                # made by this store object: the store became encrypted now
        self.before_seal = None              # called before the first seal (a store's first slot: rule 18.11)

    def adopt(self, other: "DataKey") -> None:
        """Become ``other``, in place (a store's first key, made by another process while
        this one sealed nothing yet: everything that holds this object sees the change)."""
        self.__dict__.update(other.__dict__)

    @classmethod
    def new(cls) -> "DataKey":
        return cls(os.urandom(KEY_SIZE))

    def raw(self) -> bytes:
        """The key itself (for wrapping into a slot; never written anywhere else)."""
        return self._key

    def _ready(self) -> None:
        """Before the key is first used to write (a seal, a name, a journal key): its
        ``before_seal`` hook (a store's first key slot, rule 18.11), once."""
        hook = self.before_seal
        if hook is not None:
            hook()

    def name(self, address: bytes) -> bytes:
        """The name a chunk is stored under: BLAKE3-256 of its address, keyed (FORMAT.md 18.3)."""
        self._ready()
        return blake3.blake3(address, key=self._names).digest()

    def journal_key(self, fingerprint: bytes) -> bytes:
        """The key a journal record is stored under: the 16-byte fingerprint of a step's
        inputs, keyed (FORMAT.md 18.8): nobody without the key can test which inputs ran."""
        self._ready()
        return blake3.blake3(fingerprint, key=self._journal).digest(16)

    def seal(self, kind: int, context: bytes, plaintext, *, salt: bytes | None = None, into=None) -> bytes:
        """The sealed object holding ``plaintext`` (FORMAT.md 18.2). ``salt``: for a test
        vector only; each object gets fresh random bytes otherwise. ``into``: a writable
        buffer of at least ``len(plaintext) + OVERHEAD`` bytes to seal into (a writer's
        reused page-aligned memory); the sealed object is returned as a view of it."""
        self._ready()
        salt = os.urandom(24) if salt is None else salt
        if len(salt) != 24:
            raise UsageError("a salt is 24 bytes")
        head = HEADER.pack(MAGIC, VERSION, ALG_AES256GCM, kind, 0, salt)
        key = blake3.blake3(salt, key=self._aead).digest()
        view = _bytes(plaintext, "plaintext")
        total = HEADER_SIZE + view.nbytes + TAG_SIZE
        if into is not None:
            out = memoryview(into).cast("B")[:total]
            if out.nbytes != total or out.readonly:
                raise UsageError(f"into= must be a writable buffer of at least {total} bytes")
        elif total < _ALIGNED_MIN:
            out = memoryview(bytearray(total))
        else:
            # sealed in place, into page-aligned memory: a store's O_DIRECT write then takes it
            # straight from there, with no bounce copy (agck.durable)
            raw = np.empty(total + _PAGE, np.uint8)
            start = -raw.ctypes.data % _PAGE
            out = memoryview(raw[start:start + total])
        out[:HEADER_SIZE] = head
        _aesgcm()(key).encrypt_into(_NONCE, view, head + bytes(context), out[HEADER_SIZE:])
        return bytes(out) if total < _ALIGNED_MIN and into is None else out

    def open(self, kind: int, context: bytes, stored, *, what: str = "an object", out=None):
        """The plaintext of a sealed object, its tag checked first (FORMAT.md 18.5). Damage, tampering, an
        object moved to another context or sealed under another key: CorruptCheckpointError
        (a verdict on the object: the tag says only that it is not what was sealed here).
        ``out``: a writable buffer of exactly the plaintext's size to open into (no copy);
        the plaintext is returned in it."""
        view = _bytes(stored, "stored")
        if view.nbytes < OVERHEAD:
            raise CorruptCheckpointError(f"{what} of {view.nbytes} bytes is shorter than a sealed object's "
                                         f"{OVERHEAD} bytes of header and tag", section="sealed")
        magic, version, alg, got_kind, reserved, salt = HEADER.unpack_from(view)
        if magic != MAGIC:
            raise CorruptCheckpointError(f"{what} is not a sealed object (it starts with {bytes(magic)!r})",
                                         section="sealed")
        if version > VERSION or (version == VERSION and alg != ALG_AES256GCM):
            raise UnsupportedVersionError(f"{what} is sealed with version {version}, algorithm {alg}; this agck "
                                          f"opens version {VERSION}, algorithm {ALG_AES256GCM}",
                                          hint="upgrade agck to read data written by a newer one")
        if version == 0 or got_kind != kind or reserved:
            raise CorruptCheckpointError(f"{what}'s sealed header is not one of a {KINDS.get(kind, kind)} "
                                         f"(version {version}, kind {got_kind}, reserved {reserved})",
                                         section="sealed")
        key = blake3.blake3(salt, key=self._aead).digest()
        head = bytes(view[:HEADER_SIZE])
        n = view.nbytes - OVERHEAD
        if out is None or memoryview(out).nbytes != n:
            out = bytearray(n)
        try:
            _aesgcm()(key).decrypt_into(_NONCE, view[HEADER_SIZE:], head + bytes(context), out)
            return out
        except Exception as e:   # cryptography's InvalidTag: the one answer for every kind of mismatch
            if type(e).__name__ != "InvalidTag":
                raise
            raise CorruptCheckpointError(f"{what} does not open: its tag does not match (damaged, tampered "
                                         "with, moved from elsewhere, or sealed under another data key)",
                                         section="sealed") from None


def chunk_context(name: bytes) -> bytes:
    """A chunk's associated data: its name (FORMAT.md 18.4): a chunk moved to another name does not open."""
    return b"chunk\x00" + name


def container_context(run: str, step: int) -> bytes:
    """A container's associated data: its run and step (FORMAT.md 18.4)."""
    return b"container\x00" + run.encode("utf-8", "surrogatepass") + b"\x00" + struct.pack("<Q", step)


def record_context(kind: str, name: str, key: bytes, index: int) -> bytes:
    """A journal record's associated data: its kind, name, key and index (FORMAT.md 18.8):
    a value moved to another record does not open."""
    return (b"record\x00" + kind.encode() + b"\x00" + name.encode("utf-8", "surrogatepass") + b"\x00" + key
            + struct.pack("<Q", index))


# -- user keys and key slots ----------------------------------------------------------------

@dataclass(frozen=True)
class UserKey:
    """A key that opens a store's key slots: a passphrase (``kind`` "passphrase") or 32
    random bytes (``kind`` "raw"). ``source`` says where it came from, for messages (never
    the key itself)."""

    secret: bytes
    kind: str
    source: str

    def __repr__(self) -> str:
        return f"UserKey({self.kind} from {self.source})"


def user_key(key, *, source: str = "the key= argument", _called: bool = False) -> UserKey:
    """A :class:`UserKey` from what a user passes: a str (a passphrase), 32 bytes (a raw
    key), a UserKey, or a callable returning one of these (a KMS client)."""
    if isinstance(key, UserKey):
        return key
    if callable(key):
        if _called:
            raise UsageError(f"the key callable from {source} returned another callable ({type(key).__name__}), "
                             "not a key", hint="return a passphrase (str) or 32 raw bytes from the callable")
        try:
            got = key()
        except AgckError:
            raise
        except Exception as e:
            # its message is not echoed: a provider's error may hold the secret it was handling
            raise EncryptionKeyError(f"the key callable from {source} failed with {type(e).__name__}",
                                     hint="fix the key provider (a KMS client) and open the store again; its "
                                          "message is not shown, as it may hold key material") from None
        return user_key(got, source=f"{source} (a callable)", _called=True)
    if isinstance(key, str):
        if not key:
            raise UsageError(f"an empty passphrase from {source}", hint="pass a passphrase of 12 characters or more")
        return UserKey(key.encode("utf-8", "surrogatepass"), "passphrase", source)
    if isinstance(key, (bytes, bytearray)):
        if len(key) != KEY_SIZE:
            raise UsageError(f"a raw key from {source} is {len(key)} bytes, not {KEY_SIZE}",
                             hint="pass 32 random bytes (os.urandom(32)), or a passphrase as a str")
        return UserKey(bytes(key), "raw", source)
    raise UsageError(f"a key must be a passphrase (str), 32 raw bytes, or a callable returning one, not "
                     f"{type(key).__name__}")


def key_from_file(path) -> UserKey:
    """A user key kept in a file: 64 hex digits (a raw key) or, failing that, a passphrase
    (its text, without the trailing newline)."""
    import stat
    try:
        # opened without blocking (a FIFO in its place would wait for a writer forever), then
        # refused unless it is a regular file of at most MAX_KEY_FILE bytes (never cut short)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise EncryptionKeyError("the key file is not a regular file (a FIFO, a device or a directory)",
                                         ref=os.fspath(path), hint="keep the key in a plain file")
            if st.st_size > MAX_KEY_FILE:
                raise EncryptionKeyError(f"the key file is {st.st_size} bytes: a key file holds 64 hex digits or "
                                         f"a passphrase, at most {MAX_KEY_FILE} bytes", ref=os.fspath(path),
                                         hint="check the path: is this the key file?")
            with os.fdopen(fd, "rb", closefd=False) as f:
                text = f.read(MAX_KEY_FILE + 1)
        finally:
            os.close(fd)
    except OSError as e:
        raise EncryptionKeyError(f"cannot read the key file: {e.strerror}", ref=os.fspath(path)) from None
    if len(text) > MAX_KEY_FILE:
        raise EncryptionKeyError(f"the key file grew past {MAX_KEY_FILE} bytes while it was read",
                                 ref=os.fspath(path))
    text = text.rstrip(b"\r\n")
    try:
        raw = bytes.fromhex(text.decode("ascii"))
        if len(raw) == KEY_SIZE:
            return UserKey(raw, "raw", f"the key file {os.fspath(path)}")
    except (UnicodeDecodeError, ValueError):
        pass
    return user_key(text.decode("utf-8", "surrogateescape"), source=f"the key file {os.fspath(path)}")


def _kek(user: UserKey, kdf: dict) -> bytes:
    """The key that wraps the data key in a slot, from the user key and the slot's KDF."""
    if kdf.get("name") == "scrypt":
        from cryptography.hazmat.primitives.kdf.scrypt import Scrypt
        return Scrypt(salt=bytes.fromhex(kdf["salt"]), length=KEY_SIZE, n=kdf["n"], r=kdf["r"],
                      p=kdf["p"]).derive(user.secret)
    return blake3.blake3(user.secret, derive_key_context=RAW_KEY_CONTEXT).digest()


def _slot_aad(slot: dict) -> bytes:
    return json.dumps({k: slot[k] for k in ("agck_key_slot", "id", "kind", "kdf", "created", "data_key")},
                      sort_keys=True, separators=(",", ":")).encode()


def wrap(data_key: DataKey, user: UserKey, *, slot_id: str | None = None, created: float | None = None,
         kdf_salt: bytes | None = None, nonce: bytes | None = None) -> dict:
    """A key slot (FORMAT.md 18.6): ``data_key`` wrapped under ``user``. The slot is JSON
    text once dumped; it holds nothing secret."""
    if user.kind == "passphrase":
        kdf = {"name": "scrypt", "n": SCRYPT_N, "r": SCRYPT_R, "p": SCRYPT_P,
               "salt": (kdf_salt or os.urandom(16)).hex()}
    else:
        kdf = {"name": "blake3"}
    slot = {"agck_key_slot": 1, "id": slot_id or os.urandom(4).hex(), "kind": user.kind, "kdf": kdf,
            "created": round(time.time() if created is None else created, 3), "data_key": data_key.key_id}
    nonce = nonce or os.urandom(12)
    wrapped = _aesgcm()(_kek(user, kdf)).encrypt(nonce, data_key.raw(), _slot_aad(slot))
    slot["nonce"] = nonce.hex()
    slot["wrapped"] = base64.b64encode(wrapped).decode()
    return slot


def check_slot(slot) -> dict:
    """A key slot read from a store, its fields checked (FORMAT.md 18.6); else
    CorruptCheckpointError (a slot is not a verdict on any checkpoint, but it is damaged)."""
    def bad(why: str):
        return CorruptCheckpointError(f"a key slot is damaged: {why}", section="key slot")
    if not isinstance(slot, dict) or slot.get("agck_key_slot") != 1:
        if isinstance(slot, dict) and isinstance(slot.get("agck_key_slot"), int) and slot["agck_key_slot"] > 1:
            raise UnsupportedVersionError(f"a key slot of version {slot['agck_key_slot']}",
                                          hint="upgrade agck to open this store")
        raise bad("not a version 1 key slot")
    if not isinstance(slot.get("id"), str) or not 1 <= len(slot["id"]) <= 64 or \
            not all(c in "0123456789abcdef" for c in slot["id"]):
        raise bad("no id of 1 to 64 hex digits")
    if slot.get("kind") not in ("passphrase", "raw") or not isinstance(slot.get("created"), numbers.Real):
        raise bad("no kind or creation time")
    if not isinstance(slot.get("data_key"), str) or len(slot["data_key"]) != 16:
        raise bad("no data key id")
    kdf = slot.get("kdf")
    if not isinstance(kdf, dict) or kdf.get("name") not in ("scrypt", "blake3") or \
            (kdf["name"] == "scrypt") != (slot["kind"] == "passphrase"):
        raise bad("an unknown key derivation")
    if kdf["name"] == "scrypt":
        n, r, p = kdf.get("n"), kdf.get("r"), kdf.get("p")
        if not all(type(v) is int for v in (n, r, p)) or not (2 <= n and n & (n - 1) == 0) \
                or not 1 <= r <= 32 or not 1 <= p <= 16 or not isinstance(kdf.get("salt"), str):
            raise bad(f"scrypt parameters out of bounds (n={n!r}, r={r!r}, p={p!r})")
        if 128 * n * r > MAX_SCRYPT_MEMORY or 128 * n * r * p > MAX_SCRYPT_WORK:
            raise bad(f"scrypt parameters that would cost {128 * n * r >> 20} MiB and {128 * n * r * p >> 20} MiB "
                      f"of work (n={n}, r={r}, p={p}; at most {MAX_SCRYPT_MEMORY >> 20} MiB and "
                      f"{MAX_SCRYPT_WORK >> 20} MiB): refused as hostile before deriving anything")
        try:
            bytes.fromhex(kdf["salt"])
        except ValueError:
            raise bad("a salt that is not hex") from None
    try:
        if len(bytes.fromhex(slot.get("nonce", ""))) != 12 or \
                len(base64.b64decode(slot.get("wrapped", ""), validate=True)) != KEY_SIZE + TAG_SIZE:
            raise ValueError
    except (ValueError, TypeError):
        raise bad("its wrapped key is not 12 bytes of nonce and 48 of ciphertext") from None
    return slot


def unwrap(slot: dict, user: UserKey) -> DataKey | None:
    """The data key ``slot`` wraps, if ``user`` opens it; None if it does not."""
    slot = check_slot(slot)
    if slot["kind"] != user.kind:
        return None
    try:
        raw = _aesgcm()(_kek(user, slot["kdf"])).decrypt(bytes.fromhex(slot["nonce"]),
                                                         base64.b64decode(slot["wrapped"]), _slot_aad(slot))
    except Exception as e:
        if type(e).__name__ != "InvalidTag":
            raise
        return None
    key = DataKey(raw)
    if key.key_id != slot["data_key"]:     # cannot be, the id being in the associated data: a forged slot
        raise CorruptCheckpointError(f"key slot {slot['id']} wraps a data key other than the one it names",
                                     section="key slot")
    return key


def open_slots(slots: list[dict], user: UserKey, where: str, damaged: list = ()) -> DataKey:
    """The data key the first of ``slots`` that ``user`` opens wraps (its ``slot_id`` set);
    EncryptionKeyError naming the key tried when none does. ``damaged``: the store's slots
    that could not be read (each with ``id`` and ``reason``), named in that error; the
    intact ones are tried all the same. Slots that name different data keys (a store made
    twice at once, directories merged) are refused: data written under one would not
    open under the other."""
    ids = sorted({check_slot(s)["data_key"] for s in slots})
    if len(ids) > 1:
        raise EncryptionKeyError(f"the store's key slots wrap {len(ids)} different data keys ({', '.join(ids)}): "
                                 "its data cannot all be read with one", ref=where,
                                 hint="keep the slots of one data key (the one its checkpoints open with); "
                                      "slots are in the store's .keys directory")
    for slot in slots:
        key = unwrap(slot, user)
        if key is not None:
            key.slot_id = slot["id"]
            return key
    bad = "; ".join(f"{d.id} ({d.reason})" for d in damaged)[:400]
    what = "raw key" if user.kind == "raw" else "passphrase"
    if not slots:
        raise EncryptionKeyError(f"every key slot of the store is damaged: {bad}", ref=where,
                                 hint="restore the slots from a backup; without one the data cannot be read")
    raise EncryptionKeyError(f"the {what} from {user.source} opens none of the store's {len(slots)} intact key "
                             f"slot(s) ({', '.join(s['id'] for s in slots)})"
                             + (f"; damaged, not tried: {bad}" if bad else ""), ref=where,
                             hint="pass a key that was added to this store (agck key list STORE shows its "
                                  "slots); without one its data cannot be read"
                                  + ("; a damaged slot may be restored from a backup" if bad else ""))
