"""The sealed object and the key slots (agck/cipher.py, FORMAT.md section 18): what opens,
and that nothing else does: every byte of a sealed object flipped in turn, an object moved
to another context or sealed under another key, a wrong user key, a tampered slot."""

from __future__ import annotations

import base64
import json
import os

import pytest

from agck import cipher
from agck.cipher import DataKey, Kind
from agck.errors import CorruptCheckpointError, EncryptionKeyError, UnsupportedVersionError, UsageError


def test_a_sealed_chunk_opens_to_its_plaintext_and_holds_nothing_of_it_in_the_clear():
    """Rules 18.1 and 18.2: keys derived from the data key; 48 bytes more than the plaintext."""
    k = DataKey.new()
    name = k.name(bytes(32))
    plain = b"the secret marker AGCK-PLANTED-MARKER " * 100
    sealed = k.seal(Kind.CHUNK, cipher.chunk_context(name), plain)
    assert len(sealed) == len(plain) + cipher.OVERHEAD
    assert b"MARKER" not in sealed and plain[:16] not in sealed
    assert k.open(Kind.CHUNK, cipher.chunk_context(name), sealed) == plain
    assert k.seal(Kind.CHUNK, cipher.chunk_context(name), plain) != sealed      # a fresh salt each time


def test_every_byte_of_a_sealed_object_flipped_in_turn_is_refused():
    """Rule 18.5: the header checked, then the tag, before any plaintext is used."""
    k = DataKey.new()
    ctx = cipher.container_context("run", 7)
    sealed = k.seal(Kind.CONTAINER, ctx, os.urandom(300))
    for i in range(len(sealed)):
        bad = bytearray(sealed)
        bad[i] ^= 0x01
        with pytest.raises((CorruptCheckpointError, UnsupportedVersionError)):
            k.open(Kind.CONTAINER, ctx, bytes(bad))
    for cut in (0, 10, cipher.OVERHEAD - 1, len(sealed) - 1):
        with pytest.raises(CorruptCheckpointError):
            k.open(Kind.CONTAINER, ctx, sealed[:cut])


def test_an_object_moved_elsewhere_or_sealed_under_another_key_does_not_open():
    """Rule 18.4: a chunk bound to its name, a container to its run and step."""
    k, other = DataKey.new(), DataKey.new()
    a, b = k.name(b"a" * 32), k.name(b"b" * 32)
    sealed = k.seal(Kind.CHUNK, cipher.chunk_context(a), b"content")
    with pytest.raises(CorruptCheckpointError, match="tag"):
        k.open(Kind.CHUNK, cipher.chunk_context(b), sealed)                     # swapped to another name
    with pytest.raises(CorruptCheckpointError, match="tag"):
        other.open(Kind.CHUNK, cipher.chunk_context(a), sealed)                 # another store's key
    with pytest.raises(CorruptCheckpointError):
        k.open(Kind.CONTAINER, cipher.chunk_context(a), sealed)                 # another kind
    c = k.seal(Kind.CONTAINER, cipher.container_context("r", 1), b"x")
    with pytest.raises(CorruptCheckpointError):
        k.open(Kind.CONTAINER, cipher.container_context("r", 2), c)             # replayed at another step


def test_names_are_keyed_per_store_and_stable_within_one():
    """Rule 18.3: one name per content in a store, another in a store of another key."""
    k, other = DataKey.new(), DataKey.new()
    address = os.urandom(32)
    assert k.name(address) == k.name(address) != other.name(address)
    assert DataKey(k.raw()).name(address) == k.name(address)


def test_a_newer_sealed_version_asks_for_a_newer_agck():
    k = DataKey.new()
    sealed = bytearray(k.seal(Kind.CHUNK, b"", b"x" * 10))
    sealed[4] = 2
    with pytest.raises(UnsupportedVersionError):
        k.open(Kind.CHUNK, b"", bytes(sealed))


@pytest.mark.parametrize("secret", ["correct horse battery staple", os.urandom(32)])
def test_a_slot_opens_with_its_user_key_only(secret):
    """Rule 18.6: a slot wraps the data key under a passphrase (scrypt) or a raw key."""
    k = DataKey.new()
    user = cipher.user_key(secret)
    slot = json.loads(json.dumps(cipher.wrap(k, user)))          # as stored: JSON text
    assert secret not in json.dumps(slot) if isinstance(secret, str) else True
    assert cipher.unwrap(slot, user).raw() == k.raw()
    wrong = cipher.user_key("another passphrase" if isinstance(secret, str) else os.urandom(32))
    assert cipher.unwrap(slot, wrong) is None
    with pytest.raises(EncryptionKeyError, match="opens none"):
        cipher.open_slots([slot], wrong, "store")
    got = cipher.open_slots([cipher.wrap(k, wrong), slot], user, "store")
    assert got.raw() == k.raw() and got.slot_id == slot["id"]


def test_a_tampered_slot_opens_with_no_key():
    k = DataKey.new()
    user = cipher.user_key(os.urandom(32))
    slot = cipher.wrap(k, user)
    for field, value in (("id", "abcdef"), ("created", 1.0), ("nonce", os.urandom(12).hex())):
        assert cipher.unwrap(dict(slot, **{field: value}), user) is None
    raw = bytearray(base64.b64decode(slot["wrapped"]))
    raw[3] ^= 1
    assert cipher.unwrap(dict(slot, wrapped=base64.b64encode(bytes(raw)).decode()), user) is None


@pytest.mark.parametrize("slot", [
    None, [], {"agck_key_slot": 1}, {"agck_key_slot": "1"},
    {"agck_key_slot": 1, "id": "x", "kind": "passphrase", "created": 1, "nonce": "00" * 12, "wrapped": "",
     "kdf": {"name": "scrypt", "n": 1 << 40, "r": 8, "p": 1, "salt": "00"}},
    {"agck_key_slot": 1, "id": "x", "kind": "raw", "created": 1, "nonce": "00" * 12, "wrapped": "AAAA",
     "kdf": {"name": "blake3"}},
])
def test_a_damaged_slot_is_refused_before_any_key_is_derived(slot):
    with pytest.raises(CorruptCheckpointError):
        cipher.check_slot(slot)


def test_a_newer_slot_asks_for_a_newer_agck():
    with pytest.raises(UnsupportedVersionError):
        cipher.check_slot({"agck_key_slot": 2})


def test_user_keys_from_what_users_pass(tmp_path):
    assert cipher.user_key("pass phrase").kind == "passphrase"
    raw = os.urandom(32)
    assert cipher.user_key(lambda: raw) == cipher.UserKey(raw, "raw", "the key= argument (a callable)")
    f = tmp_path / "k"
    f.write_text(raw.hex() + "\n")
    assert cipher.key_from_file(f).secret == raw
    f.write_text("a passphrase in a file\n")
    assert cipher.key_from_file(f).secret == b"a passphrase in a file"
    for bad in ("", b"short", 3, None):
        with pytest.raises(UsageError):
            cipher.user_key(bad)
    with pytest.raises(EncryptionKeyError, match="callable from .* failed"):
        cipher.user_key(lambda: 1 / 0)
    with pytest.raises(EncryptionKeyError, match="cannot read"):
        cipher.key_from_file(tmp_path / "missing")
    assert "secret" not in repr(cipher.user_key("secret words"))
