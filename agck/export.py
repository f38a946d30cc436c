"""Export a checkpoint's tensors to formats other tools read.

``.safetensors`` and ``.npz`` hold flat maps of tensors: the state tree is
flattened into dotted keys (``model.layers.3.weight``); two tensors whose keys
flatten alike (``{"a.b": x, "a": {"b": y}}``) are an error naming both.
Non-tensor values, and tensors of a dtype the format lacks, are skipped (and
listed). ``.pt`` is ``torch.save`` of the whole state, its structure kept, made
for ``torch.load(path)`` with torch's default ``weights_only=True``, which
refuses numpy objects: numpy arrays become torch tensors (sharing memory as
the arrays did) and numpy scalars Python numbers, and the summary counts them
(``converted``); a value that loader cannot read (a numpy dtype torch lacks,
a frozenset, a numpy dtype object) is a UsageError naming its path.

Export writes at most ``max_bytes`` of tensor data, by default twice the
checkpoint's stored size (room for tied weights, which are stored once and
exported once per name): a tensor may be a view with zero strides, a few
stored bytes that a flat file would spell out in full. The output is written
beside its final path and renamed into place, so a failed export leaves no
partial file.
"""

from __future__ import annotations

import os
import secrets
import stat
import warnings
import zipfile
from typing import Any, Iterator

import numpy as np

from .checkpoint import Checkpoint, file_path
from .errors import DependencyError, UsageError

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

EXPANSION_LIMIT = 2     # the default max_bytes, as a multiple of the checkpoint's stored size

_FORMATS = {".safetensors": "safetensors", ".pt": "pt", ".npz": "npz", ".agck": "agck"}
_SAFETENSORS_DTYPES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
                       "bool", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "complex64",
                       "uint64", "uint32", "uint16")
_NO_NUMPY = ("bfloat16", "complex32", "float8")     # torch dtypes numpy lacks


def _is_tensor(x) -> bool:
    return isinstance(x, np.ndarray) or (torch is not None and isinstance(x, torch.Tensor))


def _leaves(state: Any, key: str = "", path: str = "state") -> Iterator[tuple[str, str, Any]]:
    """(dotted key, path as in error messages, value) of every leaf."""
    if _is_tensor(state):
        yield key, path, state
    elif isinstance(state, dict):
        for k, v in state.items():
            yield from _leaves(v, f"{key}.{k}" if key else str(k), f"{path}[{k!r}]")
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            yield from _leaves(v, f"{key}.{i}" if key else str(i), f"{path}[{i}]")
    else:
        yield key, path, state


def flatten(state: Any, prefix: str = "") -> tuple[dict[str, Any], list[str]]:
    """(dotted key -> array/tensor, keys of skipped non-tensor leaves). Two tensors
    whose keys flatten alike raise UsageError: one would silently replace the other."""
    tensors: dict[str, Any] = {}
    where: dict[str, str] = {}
    skipped: list[str] = []
    for key, path, x in _leaves(state, prefix):
        if not _is_tensor(x):
            skipped.append(key or "<root>")
        elif key in tensors:
            raise UsageError(f"{where[key]} and {path} both export as {key!r}",
                             hint="rename one of them, or export to .pt, which keeps the structure")
        else:
            tensors[key], where[key] = x, path
    return tensors, skipped


def _nbytes(x) -> int:
    return x.nbytes if isinstance(x, np.ndarray) else x.numel() * x.element_size()


def _pt_nbytes(state: Any) -> int:
    """What torch.save writes of the tensors: numpy arrays in full, each torch storage once."""
    total, seen = 0, set()
    for _, _, x in _leaves(state):
        if isinstance(x, np.ndarray):
            total += x.nbytes
        elif _is_tensor(x):
            st = x.untyped_storage()
            if (x.device, st.data_ptr()) not in seen:
                seen.add((x.device, st.data_ptr()))
                total += st.nbytes()
    return total


def _torch_dtype(a: np.ndarray):
    try:
        return torch.from_numpy(np.empty(0, a.dtype)).dtype
    except TypeError:   # datetime64, and other dtypes torch lacks
        return None


def export(ck: Checkpoint, out: str | os.PathLike, *, max_bytes: int | None = None) -> dict:
    """Write ``ck``'s tensors to ``out`` (.safetensors, .pt or .npz), or the whole
    checkpoint as a standalone 1.0 container (.agck: what a chunked checkpoint
    of a store materializes to); returns a summary. ``max_bytes`` bounds the
    tensor bytes written (default: EXPANSION_LIMIT times the checkpoint's stored
    size); more is a UsageError and nothing is written."""
    out = file_path(out)
    ext = os.path.splitext(out)[1].lower()
    fmt = _FORMATS.get(ext)
    if fmt is None:
        raise UsageError(f"unknown export format {ext or out!r}", hint="use .safetensors, .pt, .npz or .agck")
    if fmt == "agck":   # the codec stores shared memory once, as the checkpoint did: no expansion
        from . import checkpoint
        size = checkpoint.save(out, ck.state, run=ck.run, step=ck.step, parent=ck.parent, meta=ck.meta)
        return {"format": "agck", "tensors": len(ck.tensors), "skipped": [], "path": out, "bytes": size}
    if fmt != "npz" and torch is None:
        raise DependencyError(f"exporting to {ext} needs torch", hint="pip install torch")
    if fmt == "safetensors":
        try:
            import safetensors.torch  # noqa: F401
        except ImportError as e:
            raise DependencyError(f"exporting to .safetensors needs safetensors ({e})",
                                  hint="pip install safetensors") from None
    if fmt == "pt":
        tensors = [x for _, _, x in _leaves(ck.state) if _is_tensor(x)]
        _check_size(_pt_nbytes(ck.state), ck, max_bytes)
        state, converted = _weights_only(ck.state, ck.ref)
        _write_replacing(out, lambda f, _: torch.save(state, f))
        return {"format": "pt", "tensors": len(tensors), "skipped": [], "path": out, "converted": converted}
    tensors, skipped = flatten(ck.state)
    chosen: dict[str, Any] = {}
    for k, v in tensors.items():
        why = _unsupported(fmt, v)
        if why:
            skipped.append(f"{k} ({why})")
        else:
            chosen[k] = v
    _check_size(sum(_nbytes(v) for v in chosen.values()), ck, max_bytes)
    if fmt == "safetensors":
        _write_replacing(out, lambda _, path: _save_safetensors(chosen, path, ck))
    else:
        _write_replacing(out, lambda f, _: _save_npz(chosen, f))
    return {"format": fmt, "tensors": len(chosen), "skipped": skipped, "path": out}


_PLAIN_SCALARS = (bool, int, float, complex, str, bytes)


def _weights_only(state: Any, ref: str | None) -> tuple[Any, dict]:
    """``state`` as ``torch.load(weights_only=True)`` reads it back, and the counts of
    what was converted (``{"arrays": n, "scalars": n}``). Numpy arrays become torch
    tensors over the same memory (an array that appears twice becomes one tensor),
    numpy scalars Python numbers; dicts, lists, tuples and sets keep their shape.
    A value that loader refuses and that has no faithful conversion is a UsageError
    naming its path."""
    made: dict[int, Any] = {}          # id(array) -> its tensor
    dtype_at: dict[int, Any] = {}      # storage address -> dtype: torch.save refuses two dtypes at one address
    counts = {"arrays": 0, "scalars": 0}

    def refuse(path: str, what: str):
        return UsageError(f"{path} is {what}, which torch.load(weights_only=True) cannot read", ref=ref,
                          hint="export to .agck or .npz, which keep it")

    def tensor(a: np.ndarray, path: str):
        if _torch_dtype(a) is None:
            raise refuse(path, f"a numpy array of dtype {a.dtype}, which torch lacks")
        if not a.dtype.isnative or any(st < 0 for st in a.strides):
            a = np.ascontiguousarray(a, a.dtype.newbyteorder("="))
        with warnings.catch_warnings():     # a read-only array: torch.save only reads it
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(a)
        if t.numel():
            at = t.untyped_storage().data_ptr()
            if dtype_at.setdefault(at, t.dtype) != t.dtype:
                t = t.clone()          # a view of the same bytes as another dtype: its own copy
        return t

    def conv(x, path: str):
        if isinstance(x, np.ndarray):
            if id(x) not in made:
                made[id(x)] = tensor(x, path)
                counts["arrays"] += 1
            return made[id(x)]
        if isinstance(x, np.generic):
            v = x.item()
            if type(v) not in _PLAIN_SCALARS:
                raise refuse(path, f"a numpy {x.dtype} scalar, which has no Python equivalent")
            counts["scalars"] += 1
            return v
        if isinstance(x, np.dtype):
            raise refuse(path, f"a numpy dtype ({x})")
        if isinstance(x, dict):
            return {conv(k, f"{path} key {k!r}"): conv(v, f"{path}[{k!r}]") for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            items = [conv(v, f"{path}[{i}]") for i, v in enumerate(x)]
            return items if isinstance(x, list) else tuple(items)
        if isinstance(x, frozenset):
            raise refuse(path, "a frozenset")
        if isinstance(x, set):
            return {conv(v, f"{path} item {v!r}") for v in x}
        return x

    return conv(state, "state"), counts


def _unsupported(fmt: str, v) -> str | None:
    """Why ``fmt`` cannot hold ``v``, or None when it can."""
    if fmt == "safetensors":
        dt = _torch_dtype(v) if isinstance(v, np.ndarray) else v.dtype
        ok = dt is not None and any(getattr(torch, n, None) == dt for n in _SAFETENSORS_DTYPES)
        return None if ok else f"dtype {v.dtype} has no safetensors equivalent"
    if isinstance(v, np.ndarray):
        return None
    if str(v.dtype).removeprefix("torch.").startswith(_NO_NUMPY):
        return f"dtype {v.dtype} has no numpy equivalent"
    return None


def _check_size(size: int, ck: Checkpoint, max_bytes: int | None) -> None:
    if max_bytes is None:
        if not ck.nbytes:       # not loaded from a container: no stored size to compare with
            return
        limit, why = EXPANSION_LIMIT * ck.nbytes, f"{EXPANSION_LIMIT}x the checkpoint's {ck.nbytes} stored bytes"
    else:
        limit, why = max_bytes, "max_bytes"
    if size > limit:
        raise UsageError(f"export would write {size} bytes of tensor data, more than {limit} ({why}); "
                         "a tensor may be a view that repeats a few stored bytes", ref=ck.ref,
                         hint="to write it anyway, pass a larger max_bytes: agck export --max-bytes SIZE")


def _write_replacing(out: str, write) -> None:
    """``write(file, path)`` into a new file beside ``out``, then rename it to ``out``.
    An OSError names ``out``, not the temporary file."""
    tmp = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)   # the umask applies, as for any new file
        mode = os.fstat(fd).st_mode
    except OSError as e:
        raise type(e)(e.errno, e.strerror, out) from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f, tmp)
        os.chmod(tmp, stat.S_IMODE(mode))   # a writer that recreates the file by path may narrow it
        os.replace(tmp, out)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError) and e.errno is not None:
            raise type(e)(e.errno, e.strerror, out) from None
        raise


def _save_safetensors(tensors: dict, path: str, ck: Checkpoint) -> None:
    from safetensors.torch import save_file
    as_torch = {k: (torch.from_numpy(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else
                    v.detach().cpu().contiguous()) for k, v in tensors.items()}
    # safetensors refuses tensors that share memory; export gives each its own copy
    seen: set[int] = set()
    for k, t in as_torch.items():
        if t.numel() and t.untyped_storage().data_ptr() in seen:
            as_torch[k] = t.clone()
        elif t.numel():
            seen.add(t.untyped_storage().data_ptr())
    save_file(as_torch, path, metadata={"agck.run": str(ck.run), "agck.step": str(ck.step)})


def _save_npz(tensors: dict, f) -> None:
    """What np.savez writes, without its keyword arguments: a tensor named ``file``
    or ``allow_pickle`` would collide with them."""
    with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for k, v in tensors.items():
            a = v if isinstance(v, np.ndarray) else v.detach().cpu().numpy()
            with zf.open(k + ".npy", "w", force_zip64=True) as fh:
                np.lib.format.write_array(fh, a, allow_pickle=False)
