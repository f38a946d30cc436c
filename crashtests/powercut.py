"""Power loss under programs that do their own I/O in C: an LD_PRELOAD shim and its cut.

``powercut.c`` is preloaded into a program (SQLite through ``sqlite3``, a
PostgreSQL server with all its processes) with :func:`env`. It appends to a log
every change to a regular file under the tracked directory, with the bytes the
change overwrites, before making it, and every successful fsync/fdatasync of a
tracked file or directory after it. Once every writer has been SIGKILLed,
:func:`cut` rebuilds the files as a power cut would have left them, the way
LazyFS does without FUSE: per file, every write and size change after the
file's last sync is unsynced; the file is taken back to its last synced content
(the unsynced ops reverted newest first, from their recorded old bytes) and a
choice of the unsynced ops is applied again in log order:

* ``drop``    none of them;
* ``prefix``  a random prefix of them (per file);
* ``torn``    a random prefix, and the next write applied only up to a 512-byte
              sector boundary of the file inside it (none of it when it lies in
              one sector: a sector is written whole or not at all);
* ``subset``  each one with probability 1/2 (disks reorder).

Writes made with O_SYNC/O_DSYNC (or RWF_DSYNC) are durable once they returned and
are always kept. A file created (O_CREAT) whose creation was not made durable is
deleted under ``drop``, and with probability 1/2 under the other modes. What makes
it durable is the ``dirs`` rule of :func:`cut`: ``"linux"`` (the default) a later
fsync of its directory or of the file itself, as ext4, xfs and btrfs commit a new
file's directory entry with its first fsync; ``"posix"`` only a fsync of its
directory, all that POSIX promises.

Limits (each lenient: the change counts as durable at once): renames, unlinks,
mkdir and links; writes through mmap, stdio (fwrite), sendfile, splice,
copy_file_range and raw syscalls; fallocate's COLLAPSE/INSERT_RANGE. A cut
assumes the files hold what the logged ops made of them: nothing else may write
under the directory while a log is being kept.

Log format (native byte order; read on the machine that wrote it; kept in step
with ``powercut.c``, whose header comment is the reference): the 8 bytes
``b"AGCKPC" + bytes([VERSION]) + b"\\n"``, then records. Each record is a 32-byte
head (u32 magic 0x52435041, u8 type, u8 flags, u16 0, u32 pid, u32 0, u64 seq,
u64 length of the whole record), a body, and a trailer u64 ``length ^
0x5A17C0DE5A17C0DE``. Bodies:

=========  ============================================================================
1 WRITE    u64 dev, ino; i64 offset; u64 length, old size, pre length; the old bytes
           at [offset, offset + length) below the old size; the data (none: ZEROS)
2 TRUNC    u64 dev, ino, old size, new size, tail length; the removed tail
3 SYNC     u64 dev, ino (a file or directory whose fsync/fdatasync returned 0)
4 CREATE   u64 dev, ino, parent dev, parent ino, path length; the path
5 RESULT   i64 result: the WRITE/TRUNC of the same pid and seq failed (-1: it never
           happened), or wrote only ``result`` bytes
6 SYNCFS   u64 dev: syncfs() of that file system; sync() with flag ALL
=========  ============================================================================

Flags: 1 ZEROS, 2 NOPRE (old bytes unknown: the op cannot be reverted), 4 SYNCIO
(durable once returned), 8 ALL. A record torn by a SIGKILL in the middle of its
append (the trailer does not match) is skipped: its op had not been made.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass

VERSION = 1
HEADER = b"AGCKPC" + bytes([VERSION]) + b"\n"
MODES = ("drop", "prefix", "torn", "subset")
SECTOR = 512

MAGIC = 0x52435041
TRAIL_XOR = 0x5A17C0DE5A17C0DE
WRITE, TRUNC, SYNC, CREATE, RESULT, SYNCFS = 1, 2, 3, 4, 5, 6
ZEROS, NOPRE, SYNCIO, ALL = 1, 2, 4, 8

_HEAD = struct.Struct("=IBBHIIQQ")
_TRAIL = struct.Struct("=Q")
_BODY = {WRITE: struct.Struct("=QQqQQQ"), TRUNC: struct.Struct("=QQQQQ"), SYNC: struct.Struct("=QQ"),
         CREATE: struct.Struct("=QQQQQ"), RESULT: struct.Struct("=q"), SYNCFS: struct.Struct("=Q")}
_MIN = _HEAD.size + _TRAIL.size
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "powercut.c")


def _static_reason() -> str | None:
    if not sys.platform.startswith("linux"):
        return "the power-cut shim needs Linux (LD_PRELOAD, /proc/self/fd)"
    if not os.path.isdir("/proc/self/fd"):
        return "/proc is not mounted"
    if not shutil.which("gcc"):
        return "gcc not found"
    return None


def available() -> str | None:
    """None when the shim can be built and preloaded here, else the reason it cannot."""
    reason = _static_reason()
    if reason:
        return reason
    try:
        library()
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return f"the power-cut shim does not build: {e}"
    return None


def library() -> str:
    """The path of the compiled shim, built once per source version.

    Cached as ``<tempdir>/agck-powercut-<hash>.so``, the hash covering the source
    and the compiler command; written to a temporary name and renamed into place,
    so concurrent builders never load a half-written file. A cached file owned by
    another user, or writable by group or others, is rebuilt rather than loaded.
    """
    reason = _static_reason()
    if reason:
        raise RuntimeError(reason)
    with open(SOURCE, "rb") as f:
        src = f.read()
    cmd = ["gcc", "-O2", "-shared", "-fPIC"]
    digest = hashlib.sha256(src + b"\0" + " ".join(cmd).encode()).hexdigest()[:16]
    out = os.path.join(tempfile.gettempdir(), f"agck-powercut-{digest}.so")
    try:
        st = os.lstat(out)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022:
            return out
    except FileNotFoundError:
        pass
    fd, tmp = tempfile.mkstemp(prefix="agck-powercut-", suffix=".so.tmp")
    os.close(fd)
    try:
        r = subprocess.run([*cmd, "-o", tmp, SOURCE, "-ldl"], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(r.stderr.strip()[-2000:] or f"gcc exited with {r.returncode}")
        # readable by the other users a shimmed program may run as (postgres)
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def env(base_env: dict, dir: str, log: str) -> dict:
    """``base_env`` plus what preloads the shim: LD_PRELOAD (put before any there),
    AGCK_POWERCUT_DIR (``dir``, resolved) and AGCK_POWERCUT_LOG (``log``, absolute).

    Creates ``log`` with its header when it is missing or empty. ``dir`` must
    exist; a program running as another user needs write access to ``log``.
    """
    if not os.path.isdir(dir):
        raise ValueError(f"not a directory: {dir}")
    log = os.path.abspath(log)
    with open(log, "ab") as f:
        if f.tell() == 0:
            f.write(HEADER)
    e = dict(base_env)
    old = e.get("LD_PRELOAD", "")
    e["LD_PRELOAD"] = library() + (":" + old if old else "")
    e["AGCK_POWERCUT_DIR"] = os.path.realpath(dir)
    e["AGCK_POWERCUT_LOG"] = log
    return e


@dataclass
class Record:
    """One log record; ``pre`` and ``data`` are views into the log's bytes."""
    type: int
    flags: int
    pid: int
    seq: int
    at: int                # its index in the log
    dev: int = 0
    ino: int = 0
    offset: int = 0        # WRITE: where
    length: int = 0        # WRITE: data length
    old: int = 0           # WRITE, TRUNC: the size before
    new: int = 0           # TRUNC: the size after
    pre: memoryview = memoryview(b"")     # WRITE: old bytes; TRUNC: the removed tail
    data: memoryview = memoryview(b"")    # WRITE: the bytes written (empty with ZEROS)
    pdev: int = 0          # CREATE: the parent directory
    pino: int = 0
    path: str = ""         # CREATE
    result: int = 0        # RESULT
    void: bool = False     # a RESULT said the op never happened


def read_log(log: str) -> tuple[list[Record], int]:
    """The records of ``log`` in order, and the count of bytes skipped as torn records."""
    with open(log, "rb") as f:
        buf = f.read()
    if not buf:
        return [], 0
    if buf[:6] != HEADER[:6] or len(buf) < len(HEADER):
        raise ValueError(f"{log}: not a power-cut log")
    if buf[6] != VERSION:
        raise ValueError(f"{log}: log version {buf[6]}, this reader knows {VERSION}")
    mv = memoryview(buf)
    out: list[Record] = []
    pos, skipped, end = len(HEADER), 0, len(buf)
    while pos < end:
        rec = _parse(mv, pos, end)
        if rec is None:
            # torn by a SIGKILL mid-append: resume at the next whole record
            nxt = _resync(mv, buf, pos + 1, end)
            skipped += nxt - pos
            pos = nxt
            continue
        rec[0].at = len(out)
        out.append(rec[0])
        pos += rec[1]
    return out, skipped


def _whole(mv: memoryview, pos: int, end: int) -> int:
    """The length of the whole record at ``pos``, or 0 when there is none."""
    if end - pos < _MIN:
        return 0
    magic, typ, _, _, _, _, _, length = _HEAD.unpack_from(mv, pos)
    if magic != MAGIC or typ not in _BODY or length < _MIN + _BODY[typ].size or length > end - pos:
        return 0
    (trail,) = _TRAIL.unpack_from(mv, pos + length - 8)
    return length if trail == length ^ TRAIL_XOR else 0


def _resync(mv: memoryview, buf: bytes, pos: int, end: int) -> int:
    magic = struct.pack("=I", MAGIC)
    while True:
        pos = buf.find(magic, pos)
        if pos < 0:
            return end
        if _whole(mv, pos, end):
            return pos
        pos += 1


def _parse(mv: memoryview, pos: int, end: int) -> tuple[Record, int] | None:
    length = _whole(mv, pos, end)
    if not length:
        return None
    _, typ, flags, _, pid, _, seq, _ = _HEAD.unpack_from(mv, pos)
    body = _BODY[typ]
    at = pos + _HEAD.size
    f = body.unpack_from(mv, at)
    at += body.size
    stop = pos + length - 8
    r = Record(typ, flags, pid, seq, 0)
    if typ == WRITE:
        r.dev, r.ino, r.offset, r.length, r.old, prelen = f
        r.pre = mv[at:at + prelen]
        r.data = mv[at + prelen:stop]
        if len(r.pre) != prelen or len(r.data) != (0 if flags & ZEROS else r.length):
            return None
    elif typ == TRUNC:
        r.dev, r.ino, r.old, r.new, tlen = f
        r.pre = mv[at:stop]
        if len(r.pre) != tlen:
            return None
    elif typ == SYNC:
        r.dev, r.ino = f
    elif typ == CREATE:
        r.dev, r.ino, r.pdev, r.pino, plen = f
        if stop - at != plen:
            return None
        r.path = bytes(mv[at:stop]).decode("utf-8", "surrogateescape")
    elif typ == RESULT:
        (r.result,) = f
    elif typ == SYNCFS:
        (r.dev,) = f
    return r, length


def _fix(op: Record, res: Record) -> None:
    """Apply a RESULT to the op it names."""
    if res.result < 0:
        op.void = True
        return
    if op.type == WRITE and res.result < op.length:
        op.length = res.result
        op.pre = op.pre[:max(0, min(op.length, op.old - op.offset))]
        if not op.flags & ZEROS:
            op.data = op.data[:op.length]


def _inodes(root: str) -> tuple[dict, dict]:
    """(dev, ino) of every regular file under ``root`` -> its path; path of every directory -> (dev, ino)."""
    files, dirs = {}, {}
    st = os.lstat(root)
    dirs[root] = (st.st_dev, st.st_ino)
    for parent, dnames, fnames in os.walk(root):
        for n in dnames:
            p = os.path.join(parent, n)
            st = os.lstat(p)
            dirs[p] = (st.st_dev, st.st_ino)
        for n in fnames:
            p = os.path.join(parent, n)
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode):
                files.setdefault((st.st_dev, st.st_ino), p)
    return files, dirs


def _pwrite_all(fd: int, data, off: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, off)
        view, off = view[n:], off + n


def _write_zeros(fd: int, off: int, n: int) -> None:
    chunk = bytes(min(n, 1 << 20))
    while n > 0:
        k = min(n, len(chunk))
        _pwrite_all(fd, memoryview(chunk)[:k], off)
        off, n = off + k, n - k


def _revert(fd: int, op: Record, size: int) -> int:
    """Undo ``op`` on a file of ``size`` bytes holding its result; returns the new size."""
    if op.type == WRITE:
        # the file held the write's result: at least its old size
        if size > op.old:
            os.ftruncate(fd, op.old)
            size = op.old
        if op.pre:
            _pwrite_all(fd, op.pre, op.offset)
        return size
    os.ftruncate(fd, op.old)
    if op.new < op.old:
        _pwrite_all(fd, op.pre, op.new)
    return op.old


def _apply(fd: int, op: Record, n: int | None = None) -> None:
    """Redo ``op`` (a WRITE only its first ``n`` bytes when given)."""
    if op.type == TRUNC:
        os.ftruncate(fd, op.new)
        return
    n = op.length if n is None else n
    if n <= 0:
        return
    if op.flags & ZEROS:
        _write_zeros(fd, op.offset, n)
    else:
        _pwrite_all(fd, op.data[:n], op.offset)


def _tear_at(op: Record, rng) -> int | None:
    """Bytes of ``op`` kept when it is torn at a sector boundary inside it; None: not tearable."""
    if op.type != WRITE or op.length == 0:
        return None
    first = (op.offset // SECTOR + 1) * SECTOR
    last = ((op.offset + op.length - 1) // SECTOR) * SECTOR
    if first > last:
        return None
    return rng.randrange(first // SECTOR, last // SECTOR + 1) * SECTOR - op.offset


def _choose(ops: list, mode: str, rng) -> tuple[set, Record | None, int]:
    """The ops kept (indexes into ``ops``), the torn op, and how much of it is kept."""
    forced = {i for i, op in enumerate(ops) if op.flags & SYNCIO}
    n = len(ops)
    if mode == "drop":
        return forced, None, 0
    if mode == "prefix":
        return set(range(rng.randrange(n + 1))) | forced, None, 0
    if mode == "subset":
        return {i for i in range(n) if i in forced or rng.random() < 0.5}, None, 0
    k = rng.randrange(n)          # torn: a prefix, and the op after it torn
    kept = set(range(k)) | forced
    if k in forced:
        return kept, None, 0
    part = _tear_at(ops[k], rng)
    return kept, (ops[k] if part is not None else None), part or 0


DIR_RULES = ("linux", "posix")


def cut(dir: str, log: str, mode: str = "drop", rng: random.Random | None = None, *, dirs: str = "linux") -> dict:
    """Leave the files under ``dir`` as a power cut would have, from ``log``; then empty the log.

    Call only when every process that wrote under ``dir`` with the shim is dead
    (SIGKILLed, or exited). ``mode`` is one of :data:`MODES`; ``rng`` draws the
    choices (a fresh ``random.Random()`` when None); ``dirs`` is the rule that makes
    a file's creation durable (:data:`DIR_RULES`, module docstring). Files whose inode is no
    longer under ``dir`` are skipped. Returns a summary: ``files`` (rebuilt),
    ``unsynced`` (ops after their file's last sync), ``dropped`` (of them, not
    applied), ``torn`` (applied in part), ``bytes_dropped`` (data not applied),
    ``removed`` (created files deleted), ``records`` and ``skipped_bytes`` (torn
    records). The log is truncated to its header, ready for the next run.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    if dirs not in DIR_RULES:
        raise ValueError(f"dirs must be one of {DIR_RULES}, not {dirs!r}")
    rng = rng if rng is not None else random.Random()
    root = os.path.realpath(dir)
    records, skipped = read_log(log)
    by_id: dict = {}
    unsynced: dict = {}          # (dev, ino) -> its ops since its last sync, in log order
    last_sync: dict = {}         # (dev, ino) -> index of its last SYNC
    fs_sync: dict = {}           # dev (None: every one) -> index of its last SYNCFS
    created: dict = {}           # (dev, ino) -> its last CREATE (index, record)
    for i, r in enumerate(records):
        key = (r.dev, r.ino)
        if r.type in (WRITE, TRUNC):
            unsynced.setdefault(key, []).append(r)
            by_id[(r.pid, r.seq)] = r
        elif r.type == SYNC:
            unsynced.pop(key, None)
            last_sync[key] = i
        elif r.type == SYNCFS:
            every = bool(r.flags & ALL)
            for k in [k for k in unsynced if every or k[0] == r.dev]:
                del unsynced[k]
            fs_sync[None if every else r.dev] = i
        elif r.type == CREATE:
            # a new file: ops logged for this inode number before belong to a deleted one
            unsynced.pop(key, None)
            created[key] = (i, r)
        elif r.type == RESULT:
            op = by_id.get((r.pid, r.seq))
            if op is not None:
                _fix(op, r)
    files, dir_inodes = _inodes(root)
    summary = dict(files=0, unsynced=0, dropped=0, torn=0, bytes_dropped=0, removed=0,
                   records=len(records), skipped_bytes=skipped)
    removed = set()
    for key, (i, r) in sorted(created.items(), key=lambda kv: kv[1][0]):
        path = files.get(key)
        if path is None:
            continue
        parents = {(r.pdev, r.pino), dir_inodes.get(os.path.dirname(path))}
        if dirs == "linux":
            parents.add(key)        # the file's own fsync commits its directory entry
        durable = any(last_sync.get(p, -1) > i for p in parents if p) or \
            fs_sync.get(None, -1) > i or any(fs_sync.get(p[0], -1) > i for p in parents if p)
        if durable or (mode != "drop" and rng.random() < 0.5):
            continue
        os.unlink(path)
        removed.add(key)
        summary["removed"] += 1
    for key, ops in sorted(unsynced.items(), key=lambda kv: kv[1][0].at):
        ops = [op for op in ops if not op.void]
        if not ops or (key not in files and key not in removed):
            continue            # nothing left to undo, or no longer under dir
        summary["unsynced"] += len(ops)
        lost = sum(op.length for op in ops if op.type == WRITE)
        if key in removed:
            summary["dropped"] += len(ops)
            summary["bytes_dropped"] += lost
            continue
        path = files[key]
        for op in ops:
            if op.flags & NOPRE and (op.type == TRUNC and op.new < op.old or op.type == WRITE and op.offset < op.old):
                raise RuntimeError(f"{path}: the old bytes of an unsynced op were not readable; "
                                   "it cannot be reverted")
        kept, torn, part = _choose(ops, mode, rng)
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            for op in reversed(ops):
                size = _revert(fd, op, size)
            for j, op in enumerate(ops):
                if j in kept:
                    _apply(fd, op)
                    lost -= op.length if op.type == WRITE else 0
                elif op is torn:
                    _apply(fd, op, part)
                    lost -= part
        finally:
            os.close(fd)
        summary["files"] += 1
        summary["dropped"] += len(ops) - len(kept) - (torn is not None)
        summary["torn"] += torn is not None
        summary["bytes_dropped"] += lost
    os.truncate(log, len(HEADER))
    return summary
