"""The SQLite store: checkpoints as chunk rows and a manifest row in one database file.

    store.py     SqliteStore: the tables, the reads, the writes and the logs

``SqliteStore`` is importable from here; the module loads when first used.
"""


def __getattr__(name: str):
    if name == "SqliteStore":
        from .store import SqliteStore
        return SqliteStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
