"""The codec's fixed tables and what its encoder and decoder share.

Extension type codes (FORMAT.md section 8), the dtype names of numpy and torch
(section 7) and the device types a torch.device value may have: closed lists,
so that decoding never looks a name up in a module. The torch binding: torch is
imported only when a state needs it (see _bind_torch), and the codec's modules
read it as their global ``torch`` (see share_torch). The shape limits and the
byte extent of a tensor (section 6), which the encoder checks before it writes
and the decoder before it reads.
"""

from __future__ import annotations

import math
import re
import sys
from typing import Any

import numpy as np

from ..errors import DependencyError
from ..format import MAX_DEPTH

# torch is optional and slow to import (about a second), so agck never imports it
# to encode (a state can only hold torch values if the process already has torch)
# and imports it to decode only when a container holds torch values. `import agck`
# and the CLI stay fast; see _bind_torch.
torch: Any = None
_TORCH_USERS: list[dict] = []   # globals() of the modules given torch by share_torch


def share_torch(namespace: dict) -> None:
    """Give the module whose globals() are ``namespace`` a global ``torch``: None
    until _bind_torch binds torch, then the module. The encoder and decoder read
    it on every value they walk, where a global of their own is the cheap lookup."""
    _TORCH_USERS.append(namespace)
    namespace["torch"] = torch


EXT_TUPLE = 1
EXT_SET = 2
EXT_FROZENSET = 3
EXT_BIGINT = 4
EXT_TENSOR = 5
EXT_NP_SCALAR = 6
EXT_COMPLEX = 7
EXT_TORCH_DTYPE = 8
EXT_TORCH_SIZE = 9
EXT_TORCH_DEVICE = 10
EXT_NP_DTYPE = 11

_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1

# --- dtypes -----------------------------------------------------------------------

_NP_NAMES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
             "float16", "float32", "float64", "complex64", "complex128"]
_NP_LONG_DOUBLE = ("float128", "complex256")  # x86-64 long double: 80-bit extended, 16 bytes
if hasattr(np, "float128"):
    _NP_NAMES += _NP_LONG_DOUBLE
_NP_TIME = re.compile(r"(datetime64|timedelta64)\[(Y|M|W|D|h|m|s|ms|us|ns|ps|fs|as)\]")


def np_dtype_name(dt: np.dtype) -> str | None:
    """The format's name for a numpy dtype, or None if unsupported."""
    try:
        return _NP_NAME_OF[dt]
    except (KeyError, TypeError):
        pass
    name = _np_dtype_name(dt)
    if len(_NP_NAME_OF) < 1024:
        try:
            _NP_NAME_OF[dt] = name
        except TypeError:
            pass
    return name


_NP_NAME_OF: dict = {}   # dtypes are hashed by value (byte order included): a cache of the rule below


def _np_dtype_name(dt: np.dtype) -> str | None:
    if dt.kind in "mM":
        name = str(dt.newbyteorder("="))
        return name if _NP_TIME.fullmatch(name) else None
    name = dt.newbyteorder("=").name
    return name if name in _NP_NAMES and dt.fields is None else None


def np_dtype_from_name(name: str) -> np.dtype:
    """The little-endian numpy dtype of a format name (ValueError for any other
    name; DependencyError for long double where numpy lacks it)."""
    if isinstance(name, str) and (name in _NP_NAMES or _NP_TIME.fullmatch(name)):
        return np.dtype(name).newbyteorder("<")
    if name in _NP_LONG_DOUBLE:
        raise DependencyError(f"this checkpoint holds numpy {name} values, which numpy has no type for on "
                              "this platform", hint="load it on x86-64 Linux, where numpy has float128")
    raise ValueError(f"unknown numpy dtype {name!r}")


# Tensor dtypes (FORMAT.md section 7), then the other dtypes a torch.dtype value (ext 8) may
# be. Fixed lists: the decoder never looks a name up in the torch module.
_TORCH_NAMES = ["bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
                "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
                "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"]
_TORCH_VALUE_NAMES = _TORCH_NAMES + [
    "float4_e2m1fn_x2", "bits1x8", "bits2x4", "bits4x2", "bits8", "bits16",
    "int1", "int2", "int3", "int4", "int5", "int6", "int7",
    "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7",
    "qint8", "quint8", "qint32", "quint4x2", "quint2x4"]
TORCH_DTYPES: dict[str, Any] = {}        # tensor dtypes by name; filled in place once torch is bound
_TORCH_DTYPE_NAMES: dict[Any, str] = {}
_TORCH_VALUES: dict[str, Any] = {}       # every dtype ext 8 may name, by name
_TORCH_VALUE_NAME: dict[Any, str] = {}

# Device types a torch.device value (ext 10) may have: torch 2.13's list.
_DEVICE_TYPES = frozenset({"cpu", "cuda", "ipu", "xpu", "mkldnn", "opengl", "opencl", "ideep", "hip", "ve",
                           "fpga", "maia", "xla", "lazy", "vulkan", "mps", "meta", "hpu", "mtia", "privateuseone"})
_DEVICE_RE = re.compile(r"([a-z][a-z0-9_]*)(?::(0|[1-9][0-9]{0,2}))?")


def _device_syntax(s) -> str | None:
    """The device type of a device string ``type`` or ``type:index`` (index 0-127), else None."""
    m = _DEVICE_RE.fullmatch(s) if type(s) is str else None
    return m.group(1) if m and (m.group(2) is None or int(m.group(2)) < 128) else None


def _bind_torch(load: bool = False):
    """The torch module once it is in use, else None. ``load`` imports it (to
    decode torch values; raises :class:`DependencyError` if torch is missing or
    broken); without it, only a torch the process has fully imported counts."""
    global torch
    if torch is not None:
        return torch
    mod = sys.modules.get("torch")
    if mod is not None and getattr(getattr(mod, "__spec__", None), "_initializing", False):
        mod = None            # another thread is importing it: only a real import waits for that
    if mod is None:
        if not load:
            return None
        try:
            import torch as mod
        except Exception as e:  # ImportError, or a broken install (OSError, RuntimeError, ...)
            raise DependencyError(f"this checkpoint holds torch values and `import torch` failed: "
                                  f"{type(e).__name__}: {e}") from None
    dtype_type = getattr(mod, "dtype", None)
    found = {n: getattr(mod, n, None) for n in _TORCH_VALUE_NAMES} if isinstance(dtype_type, type) else {}
    dtypes = {n: d for n, d in found.items() if isinstance(d, dtype_type)}
    if "float32" not in dtypes:   # not a complete torch module: never bind a partial one
        if load:
            raise DependencyError("torch is importable but incomplete (no torch.float32)")
        return None
    _TORCH_VALUES.update(dtypes)
    _TORCH_VALUE_NAME.update({v: k for k, v in dtypes.items()})
    TORCH_DTYPES.update({n: d for n, d in dtypes.items() if n in _TORCH_NAMES})
    _TORCH_DTYPE_NAMES.update({v: k for k, v in TORCH_DTYPES.items()})
    for namespace in _TORCH_USERS:   # first: whoever finds torch bound here finds it in their globals
        namespace["torch"] = mod
    torch = mod
    return torch


def _torch_dtype(name: str, table: dict, what: str, bad):
    """The torch.dtype a format name stands for: refused (``bad``) when the name
    is not in the format's list, DependencyError when this torch lacks it."""
    dt = table.get(name) if type(name) is str else None
    if dt is not None:
        return dt
    if name in (_TORCH_NAMES if table is TORCH_DTYPES else _TORCH_VALUE_NAMES):
        raise DependencyError(f"this checkpoint holds {what} of torch dtype {name}, which torch "
                              f"{torch.__version__} lacks", hint="load it with a newer torch")
    raise bad(f"unknown torch dtype {name!r} for {what}")


_bind_torch()


def _shape_error(shape, itemsize: int) -> str | None:
    """What makes a shape one the format cannot hold (FORMAT.md section 6), or None."""
    if len(shape) > 64:
        return f"{len(shape)} dimensions (at most 64)"
    if any(n >= 1 << 62 for n in shape):
        return f"a dimension of 2**62 or more in {tuple(shape)}"
    if math.prod(n for n in shape if n) * itemsize >= 1 << 63:
        return f"shape {tuple(shape)} spans 2**63 bytes or more"
    return None


def _extent(ptr: int, shape, byte_strides, itemsize: int) -> tuple[int, int]:
    lo = hi = ptr
    for n, s in zip(shape, byte_strides):
        if s < 0:
            lo += (n - 1) * s
        else:
            hi += (n - 1) * s
    return lo, hi + itemsize


# The encoder and the decoder recurse once per container level (MAX_DEPTH at most), a few frames each.
sys.setrecursionlimit(max(sys.getrecursionlimit(), 4 * MAX_DEPTH + 1000))
