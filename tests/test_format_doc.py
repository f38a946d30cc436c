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
