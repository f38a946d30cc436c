"""The agck error family.

Every error a user can hit derives from :class:`AgckError`. Each carries
``ref`` (where: a path, a ``run/step`` pair, a table row) and ``hint`` (what to
do), and its message says all three: what happened, where, what to do.
"""

from __future__ import annotations


class AgckError(Exception):
    """Base of every error agck raises on purpose.

    ``verdict`` (a property of the class) says whether the error judges a
    checkpoint's own bytes (damaged, truncated, malformed, not a container at
    all), so recovery may walk back past that checkpoint to an earlier one. Any
    other error says nothing about the checkpoint (a missing torch, an
    unreachable server, a format newer than this reader) and is raised, never
    walked past."""

    default_hint: str | None = None
    verdict = False

    def __init__(self, message: str, *, ref: str | None = None, hint: str | None = None):
        self.reason = message
        self.ref = ref
        self.hint = hint if hint is not None else self.default_hint
        super().__init__(message)

    def __str__(self) -> str:
        text = f"{self.ref}: {self.reason}" if self.ref else self.reason
        if self.hint:
            text += f" ({self.hint})"
        # one line, safe for a terminal: a name or a path from the caller or a store may hold
        # newlines, escapes or bidi overrides; they are shown escaped, as Python writes them
        return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)

    def at(self, ref: str) -> "AgckError":
        """Attach a location if none is set yet; returns self for ``raise e.at(...)``."""
        if not self.ref:
            self.ref = ref
        return self


# --- the container ---------------------------------------------------------------

class FormatError(AgckError):
    """The bytes are not an AGCK container this reader can read."""

    default_hint = "check that this is an .agck checkpoint written by agck"
    verdict = True


class UnsupportedVersionError(FormatError):
    """A well-formed container of a major version this reader does not know. Not a
    verdict: this reader cannot judge it, and resuming from an older checkpoint
    would overwrite the newer run."""

    default_hint = "upgrade agck to read this checkpoint"
    verdict = False


class CorruptCheckpointError(AgckError):
    """A container failed verification: checksum mismatch, truncation, bad index.

    ``section`` names the part that failed (``header``, ``metadata``, ``payload``,
    ``footer``, ``blob``, ``tensor``); ``tensor`` names the tensor or blob when one did.
    """

    default_hint = "this checkpoint cannot be trusted; recover an earlier one (agck recover)"
    verdict = True

    def __init__(self, message: str, *, ref: str | None = None, hint: str | None = None,
                 section: str | None = None, tensor: str | None = None):
        super().__init__(message, ref=ref, hint=hint)
        self.section = section
        self.tensor = tensor


class MalformedCheckpointError(CorruptCheckpointError):
    """Checksums match but the structure is invalid (hostile or buggy writer)."""


class DamagedChunkError(CorruptCheckpointError):
    """A chunked checkpoint cannot be rebuilt: chunks it lists are missing from the
    store, or hold bytes that do not match their address. ``damaged`` and
    ``missing`` are the addresses (32 bytes each). The store that raised it has
    quarantined them, so the next put holding their content writes it afresh,
    which also heals every checkpoint listing them (README, "Damaged chunks")."""

    def __init__(self, message: str, *, ref: str | None = None, hint: str | None = None,
                 damaged: tuple = (), missing: tuple = ()):
        super().__init__(message, ref=ref, hint=hint, section="chunk")
        self.damaged = tuple(damaged)
        self.missing = tuple(missing)


class EncryptionKeyError(AgckError):
    """An encrypted store was opened without a key, or with one that opens none of its
    key slots (FORMAT.md 18.6): nothing was decrypted, and no verdict is made on any
    checkpoint."""


class DependencyError(AgckError):
    """A library this checkpoint needs (torch) is missing or broken here. Says
    nothing about the checkpoint: recovery does not walk back past it."""

    default_hint = "install it (pip install torch==2.13.0) or load on a machine where `import torch` works"


class UsageError(AgckError, ValueError):
    """An argument agck cannot honour here: a ``map_location`` naming a device
    this machine lacks, a step that is not an integer, an option of the wrong
    type. Says nothing about any checkpoint: recovery never walks back past it
    and retention never deletes because of it."""

    default_hint = "fix the argument; the checkpoint itself was not judged"


class EncodeError(AgckError, TypeError):
    """A value in the state cannot be encoded; the message names its path."""

    default_hint = None


# --- stores ------------------------------------------------------------------------

class StoreError(AgckError):
    """A store operation failed."""


class StoreConnectionError(StoreError):
    """The store cannot be opened or reached."""

    default_hint = "check the URL, that the server is running, and the credentials"


class SchemaUninitializedError(StoreError):
    """The store's schema does not exist yet."""

    default_hint = "run `agck db init DSN` (or store.init_schema())"


class SchemaMismatchError(StoreError):
    """The store's schema has a version this agck does not use."""

    default_hint = "run `agck db migrate DSN`, or use the agck version that created it"


class CheckpointNotFoundError(StoreError, KeyError):
    """No checkpoint at that run/step."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return AgckError.__str__(self)


class CheckpointExistsError(StoreError):
    """A checkpoint already exists at that run/step, and the write was told not to
    replace it (``overwrite=False``; a put replaces by default)."""

    default_hint = "delete it first or use another step (a put without overwrite=False replaces it)"

    @classmethod
    def refused(cls, ref: str, step: int | None = None) -> "CheckpointExistsError":
        """A put or save with ``overwrite=False`` onto an existing checkpoint."""
        at = f"at step {step}" if step is not None else "at this path"
        return cls(f"a checkpoint already exists {at}, and overwrite=False refuses to replace it", ref=ref)


class DurabilityError(StoreError):
    """A write could not be made durable (failed write, fsync, commit)."""

    default_hint = "the previous checkpoint is untouched; fix the storage and retry"


class ContentChangedError(StoreError):
    """A put was told that some tensors were not copied because they had not changed
    since the run's last checkpoint (``expect_unchanged``), and their bytes differ
    from that checkpoint's: they changed without the signal that said they had
    not, or while being written. Nothing was written."""

    default_hint = "put the state again with its tensors copied (Snapshotter does so by itself)"

    def __init__(self, message: str, *, ref: str | None = None, hint: str | None = None,
                 addresses: list[int] | None = None):
        super().__init__(message, ref=ref, hint=hint)
        self.addresses = list(addresses or [])   # the memory addresses of the tensors found changed, where known


class StaleEpochError(StoreError):
    """A writer of an older incarnation of a run tried to commit a checkpoint after a
    newer incarnation began (:meth:`Store.begin_epoch`): a job left running after the
    run was restarted elsewhere. Nothing was committed."""

    default_hint = "another process has taken this run over; stop this one"


class InvalidRunNameError(StoreError, ValueError):
    """A run name that could escape the store or is otherwise unusable."""

    default_hint = "use 1-200 characters of letters, digits, '.', '_', '-', ':', '@', '+', '='"


# --- recovery and snapshots --------------------------------------------------------

class NoValidCheckpointError(AgckError):
    """Recovery found no checkpoint that verifies. ``report`` lists every rejection."""

    default_hint = "nothing to resume from; start the run over"

    def __init__(self, message: str, *, ref: str | None = None, hint: str | None = None,
                 report=None):
        super().__init__(message, ref=ref, hint=hint)
        self.report = report


class SnapshotError(AgckError):
    """A background snapshot failed to persist; the previous checkpoint is untouched."""
