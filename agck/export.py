"""Export a checkpoint's tensors to formats other tools read.

``.safetensors`` and ``.npz`` hold flat maps of tensors: the state tree is
flattened into dotted keys (``model.layers.3.weight``) and non-tensor values
are skipped (and listed). ``.pt`` is ``torch.save`` of the whole state.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .checkpoint import Checkpoint
from .errors import AgckError

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None


def flatten(state: Any, prefix: str = "") -> tuple[dict[str, Any], list[str]]:
    """(dotted key -> array/tensor, keys of skipped non-tensor leaves)."""
    tensors: dict[str, Any] = {}
    skipped: list[str] = []

    def walk(x, key):
        if isinstance(x, np.ndarray) or (torch is not None and isinstance(x, torch.Tensor)):
            tensors[key] = x
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{key}.{i}" if key else str(i))
        else:
            skipped.append(key or "<root>")

    walk(state, prefix)
    return tensors, skipped


def export(ck: Checkpoint, out: str) -> dict:
    ext = os.path.splitext(out)[1].lower()
    if ext == ".pt":
        if torch is None:
            raise AgckError("exporting to .pt needs torch", hint="pip install torch")
        torch.save(ck.state, out)
        tensors, skipped = flatten(ck.state)
        return {"format": "pt", "tensors": len(tensors), "skipped": [], "path": out}
    tensors, skipped = flatten(ck.state)
    if ext == ".safetensors":
        if torch is None:
            raise AgckError("exporting to .safetensors needs torch", hint="pip install torch")
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
        meta = {"agck.run": str(ck.run), "agck.step": str(ck.step)}
        save_file(as_torch, out, metadata=meta)
        return {"format": "safetensors", "tensors": len(as_torch), "skipped": skipped, "path": out}
    if ext == ".npz":
        arrays = {}
        for k, v in tensors.items():
            if isinstance(v, np.ndarray):
                arrays[k] = v
            else:
                t = v.detach().cpu()
                if t.dtype in (torch.bfloat16,) or "float8" in str(t.dtype) or t.dtype == torch.complex32:
                    skipped.append(f"{k} (dtype {t.dtype} has no numpy equivalent)")
                    continue
                arrays[k] = t.numpy()
        np.savez(out, **arrays)
        return {"format": "npz", "tensors": len(arrays), "skipped": skipped, "path": out}
    raise AgckError(f"unknown export format {ext or out!r}", hint="use .safetensors, .pt or .npz")
