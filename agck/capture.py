"""The pipeline's state as a tree the codec saves, and back; the process's RNG states.

Contract:

- :func:`capture` turns the user's state into what :func:`agck.codec` encodes: an
  object with ``state_dict()``/``load_state_dict()`` (module, optimizer, scheduler,
  GradScaler) becomes a tagged dict of its state_dict, an RNG generator
  (``random.Random``, ``np.random.Generator``, ``torch.Generator``) a tagged dict of
  its state, a DTensor this rank's local shard with its layout. Everything else is
  returned as it is; plain data (what msgpack packs as is) is checked in C, not
  walked. Capture copies nothing: async snapshots copy in :mod:`agck.staging`.
- :func:`restore_into` merges a loaded tree back into the live state: stateful
  objects, generators, dicts, lists and DTensor shards in place; anything else is
  replaced by the saved value. A saved stateful object or DTensor with no matching
  live one raises :class:`AgckError` / :class:`UsageError` (no resharding).
- :func:`rng_state` / :func:`set_rng_state`: the global RNG states (Python, NumPy,
  torch CPU, and every CUDA device once CUDA is initialized).
- :func:`fingerprint`: the software and hardware a snapshot was taken under, which
  a resume compares (bit-exactness holds only under the same one).

Pure functions of their arguments and the process's RNG; no I/O.
"""

from __future__ import annotations

import platform
import random
import sys
from typing import Any

import numpy as np

from .codec import plain_packed
from .errors import AgckError, UsageError
from .version import __version__

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

TAG = "__agck__"   # marks a captured object inside the saved tree

# immutable leaves: capture returns them as they are, staging never copies them
ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes})
_TENSOR_TYPES = frozenset() if torch is None else frozenset({torch.Tensor, torch.nn.Parameter})
_PASSED = ATOMS | _TENSOR_TYPES | {np.ndarray}     # what capture() returns as it is


def fingerprint() -> dict:
    """The software and hardware this process runs on, as plain data."""
    fp = {"agck": __version__, "python": platform.python_version(), "numpy": np.__version__,
          "machine": platform.machine()}
    if torch is not None:
        fp["torch"] = torch.__version__
        fp["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            fp["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            try:
                fp["driver"] = ".".join(map(str, torch.cuda.driver_version())) \
                    if hasattr(torch.cuda, "driver_version") else None
            except Exception:  # driver query is best effort
                fp["driver"] = None
    return fp


# --- capture and restore ----------------------------------------------------------

def _stateful(x) -> bool:
    return (callable(getattr(x, "state_dict", None)) and callable(getattr(x, "load_state_dict", None))
            and not isinstance(x, (dict, list, tuple)))


def capture(x: Any, segments: list | None = None) -> Any:
    """The user's state as a tree the codec takes: objects with state_dict()
    (modules, optimizers, schedulers, GradScaler) become tagged dicts of their
    state_dict; RNG generators become tagged dicts of their state; an
    :class:`agck.AppendLog` becomes a reference, the segment of its new items going
    to ``segments`` (a snapshotter's, to be written before the checkpoint). Plain data
    (what msgpack packs as is) is returned as it is, checked in C, not walked."""
    t = type(x)
    if t in ATOMS or t is np.ndarray or t in _TENSOR_TYPES:
        return x
    if (t is list or t is dict) and len(x) >= _PLAIN_CHECK_MIN:
        if plain_packed(x) is not None:
            return x
        if t is list and all(map(_PASSED.__contains__, map(type, x))):   # a list of tensors, checked in C
            return x
    if isinstance(x, dict):
        return {k: capture(v, segments) for k, v in x.items()}
    if t is list:
        return [capture(v, segments) for v in x]
    if type(x) is tuple:
        return tuple(capture(v, segments) for v in x)
    if getattr(t, "_agck_log", False):
        return x._capture(segments)
    if isinstance(x, np.random.Generator):
        return {TAG: "np.Generator", "state": x.bit_generator.state}
    if isinstance(x, random.Random):
        return {TAG: "random.Random", "state": x.getstate()}
    if torch is not None and isinstance(x, torch.Generator):
        return {TAG: "torch.Generator", "state": x.get_state(), "device": str(x.device)}
    if torch is not None and isinstance(x, torch.Tensor):
        if _is_dtensor(x):
            # this rank's shard: what the rank owns and restores in place (no resharding)
            return {TAG: "dtensor", "local": x.to_local(), "shape": list(x.shape),
                    "placements": [str(p) for p in x.placements], "mesh": list(x.device_mesh.shape)}
        return x
    if _stateful(x):
        sd = x.state_dict()
        dtensor = _dtensor_class()
        if dtensor is not None and any(isinstance(v, dtensor) for v in _leaves(sd)):
            sd = capture(sd)      # sharded parameters and optimizer state (FSDP2): their local shards
        return {TAG: "stateful", "type": f"{type(x).__module__}.{type(x).__qualname__}", "state": sd}
    return x


def _dtensor_class():
    """DTensor, or None while torch.distributed.tensor is not imported (then there are none:
    no import, no walk)."""
    if "torch.distributed.tensor" not in sys.modules:
        return None
    from torch.distributed.tensor import DTensor
    return DTensor


def _is_dtensor(x) -> bool:
    dtensor = _dtensor_class()
    return dtensor is not None and isinstance(x, dtensor)


def _leaves(x):
    stack = [x]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        else:
            yield v


def _has_tag(x, kind: str) -> bool:
    return any(isinstance(v, dict) and v.get(TAG) == kind for v in _walk_dicts(x))


def _walk_dicts(x):
    stack = [x]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            yield v
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)


def _restore_dtensor(live, saved: dict):
    """A DTensor's local shard, copied back in place; refused when the live DTensor is
    laid out otherwise (another shape, placement or mesh: that needs resharding)."""
    if not _is_dtensor(live):
        raise AgckError(f"the checkpoint holds a DTensor shard but the live state has {type(live).__name__} "
                        "there", hint="pass the same state structure on resume")
    now = {"shape": list(live.shape), "placements": [str(p) for p in live.placements],
           "mesh": list(live.device_mesh.shape)}
    was = {k: saved.get(k) for k in now}
    if now != was:
        raise UsageError(f"a DTensor was saved as {was} and is now {now}: a snapshot restores each rank's own "
                         "shard and cannot reshard it",
                         hint="resume with the same mesh and placements, or save it through agck.dcp")
    local = live.to_local()
    src = saved["local"]
    if tuple(src.shape) != tuple(local.shape):
        raise UsageError(f"this rank's DTensor shard is {tuple(local.shape)}, the saved one "
                         f"{tuple(src.shape)}", hint="resume with the same world size and mesh")
    with torch.no_grad():
        local.copy_(src)
    return live


_PLAIN_CHECK_MIN = 32


def restore_into(live: Any, saved: Any) -> Any:
    """Merge a loaded tree into the user's live state. Stateful objects and
    generators are restored in place; dicts are updated in place; anything
    else is replaced by the saved value. Returns the restored state."""
    if isinstance(saved, dict) and TAG in saved:
        kind = saved[TAG]
        if kind == "stateful" and live is not None and _stateful(live):
            state = saved["state"]
            if _has_tag(state, "dtensor"):
                # sharded state: copy each shard into the live state_dict's DTensors, then load that
                state = restore_into(live.state_dict(), state)
            live.load_state_dict(state)
            return live
        if kind == "dtensor":
            return _restore_dtensor(live, saved)
        if kind == "np.Generator":
            g = live if isinstance(live, np.random.Generator) else np.random.default_rng()
            g.bit_generator.state = saved["state"]
            return g
        if kind == "random.Random":
            g = live if isinstance(live, random.Random) else random.Random()
            g.setstate(saved["state"])
            return g
        if kind == "torch.Generator" and torch is not None:
            g = live if isinstance(live, torch.Generator) else torch.Generator(device=saved.get("device", "cpu"))
            g.set_state(saved["state"])
            return g
        if kind == "stateful":
            raise AgckError(f"the checkpoint holds the state of a {saved.get('type')} but the live state has "
                            f"{type(live).__name__} there", hint="pass the same state structure on resume")
    if torch is not None and isinstance(saved, torch.Tensor) and isinstance(live, torch.Tensor):
        return saved.to(live.device) if saved.device != live.device else saved
    if isinstance(saved, dict) and isinstance(live, dict):
        for k in list(live.keys()):
            if k not in saved:
                del live[k]
        for k, v in saved.items():
            live[k] = restore_into(live.get(k), v)
        return live
    if type(saved) is list and type(live) is list and len(saved) == len(live):
        live[:] = [restore_into(a, b) for a, b in zip(live, saved)]
        return live
    if type(saved) is tuple and type(live) is tuple and len(saved) == len(live):
        return tuple(restore_into(a, b) for a, b in zip(live, saved))
    return _plain(saved)


def _plain(x):
    """A saved subtree with no live counterpart: rebuild tagged objects fresh."""
    if isinstance(x, dict):
        if TAG in x:
            return restore_into(None, x)
        return {k: _plain(v) for k, v in x.items()}
    if type(x) is list:
        return [_plain(v) for v in x]
    if type(x) is tuple:
        return tuple(_plain(v) for v in x)
    return x


def rng_state() -> dict:
    st = {"python": random.getstate(), "numpy": np.random.get_state()}
    if torch is not None:
        st["torch"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    if "python" in st:
        random.setstate(st["python"])
    if "numpy" in st:
        np.random.set_state(st["numpy"])
    if torch is not None:
        if "torch" in st:
            torch.set_rng_state(st["torch"])
        if "cuda" in st and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(st["cuda"])

