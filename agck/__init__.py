"""agck: crash-safe binary checkpoints for long GPU pipelines.

    import agck
    agck.save("model.agck", {"weights": tensor, "step": 10})
    ckpt = agck.load("model.agck")        # verified: every byte checksummed
"""

from .checkpoint import Checkpoint, dumps, inspect, load, loads, save
from .errors import (AgckError, CheckpointExistsError, CheckpointNotFoundError, ContentChangedError, CorruptCheckpointError,
                     DependencyError, DurabilityError, EncodeError, EncryptionKeyError, FormatError, InvalidRunNameError,
                     MalformedCheckpointError, NoValidCheckpointError, SchemaMismatchError, SchemaUninitializedError, SnapshotError, StaleEpochError,
                     StoreConnectionError, StoreError, UnsupportedVersionError, UsageError)

from .version import __version__  # noqa: E402

__all__ = [
    "Checkpoint", "dumps", "loads", "save", "load", "inspect",
    "AgckError", "DependencyError", "EncryptionKeyError", "FormatError", "UnsupportedVersionError", "CorruptCheckpointError", "MalformedCheckpointError",
    "EncodeError", "StoreError", "StoreConnectionError", "SchemaUninitializedError", "SchemaMismatchError",
    "CheckpointNotFoundError", "CheckpointExistsError", "ContentChangedError", "DurabilityError", "InvalidRunNameError",
    "NoValidCheckpointError", "SnapshotError", "StaleEpochError", "UsageError",
]

from .recovery import POLICIES as _POLICIES, Recovery, Rejection  # noqa: E402
from .stores import Store, open_store  # noqa: E402
from .applog import AppendLog  # noqa: E402
from .journal import Journal  # noqa: E402
from .stores.tiered import TieredStore  # noqa: E402

Store.policies = _POLICIES   # store.get(run) and store.prune: the walk-back above the store floor


def recover(store, run: str | None = None, *, map_location=None, strict: bool = False):
    """Recover ``run`` and return a :class:`Recovery`; with ``run=None``, recover
    every run of the store and return ``{run: Recovery}``.

    ``store`` may be a Store or a URL. ``rec.checkpoint`` is the newest
    checkpoint that verifies (None if none does, or raise with ``strict``);
    ``rec.rejected`` lists every newer one refused, with ref and reason."""
    from .recovery import recover_run
    own = not isinstance(store, Store)
    s = open_store(store, create=False) if own else store
    try:
        if run is not None:
            return recover_run(s, run, map_location=map_location, strict=strict)
        return {r: recover_run(s, r, map_location=map_location, strict=strict) for r in s.runs()}
    finally:
        if own:
            s.close()

__all__ += ["open_store", "recover", "AppendLog", "Journal", "Recovery", "Rejection", "Snapshotter", "checkpoint_every",
            "TieredStore"]


def __getattr__(name: str):
    # The snapshotter captures torch RNG and CUDA state, so it imports torch (about
    # a second); load it on first use, keeping `import agck` and the CLI fast.
    if name in ("Snapshotter", "checkpoint_every"):
        from . import snapshot
        return getattr(snapshot, name)
    raise AttributeError(f"module 'agck' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | {"Snapshotter", "checkpoint_every"})
