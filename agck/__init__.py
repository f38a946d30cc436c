"""agck: crash-safe binary checkpoints for long GPU pipelines.

    import agck
    agck.save("model.agck", {"weights": tensor, "step": 10})
    ckpt = agck.load("model.agck")        # verified: every byte checksummed
"""

from .checkpoint import Checkpoint, dumps, inspect, load, loads, save
from .errors import (AgckError, CheckpointExistsError, CheckpointNotFoundError, CorruptCheckpointError,
                     DependencyError, DurabilityError, EncodeError, FormatError, InvalidRunNameError, MalformedCheckpointError,
                     NoValidCheckpointError, SchemaMismatchError, SchemaUninitializedError, SnapshotError,
                     StoreConnectionError, StoreError, UnsupportedVersionError)

__version__ = "0.1.0"

__all__ = [
    "Checkpoint", "dumps", "loads", "save", "load", "inspect",
    "AgckError", "DependencyError", "FormatError", "UnsupportedVersionError", "CorruptCheckpointError", "MalformedCheckpointError",
    "EncodeError", "StoreError", "StoreConnectionError", "SchemaUninitializedError", "SchemaMismatchError",
    "CheckpointNotFoundError", "CheckpointExistsError", "DurabilityError", "InvalidRunNameError",
    "NoValidCheckpointError", "SnapshotError",
]

from .recovery import Recovery, recover  # noqa: E402
from .stores import open_store  # noqa: E402

__all__ += ["open_store", "recover", "Recovery", "Snapshotter", "checkpoint_every"]


def __getattr__(name: str):
    # The snapshotter captures torch RNG and CUDA state, so it imports torch (about
    # a second); load it on first use, keeping `import agck` and the CLI fast.
    if name in ("Snapshotter", "checkpoint_every"):
        from . import snapshot
        return getattr(snapshot, name)
    raise AttributeError(f"module 'agck' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | {"Snapshotter", "checkpoint_every"})
