"""The store in an S3-compatible bucket, with conditional-write commits.

    store.py     S3Store: the layout, the commits, the collector and its locks
    log.py       a run's commit records and their fold (the run's listing)
    journal.py   the journal and AppendLog, one object per batch
    client.py    the object-store client: URLs, credentials, timeouts, errors
    chunks.py    the chunks the checkpoints share, by address (the Postgres catalog uses them too)

``S3Store`` is importable from here; the modules load when first used.
"""


def __getattr__(name: str):
    if name == "S3Store":
        from .store import S3Store
        return S3Store
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
