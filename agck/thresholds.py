"""The sizes at which agck changes what it does, all in one place.

A path that only a large (or only a small) checkpoint takes starts at one of
these sizes: a container kept inside its commit record, a put written in one
statement, a chunk grid, reads made in parallel, a direct write, the probe of a
large listing, a checkpoint split over several SQL rows. Each is declared here
once, with what changes at it; the modules that act on it take it from here.

``tests/test_thresholds.py`` puts a checkpoint a little below and a little
above every size in :data:`ALL`, on every backend, incremental and whole,
through ``put`` and through the Snapshotter, and reads each back through the
same and a fresh store object, ``agck verify`` and recovery. It also fails when
a size constant (``n << 10``, ``n << 20``, ``n << 30``) appears anywhere else in
the package, so no new size can change behaviour without a round trip across it.
A size on a line marked ``# not a threshold:`` is a limit or a count (the
largest metadata a reader accepts, a number of ranks), checked by the tests of
its own rules instead.
"""

from __future__ import annotations

KiB = 1 << 10
MiB = 1 << 20


# -- the size of a stored container --------------------------------------------------
#: s3: a container up to this size is kept inside its commit record (one request per put).
INLINE_RECORD = 64 * KiB
#: every incremental store: a container smaller than this is stored standalone, not split
#: into chunks (splitting would cost more writes than sharing could save).
MIN_CHUNKED = 64 * KiB
#: ... unless the store compresses: then from this size (chunks compress, and the containers of
#: a growing conversation share their prefix; BENCHMARKS.md, "Compressed chunks in the stores").
MIN_CHUNKED_COMPRESSED = 4 * KiB
#: Postgres: a standalone container up to this size is written in one statement ...
SMALL_PUT = 256 * KiB
#: ... and read in one statement.
SMALL_READ = 256 * KiB
#: SQLite and Postgres, whole mode: a container up to this size is assembled in memory
#: before it is written; a larger one is streamed into its rows.
ASSEMBLED_MAX = 1 * MiB
#: every chunked read: a listing this long is read and hashed on several threads.
PARALLEL_READ = 16 * MiB
#: file store and ``agck.save``: a container this large is written with direct I/O.
DIRECT_WRITE = 32 * MiB
#: every chunked read: before a buffer this large is allocated, the listing's first chunk
#: must be in the store at its listed size (a forged listing cannot claim terabytes).
LISTING_PROBE = 64 * MiB
#: SQLite and Postgres, whole mode: a container is split into rows of this size.
SQL_CHUNK_ROW = 64 * MiB
#: Postgres: a journal batch this large is sent by binary COPY (no hex-escaped bytea in the statement).
JOURNAL_COPY = 64 * KiB
#: s3: an object this large goes up as a multipart upload ...
MULTIPART_MIN = 16 * MiB
#: ... in parts of this size.
MULTIPART_PART = 8 * MiB

# -- the size of a blob or a chunk ---------------------------------------------------
#: content-defined chunk sizes (min, average, max) of metadata ...
HEAD_CHUNKS = (4 * KiB, 16 * KiB, 64 * KiB)
#: ... and of runs of small blobs.
SMALL_CHUNKS = (16 * KiB, 64 * KiB, 256 * KiB)
#: large blobs are cut on a fixed grid of this size (file, SQLite, Postgres) ...
LARGE_GRID = 1 * MiB
#: ... and a blob this large is a piece of its own, cut on that grid.
LARGE_PART = 4 * MiB
#: s3 and the Postgres catalog over a bucket: the grid large blobs are cut on (one request a chunk).
OBJECT_GRID = 8 * MiB
#: file store: a chunk this large is written straight to its own file.
DIRECT_CHUNK_FILE = 256 * KiB
#: direct writes: an aligned run this long is written from where it is (no staging copy).
ALIGNED_RUN = 256 * KiB

# -- how a large buffer is worked through --------------------------------------------
#: direct writes: this many bytes at a time through the aligned buffer ...
DIRECT_SLICE = 8 * MiB
#: ... and the kernel asked to write back every this many bytes of a buffered write.
WRITEBACK_EVERY = 8 * MiB
#: copy-then-hash granularity of a direct write (the slice is still in cache when hashed).
HASH_SLICE = 256 * KiB
#: hash-while-writing granularity of a container write.
HASH_WRITE_SLICE = 1 * MiB
#: the largest single write(2) of a container (one giant write is throttled by some kernels).
WRITE_SLICE = 1 * MiB
#: memory: a fill or copy this large is spread over threads ...
PARALLEL_FILL = 64 * MiB
#: ... in tasks of this size ...
FILL_TASK = 8 * MiB
#: ... a buffer this large is pre-faulted (smaller ones take malloc's recycled pages) ...
POPULATE_MIN = 1 * MiB
#: ... and copied then hashed this many bytes at a time.
COPY_HASH_SLICE = 512 * KiB
#: GPU staging: a pinned buffer this large is touched ahead of its first copy.
TOUCH_MIN = 1 * MiB
#: Postgres: COPY reads and writes this many bytes at a time.
COPY_IO = 4 * MiB
#: s3: an object is streamed down in blocks of at least this size.
STREAM_BLOCK = 4 * MiB
#: Hugging Face files are hashed this many bytes at a time.
HF_READ = 8 * MiB
#: LangGraph saver: a value this large is a checkpoint entry of its own.
LANGGRAPH_OWN_ENTRY = 64 * KiB


def _declared() -> dict[str, int]:
    out = {}
    for name, value in list(globals().items()):
        if not name.isupper() or name in ("KiB", "MiB") or not isinstance(value, (int, tuple)):
            continue
        if isinstance(value, tuple):
            out.update((f"{name}[{i}]", v) for i, v in enumerate(value))
        else:
            out[name] = value
    return out


#: every size above by name (a tuple's members each on their own)
ALL: dict[str, int] = _declared()

#: the distinct sizes of :data:`ALL`, ascending: where a round trip must cross
SIZES: tuple[int, ...] = tuple(sorted(set(ALL.values())))
