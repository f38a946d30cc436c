"""Regenerate tests/golden/v1_0.agck:  python tests/golden/make_golden.py

The golden file pins format 1.0: tests check that it keeps decoding to
``golden_state()``. Regenerating it means the bytes of the format changed, which
needs a new format version and a FORMAT.md update, never a silent refresh.

Also holds ``assert_same``, the bit-exact comparison the codec tests use.
"""

from __future__ import annotations

import math
import struct
import sys
import warnings
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))  # the repository root, when run as a script

from agck import checkpoint, codec, loads  # noqa: E402
GOLDEN = HERE / "v1_0.agck"
CREATED_AT_NS = 1_700_000_000_000_000_000
RUN, STEP, PARENT = "golden-run", 1000, 900
META = {"lr": 0.001, "note": "golden", "tags": ["a", "b"], "n": None, "raw": b"\x00\xff"}


def _torch_all_dtypes() -> dict:
    # 13 values through float32 so every format, float8 included, gets distinct exact values
    base = torch.tensor([0.0, 1.0, -2.0, 0.5, 3.0, -0.25, 8.0, 0.125, -1.5, 4.0, 6.0, -0.0, 2.0])
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 is "experimental" in torch
        for name, dt in sorted(codec.TORCH_DTYPES.items()):
            if dt.is_complex:
                t = torch.complex(base, base.flip(0)).to(dt) if dt != torch.complex32 else \
                    torch.complex(base, base.flip(0)).to(torch.complex64).to(dt)
            elif dt == torch.bool:
                t = base > 0
            elif dt in (torch.float8_e8m0fnu,):
                t = base.abs().clamp_min(0.125).to(dt)  # unsigned powers of two only
            elif dt.is_floating_point:
                t = base.to(dt)
            elif name.startswith("uint"):
                t = base.abs().to(torch.int64).to(dt)
            else:
                t = base.to(torch.int64).to(dt)
            out[name] = t.reshape(1, 13)
    return out


def golden_state() -> dict:
    """Deterministic state covering the value types and dtypes of format 1.0."""
    np_all = {}
    for name in ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                 "float16", "float32", "float64", "complex64", "complex128"]:
        a = np.arange(12).reshape(3, 4)
        np_all[name] = (a % 2 == 1) if name == "bool" else (a * 3 - 5 if name[0] in "ifc" else a * 7).astype(name)
    np_all["datetime64[ns]"] = np.array([0, 1_700_000_000_000_000_000, -5], dtype="datetime64[ns]")
    np_all["timedelta64[s]"] = np.array([1, -1, 86400], dtype="timedelta64[s]")
    np_all["nat"] = np.array(["NaT", "2024-01-02"], dtype="datetime64[D]")

    base = np.arange(24, dtype=np.float64).reshape(4, 6)
    big_endian = np.arange(5, dtype=">i4")

    storage = torch.arange(20, dtype=torch.float32)
    tied = torch.nn.Parameter(torch.arange(6, dtype=torch.float32).reshape(2, 3) / 4)
    grad = torch.linspace(-1, 1, 5, dtype=torch.float64).requires_grad_(True)
    sq = torch.arange(9, dtype=torch.int16).reshape(3, 3)

    return {
        "numpy": {
            "dtypes": np_all,
            "zero_d": np.array(3.5, dtype=np.float32),
            "empty": np.zeros((0, 3), dtype=np.int32),
            "fortran": np.asfortranarray(np.arange(6, dtype=np.int64).reshape(2, 3)),
            "shared": [base, base[1:3, ::2], base[::-1, ::-1], base.T],
            "big_endian": big_endian,
            "scalars": [np.float32(1.25), np.int8(-7), np.uint64(2 ** 64 - 1), np.bool_(True),
                        np.complex128(1 - 2j), np.float16(-0.0), np.datetime64(5, "s"),
                        np.dtype("float32"), np.dtype("datetime64[us]")],
        },
        "torch": {
            "dtypes": _torch_all_dtypes(),
            "tied": [tied, tied],
            "views": [storage, storage[2:10].reshape(2, 4), storage[::3], storage.reshape(4, 5).t()],
            "transposed_alone": sq.t(),
            "grad": grad,
            "param_nograd": torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16), requires_grad=False),
            "empty": torch.zeros(0, 4, dtype=torch.float16),
            "scalar": torch.tensor(7, dtype=torch.int64),
            "size": torch.Size([3, 4, 5]),
            "dtype": torch.bfloat16,
            "device": torch.device("cuda:1"),
        },
        "python": {
            "none": None, "t": True, "f": False,
            "ints": [0, -1, 2 ** 63 - 1, -2 ** 63, 2 ** 64 - 1, 2 ** 64, -2 ** 63 - 1, 3 ** 100, -(7 ** 80)],
            "floats": [0.0, -0.0, 1.5, math.inf, -math.inf, math.nan,
                       struct.unpack("<d", struct.pack("<Q", 0x7FF0000000000123))[0], 5e-324],
            "str": "héllo \U0001f600 \ud800 lone surrogate",
            "bytes": b"\x00\x01\xfe\xff",
            "complex": complex(1.5, -0.0),
            "tuple": (1, (2, (3, ())), "x"),
            "set": {3, 1, 2},
            "frozenset": frozenset({"b", "a"}),
            "empty": [[], {}, (), set(), frozenset(), "", b""],
            "keys": {1: "int", (1, "a"): "tuple", b"k": "bytes", 2 ** 70: "bigint", None: "none",
                     frozenset({1}): "frozenset", -3: "neg"},
            "deep": [[[[[[[[{"leaf": (1,)}]]]]]]]],
        },
    }


def _tensor_bytes(t) -> bytes:
    t = t.detach().resolve_conj().resolve_neg().cpu().contiguous()
    return t.reshape(-1).clone(memory_format=torch.contiguous_format).as_strided((t.numel(),), (1,)) \
        .view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _value_bytes(x) -> bytes:
    """Element bytes; for x86 long double only the 10 bytes that hold the value
    (the other 6 are padding that numpy does not keep stable)."""
    raw = x.tobytes()
    if x.dtype.kind in "fc" and x.dtype.itemsize in (16, 32) and np.finfo(x.dtype).nmant == 63:
        raw = b"".join(raw[i:i + 10] for i in range(0, len(raw), 16))
    return raw


def assert_same(expected, got, path="state"):
    """Bit-exact equality of decoded values: types, dtypes, shapes, raw bytes, float bits."""
    if isinstance(expected, dict) and type(expected) is not dict:
        expected = dict(expected)  # dict subclasses come back as dict
    if isinstance(expected, (bytearray, memoryview)):
        expected = bytes(expected)
    if isinstance(expected, str) and type(expected) is not str:
        expected = str(expected)
    te, tg = type(expected), type(got)
    assert te is tg, f"{path}: type {tg} != {te}"
    if te is float:
        assert struct.pack("<d", expected) == struct.pack("<d", got), f"{path}: {got!r} != {expected!r}"
    elif te is complex:
        assert_same(expected.real, got.real, path + ".real")
        assert_same(expected.imag, got.imag, path + ".imag")
    elif te is np.ndarray:
        want = expected.astype(expected.dtype.newbyteorder("="), copy=False)
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{path}: shape {got.shape} != {want.shape}"
        assert _value_bytes(got) == _value_bytes(want), f"{path}: contents differ"
    elif isinstance(expected, np.generic):
        assert got.dtype == expected.dtype and _value_bytes(got) == _value_bytes(expected), f"{path}: {got!r} != {expected!r}"
    elif te is np.dtype or isinstance(expected, np.dtype):
        assert got == expected, f"{path}: {got!r} != {expected!r}"
    elif isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype, f"{path}: dtype {got.dtype} != {expected.dtype}"
        assert got.shape == expected.shape, f"{path}: shape {got.shape} != {expected.shape}"
        assert got.requires_grad == expected.requires_grad, f"{path}: requires_grad differs"
        assert _tensor_bytes(got) == _tensor_bytes(expected), f"{path}: contents differ"
    elif te in (list, tuple):
        assert len(got) == len(expected), f"{path}: length {len(got)} != {len(expected)}"
        for i, (e, g) in enumerate(zip(expected, got)):
            assert_same(e, g, f"{path}[{i}]")
    elif te is dict:
        assert len(got) == len(expected), f"{path}: {len(got)} keys != {len(expected)}"
        for i, ((ke, ve), (kg, vg)) in enumerate(zip(expected.items(), got.items())):
            assert_same(ke, kg, f"{path}.key{i}")
            assert_same(ve, vg, f"{path}[{ke!r}]")
    else:  # None, bool, int, str, bytes, sets, torch.Size/dtype/device
        assert got == expected, f"{path}: {got!r} != {expected!r}"


def write_golden(path: Path = GOLDEN) -> bytes:
    w = checkpoint.encode(golden_state(), run=RUN, step=STEP, parent=PARENT, meta=META,
                          created_at_ns=CREATED_AT_NS)
    data = b"".join(bytes(p) for p in w.parts())
    assert_same(golden_state(), loads(data).state)
    path.write_bytes(data)
    return data


if __name__ == "__main__":
    data = write_golden()
    print(f"wrote {GOLDEN} ({len(data)} bytes)")
