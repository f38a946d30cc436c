"""FORMAT.md's worked example must be what the code writes and reads."""

import re
from pathlib import Path

import numpy as np

import agck
from agck import checkpoint

DOC = Path(__file__).resolve().parent.parent / "FORMAT.md"
CREATED_AT_NS = 1_700_000_000_000_000_000  # the fixed time the example states


def example_bytes() -> bytes:
    blocks = re.findall(r"^```hex\n(.*?)^```", DOC.read_text(encoding="utf-8"), re.M | re.S)
    assert len(blocks) == 1, "FORMAT.md must hold exactly one ```hex block"
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
