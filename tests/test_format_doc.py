"""FORMAT.md's worked example must be what the code writes and reads."""

import re
from pathlib import Path

import numpy as np

import agck
from agck import checkpoint

DOC = Path(__file__).resolve().parent.parent / "FORMAT.md"
CREATED_AT_NS = 1_700_000_000_000_000_000  # the fixed time the example states


def example_bytes(label: str = "hex") -> bytes:
    """The bytes of FORMAT.md's one ```<label> block (xxd lines)."""
    blocks = re.findall(rf"^```{label}\n(.*?)^```", DOC.read_text(encoding="utf-8"), re.M | re.S)
    assert len(blocks) == 1, f"FORMAT.md must hold exactly one ```{label} block"
    out = bytearray()
    for line in blocks[0].splitlines():
        m = re.match(r"^([0-9a-f]{8}): (.*)$", line)
        assert m, f"not an xxd line: {line!r}"
        assert int(m.group(1), 16) == len(out), f"offset {m.group(1)} out of sequence"
        hexpart = m.group(2).split("  ", 1)[0]  # the ASCII column follows two spaces
        out += bytes.fromhex(hexpart.replace(" ", ""))
    return bytes(out)


def test_example_decodes():
    data = example_bytes()
    assert len(data) == 248
    ck = agck.loads(data)
    assert ck.run == "demo" and ck.step == 1 and ck.parent is None and ck.meta is None
    assert ck.version == "1.0"
    assert ck.header.created_at_ns == CREATED_AT_NS
    assert list(ck.state) == ["x"]
    x = ck.state["x"]
    assert isinstance(x, np.ndarray) and x.dtype == np.float32 and x.shape == (4,)
    assert x.tobytes() == np.arange(4, dtype=np.float32).tobytes()


def test_example_is_what_the_writer_writes():
    w = checkpoint.encode({"x": np.arange(4, dtype=np.float32)}, run="demo", step=1,
                          created_at_ns=CREATED_AT_NS)
    written = b"".join(bytes(p) for p in w.parts())
    assert written == example_bytes(), "FORMAT.md's example has drifted from the writer"


def test_example_header_fields_match_the_doc():
    # The header table's offsets, read back with plain struct calls as an independent reader would.
    import struct
    data = example_bytes()
    assert data[:4] == b"AGCK"
    major, minor, flags, blob_count = struct.unpack_from("<HHII", data, 4)
    meta_len, payload_offset, payload_len = struct.unpack_from("<QQQ", data, 16)
    (created,) = struct.unpack_from("<q", data, 40)
    assert (major, minor, flags, blob_count) == (1, 0, 0, 1)
    assert (meta_len, payload_offset, payload_len, created) == (126, 192, 16, CREATED_AT_NS)
    assert payload_offset == (64 + meta_len + 63) & ~63
    assert data[-8:] == b"AGCK_END"
    assert struct.unpack_from("<Q", data, len(data) - 24)[0] == len(data)


def _section(title: str) -> str:
    text = DOC.read_text(encoding="utf-8")
    start = text.index(title)
    return text[start:text.index("\n## ", start + 1)]


def _names(text: str) -> set[str]:
    return set(re.findall(r"`([a-z][a-z0-9_]*)`", text))


def _row(section: str, first_cell: str) -> str:
    (line,) = [ln for ln in section.splitlines() if ln.startswith(f"| {first_cell} |")]
    return line


def _first_column(table: str) -> set[str]:
    """Names in the first column of the markdown table that starts ``table``."""
    rows = table.strip().split("\n\n", 1)[0].splitlines()[2:]
    return set().union(*(_names(r.split("|")[1]) for r in rows))


def test_name_lists_match_the_reader():
    # The closed lists an independent reader implements are the ones agck's reader uses.
    from agck import codec, format
    types = _section("## 7. Element types")
    numpy_part, torch_part = types.split("Numpy names", 1)[1].split("Torch names", 1)
    assert _first_column(numpy_part.split("\n\n", 1)[1]) == set(codec._NP_NAMES) | set(codec._NP_LONG_DOUBLE)
    assert _first_column(torch_part.split("\n\n", 1)[1]) == set(codec._TORCH_NAMES)
    tree = _section("## 8. The value tree")
    ext8 = _row(tree, "8").split("|")[3]
    assert _names(ext8.split("one of the dtypes", 1)[1].split("No other", 1)[0]) == \
        set(codec._TORCH_VALUE_NAMES) - set(codec._TORCH_NAMES)
    ext10 = _row(tree, "10").split("|")[3]
    assert _names(ext10.split("one of", 1)[1].split(";", 1)[0]) == set(codec._DEVICE_TYPES)
    limits = _section("## 11. Limits")
    assert f"| `MAX_DEPTH` | {format.MAX_DEPTH} |" in limits
    assert f"| `MAX_SAME_HASH` | {format.MAX_SAME_HASH} |" in limits


def test_chunked_example_is_what_the_writer_writes_and_rebuilds_the_inner_container():
    import blake3

    from agck import format
    from agck.stores import content
    inner = example_bytes()
    chunks = [inner[:128], inner[128:]]
    data = example_bytes("hex chunked")
    assert len(data) == 288
    assert data == format.dumps_chunked(run="demo", step=1, parent=None, meta=None,
                                        addresses=[blake3.blake3(c).digest() for c in chunks],
                                        sizes=[128, 120], created_at_ns=CREATED_AT_NS)
    c = format.open_container(data)
    assert (c.header.major, c.header.minor, c.header.flags) == (1, 1, format.FLAG_CHUNKED)
    listed = format.open_chunked(c)
    assert listed.sizes == [128, 120] and listed.length == 248
    by_address = {blake3.blake3(ch).digest(): ch for ch in chunks}
    ck = content.decode(data, lambda a, n: by_address.get(a), verify=True, map_location=None, ref=None)
    assert ck.run == "demo" and ck.step == 1 and ck.version == "1.0"
    assert ck.state["x"].tobytes() == np.arange(4, dtype=np.float32).tobytes()


NONCES = ["a1b2c3d4e5f60718293a4b5c", "0f1e2d3c4b5a69788796a5b4"]


def test_commit_record_example_is_what_the_writer_writes_and_reads_back(tmp_path):
    """FORMAT.md section 13's worked example: rules 13.1-13.5."""
    from agck import format, sharded
    from agck.stores import open_store
    parts = [sharded.PartRef(r, sharded.part_run("demo", 1, r), n) for r, n in enumerate(NONCES)]
    record = sharded.Commit(run="demo", step=1, epoch=1, world_size=2, parts=parts)
    w = checkpoint.encode(record.state(), run="demo", step=1, created_at_ns=CREATED_AT_NS)
    data = example_bytes("hex commit")
    assert len(data) == 352
    assert b"".join(bytes(p) for p in w.parts()) == data, "FORMAT.md's commit record has drifted from the writer"
    h = format.parse_header(data)
    assert (h.minor, h.flags, h.blob_count, h.meta_len, h.payload_offset) == (0, 0, 0, 198, 320)
    ck = agck.loads(data)
    assert list(ck.state) == ["agck.commit"]
    state_at = data.index(b"\x81\xabagck.commit")
    assert state_at == 0x6f and data[state_at - 2:state_at] == b"\xc4\x90"     # bin 8 of 144 bytes
    commit = sharded.as_commit(ck)
    assert (commit.kind, commit.epoch, commit.world_size, commit.extra) == ("snapshot", 1, 2, None)
    assert [(p.run, p.nonce) for p in commit.parts] == [("demo.e1.r0", NONCES[0]), ("demo.e1.r1", NONCES[1])]
    # the record and its two parts in a store: step 1 verifies, with every part bound
    with open_store(str(tmp_path / "s")) as store:
        epoch = store.begin_epoch("demo")
        assert epoch == 1
        for r in range(2):
            store.parts_store().put(f"demo.e1.r{r}", 1, {"rank": r},
                                    meta=sharded.part_meta("demo", 1, 1, r, 2, NONCES[r]))
        store.put("demo", 1, record.state(), epoch=epoch)
        assert agck.recover(store, "demo").step == 1
        assert [sharded.read_part(store, commit, r).state for r in (0, 1)] == [{"rank": 0}, {"rank": 1}]


# --- rule ids ---------------------------------------------------------------------------------

ROOT = DOC.parent
_RULE_ID = r"\d{1,2}\.\d{1,2}"
_CITED = re.compile(rf"\b(?:[Rr]ules?|FORMAT\.md,?|checks?)\s+((?:{_RULE_ID})(?:\s*(?:-|,|and|or)\s*{_RULE_ID})*)")


def _defined_rules() -> list[str]:
    return re.findall(rf"^- \*\*({_RULE_ID})\*\* ", DOC.read_text(encoding="utf-8"), re.M)


def _sources():
    yield DOC
    yield ROOT / "README.md"
    for sub in ("agck", "tests"):
        yield from sorted((ROOT / sub).rglob("*.py"))


def _cited(path) -> set[str]:
    text = path.read_text(encoding="utf-8")
    out = set()
    for m in _CITED.finditer(text):
        out.update(re.findall(_RULE_ID, m.group(1)))
    return out


def test_rule_ids_are_defined_once_and_every_citation_names_one():
    defined = _defined_rules()
    assert len(defined) == len(set(defined)), "a rule id is defined twice"
    assert {d.split(".")[0] for d in defined} == {"10", "12", "13", "17", "18"}
    for section in ("10", "12", "13", "17", "18"):    # numbered from 1 without a gap
        numbers = [int(d.split(".")[1]) for d in defined if d.split(".")[0] == section]
        assert numbers == list(range(1, len(numbers) + 1)), section
    for path in _sources():
        unknown = _cited(path) - set(defined)
        assert not unknown, f"{path.relative_to(ROOT)} cites rules FORMAT.md does not define: {sorted(unknown)}"


def test_sections_12_13_17_and_18_rules_are_cited_by_the_code_and_held_by_tests():
    defined = [d for d in _defined_rules() if d.split(".")[0] in ("12", "13", "17", "18")]
    code = set().union(*(_cited(p) for p in sorted((ROOT / "agck").rglob("*.py"))))
    others = [p for p in sorted((ROOT / "tests").glob("test_*.py")) if p.name != Path(__file__).name]
    tests = set().union(*map(_cited, others))
    tests |= {d for d in defined for p in others if f"test_{d.replace('.', '_')}_" in p.read_text(encoding="utf-8")}
    assert not set(defined) - tests, f"rules no test names: {sorted(set(defined) - tests)}"
    # 12.6 and 12.7 are kept by agck.checkpoint and agck.export; the others by the code that checks them
    checked = set(defined) - {"12.6", "12.7"}
    assert not checked - code, f"rules no code cites: {sorted(checked - code)}"


def test_journal_record_example_is_what_the_writer_writes_and_reads_back():
    from agck import journalrec as jr
    data = example_bytes("hex journal")
    key = jr.fingerprint(("doc-1",), {})
    assert key.hex() == "b0d22507c756900b11a7c997c4c3f905"
    assert data == jr.record("r", "embed", key, 0, *jr.encode_value({"n": 3, "ok": True}))
    (found,) = jr.scan(data).entries
    assert found[1].name == "embed" and jr.decode_value(found[1]) == {"n": 3, "ok": True}


def test_file_log_batch_example_is_what_the_file_store_appends(tmp_path):
    """FORMAT.md 17.6 and 17.7: the worked batch, as the file store writes it; cut short, torn."""
    import agck
    from agck import journalrec as jr
    from agck.journal import Journal
    data = example_bytes("hex batch")
    key = jr.fingerprint(("doc-1",), {})
    assert data == jr.batch(jr.record("r", "embed", key, 0, *jr.encode_value({"n": 3, "ok": True})))
    with Journal(str(tmp_path), "r") as j:
        j.step("embed", lambda doc: {"n": 3, "ok": True}, "doc-1")
    assert open(agck.open_store(str(tmp_path)).log_ref("r"), "rb").read() == data
    for cut in range(17, len(data)):
        found = jr.scan(data[:cut])
        assert found.torn and found.end == 0 and not found.entries and not found.damaged, cut
    flipped = bytearray(data)
    flipped[40] ^= 1
    found = jr.scan(bytes(flipped))
    assert not found.torn and found.end == len(data) and "cannot tell" in found.damaged[0][1]


def test_append_log_segment_example_is_what_a_snapshot_writes_and_resume_reads(tmp_path):
    import agck
    from agck import applog
    from agck import journalrec as jr
    from agck.capture import TAG
    data = example_bytes("hex segment")
    gen = bytes(range(16))
    assert data == jr.record("s", "results", gen, 0, *jr.encode_value([{"i": 0}, {"i": 1}]))
    store = agck.open_store(str(tmp_path / "s"))
    store.log_append("r", [data])
    tree = {"state": {"results": {TAG: "log", "name": "results", "count": 2, "chain": [[gen, 0]]}}}
    applog.resolve(store, "r", tree, "example")
    assert isinstance(tree["state"]["results"], agck.AppendLog) and list(tree["state"]["results"]) == [
        {"i": 0}, {"i": 1}]
    store.close()


# --- compressed chunks (rules 12.8-12.12) -------------------------------------------------

FRAME_RAW = np.array([0.5, -1.25, 3.0, 0.125, 1.0, 1.5, -2.0, 0.75] * 4, np.float32).tobytes() + b"\x07"


def _independent_decode(frame: bytes, listed_size: int) -> bytes:
    """A reader written from FORMAT.md rules 12.10-12.12 alone: struct and zstandard."""
    import struct
    import zstandard
    assert len(frame) < listed_size                                   # 12.9: shorter than listed: a frame
    magic, version, method, itemsize, n = struct.unpack_from("<4sBBBQ", frame)
    assert (magic, version) == (b"AGCZ", 1) and n == listed_size      # 12.11
    assert (method, itemsize) in {(1, 0), (2, 2), (2, 4), (2, 8)}
    payload = frame[15:]
    assert zstandard.frame_content_size(payload) == n
    content = zstandard.ZstdDecompressor().decompress(payload, max_output_size=n)
    assert len(content) == n
    if method == 1:
        return content
    m = n // itemsize                                                 # 12.12
    out = bytearray(n)
    for e in range(m):
        for j in range(itemsize):
            out[e * itemsize + j] = content[j * m + e]
    out[m * itemsize:] = content[m * itemsize:]
    return bytes(out)


def test_frame_example_is_what_the_writer_writes_and_decodes_from_the_text_alone():
    from agck import chunkcodec, chunking
    frame = example_bytes("hex frame")
    assert len(frame) == 52 and len(FRAME_RAW) == 129
    assert frame[:15].hex() == "4147435a0102048100000000000000"
    assert _independent_decode(frame, 129) == FRAME_RAW
    assert bytes(chunkcodec.decode(frame, encoded=True, raw_size=129, address=chunking.address(FRAME_RAW))) \
        == FRAME_RAW
    written = chunkcodec.frame(FRAME_RAW, chunkcodec.Method.PLANES_ZSTD, itemsize=4, level=1)
    assert written[:15] == frame[:15]
    assert _independent_decode(written, 129) == FRAME_RAW
    assert written == frame, "FORMAT.md's frame example has drifted from the writer (or zstd's encoder changed)"


def test_12_8_framed_listing_is_version_1_2_and_a_1_1_reader_refuses_it(monkeypatch):
    from agck import format
    from agck.errors import MalformedCheckpointError, UnsupportedVersionError
    a = bytes(32)
    data = format.dumps_chunked(run="r", step=1, parent=None, meta=None, addresses=[a], sizes=[10], framed=True)
    h = format.parse_header(data)
    assert (h.minor, h.flags) == (2, 0x3)
    assert format.open_chunked(format.open_container(data)).framed
    plain = format.dumps_chunked(run="r", step=1, parent=None, meta=None, addresses=[a], sizes=[10])
    assert format.parse_header(plain).flags == 0x1
    monkeypatch.setattr(format, "KNOWN_REQUIRED_FLAGS", format.FLAG_CHUNKED)    # a 1.1 reader
    import pytest
    with pytest.raises(UnsupportedVersionError):
        format.parse_header(data)
    format.parse_header(plain)
    monkeypatch.undo()
    # FRAMED without CHUNKED: malformed, to the writer (which checks its own header) and to a reader
    with pytest.raises(MalformedCheckpointError):
        format.ContainerWriter({"x": 1}, [], flags=format.FLAG_FRAMED)
    import struct
    head = bytearray(plain[:64])
    struct.pack_into("<I", head, 8, format.FLAG_FRAMED)
    struct.pack_into("<Q", head, 56, format.digest(bytes(head[:56])))
    with pytest.raises(MalformedCheckpointError):
        format.parse_header(bytes(head) + plain[64:])


# --- encryption at rest (rules 18.1-18.6) ---------------------------------------------------------

def test_sealed_example_is_what_the_writer_writes_and_opens_from_the_text_alone():
    import blake3
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from agck import cipher, chunking
    sealed = example_bytes("hex sealed")
    data_key, salt, plain = bytes(range(32)), bytes(range(100, 124)), b"hello, agck"
    # a reader from FORMAT.md section 18 alone
    a = blake3.blake3(data_key, derive_key_context="agck 2026-12 sealed objects v1").digest()
    n = blake3.blake3(data_key, derive_key_context="agck 2026-12 chunk names v1").digest()
    address = blake3.blake3(plain).digest()
    name = blake3.blake3(address, key=n).digest()
    assert address.hex() == "2f841e78e6f8e36a23d343166c860749e1db42f58d26a5e4c7247e21dcd85446"
    assert name.hex() == "362a0e449108e28f5c233375130b312445db83a606a914fdf18864e70c4a3ab1"
    assert sealed[:4] == b"AGCE" and sealed[4:8] == bytes([1, 1, 1, 0]) and sealed[8:32] == salt
    key = blake3.blake3(sealed[8:32], key=a).digest()
    assert AESGCM(key).decrypt(bytes(12), sealed[32:], sealed[:32] + b"chunk\0" + name) == plain
    # the writer
    k = cipher.DataKey(data_key)
    assert k.name(chunking.address(plain)) == name
    assert k.seal(cipher.Kind.CHUNK, cipher.chunk_context(name), plain, salt=salt) == sealed
    assert k.open(cipher.Kind.CHUNK, cipher.chunk_context(name), sealed) == plain
