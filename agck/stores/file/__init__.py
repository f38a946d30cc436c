"""The embedded default store: a directory of AGCK files.

    store.py     FileStore: the checkpoints, their commits and fencing
    objects.py   the chunks the checkpoints share, one file each, by address
    log.py       the journal and AppendLog records, one append-only file per run

``FileStore`` is importable from here; the modules load when first used.
"""


def __getattr__(name: str):
    if name == "FileStore":
        from .store import FileStore
        return FileStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
