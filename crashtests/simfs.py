"""Simulated power loss for the file store: a FileSystem that remembers what is not yet durable.

:class:`SimFS` passes every call through to the real directory (so the library
reads back what it wrote, as on a live machine) and keeps a model of what a
power cut would leave behind:

* file data written (or truncated) since the last ``fsync`` of that file;
* directory entry changes (create, rename, link, unlink, mkdir) since the last
  ``fsync_dir`` of that directory.

At operation number ``crash_at`` (counting every call) it raises :class:`Crash`
instead of performing the call, and every later call raises too: the machine
is off. :meth:`SimFS.image` then builds the post-crash directory tree from the
durable state plus some of the unsynced operations: none, all, a prefix, a
random subset (in order or reordered), possibly with one write torn (a prefix
of its bytes, optionally followed by garbage). This is POSIX at its weakest:
nothing unsynced is promised, in any order.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

from agck import durable

MODES = ("none", "all", "prefix", "subset", "reorder", "torn")


class Crash(BaseException):
    """The simulated machine lost power. A BaseException, so that no ``except
    Exception`` or ``except OSError`` in the library can treat it as an error to
    clean up after: after a power cut no code runs."""


@dataclass
class _Op:
    seq: int
    kind: str            # "write" | "trunc" | "create" | "unlink" | "rename"
    target: object       # an inode number (write) or a directory path (entry ops)
    args: tuple


@dataclass
class _Inode:
    durable: bytearray = field(default_factory=bytearray)


@dataclass
class _Dir:
    durable: dict = field(default_factory=dict)   # name -> ("f", ino) | ("d", abs path)


class SimFS(durable.FileSystem):
    """Pass-through file system with a durability model of everything under ``root``."""

    concurrent = False      # one recorded order of operations

    def __init__(self, root: str, *, crash_at: int | None = None):
        self.root = os.path.abspath(root)
        self.crash_at = crash_at
        self.ops = 0
        self.crashed = False
        self.crash_op: str | None = None
        self._seq = 0
        self._next_ino = 0
        self.inodes: dict[int, _Inode] = {}
        self.dirs: dict[str, _Dir] = {}
        self.live: dict[str, dict] = {}          # the model's view of the live tree, to resolve names
        self.fds: dict[int, list] = {}           # fd -> [ino, position]
        self.unsynced: list[_Op] = []
        os.makedirs(self.root, exist_ok=True)
        self._adopt(self.root)

    # -- model bookkeeping -------------------------------------------------------
    def _adopt(self, path: str) -> None:
        """What exists before the simulation starts counts as durable."""
        d = _Dir()
        self.dirs[path] = d
        self.live[path] = {}
        for name in sorted(os.listdir(path)):
            p = os.path.join(path, name)
            if os.path.isdir(p) and not os.path.islink(p):
                self._adopt(p)
                entry = ("d", p)
            else:
                ino = self._new_inode()
                with open(p, "rb") as f:
                    self.inodes[ino].durable[:] = f.read()
                entry = ("f", ino)
            d.durable[name] = entry
            self.live[path][name] = entry

    def _new_inode(self) -> int:
        self._next_ino += 1
        self.inodes[self._next_ino] = _Inode()
        return self._next_ino

    def _tick(self, what: str) -> None:
        if self.crashed:
            raise Crash(f"the machine is off (crashed at operation {self.ops}: {self.crash_op})")
        self.ops += 1
        if self.crash_at is not None and self.ops >= self.crash_at:
            self.crashed = True
            self.crash_op = what
            raise Crash(f"power lost at operation {self.ops} ({what})")

    def crash(self) -> None:
        """Lose power now (for tests that pick the instant themselves)."""
        self.crashed = True
        self.crash_op = self.crash_op or "explicit"

    def _record(self, kind: str, target, *args) -> None:
        self._seq += 1
        self.unsynced.append(_Op(self._seq, kind, target, args))

    def _split(self, path: str) -> tuple[str, str]:
        path = os.path.abspath(path)
        return os.path.dirname(path), os.path.basename(path)

    def _tracked(self, d: str) -> bool:
        return d in self.dirs

    # -- the system calls --------------------------------------------------------
    def open_new(self, path: str) -> int:
        self._tick("open_new")
        fd = super().open_new(path)
        d, name = self._split(path)
        ino = self._new_inode()
        self.fds[fd] = [ino, 0]
        if self._tracked(d):
            self.live[d][name] = ("f", ino)
            self._record("create", d, name, ("f", ino))
        return fd

    def open_append(self, path: str) -> int:
        self._tick("open_append")
        fd = super().open_append(path)
        d, name = self._split(path)
        entry = self.live.get(d, {}).get(name)
        if entry is None:
            ino = self._new_inode()
            if self._tracked(d):
                self.live[d][name] = ("f", ino)
                self._record("create", d, name, ("f", ino))
        else:
            ino = entry[1]
        self.fds[fd] = [ino, None]       # None: every write goes to the end (O_APPEND)
        return fd

    def write(self, fd: int, data) -> int:
        self._tick("write")
        ent = self.fds.get(fd)
        pos = None if ent is None else (ent[1] if ent[1] is not None else os.fstat(fd).st_size)
        n = super().write(fd, data)
        if ent is not None:
            self._record("write", ent[0], pos, bytes(memoryview(data)[:n]))
            if ent[1] is not None:
                ent[1] = pos + n
        return n

    def truncate(self, fd: int, length: int) -> None:
        self._tick("truncate")
        super().truncate(fd, length)
        ent = self.fds.get(fd)
        if ent is not None:
            self._record("trunc", ent[0], length)

    def fsync(self, fd: int) -> None:
        self._tick("fsync")
        ent = self.fds.get(fd)
        if ent is None:
            return super().fsync(fd)
        ino = ent[0]
        keep = []
        for op in self.unsynced:
            if op.kind in _DATA and op.target == ino:
                _apply_data(self.inodes[ino].durable, op)
            else:
                keep.append(op)
        self.unsynced = keep

    def start_writeback(self, fd: int, offset: int, nbytes: int) -> None:
        # A crash point like any call, and deliberately no change to the model:
        # writeback that was started promises nothing until fsync returns.
        self._tick("start_writeback")
        super().start_writeback(fd, offset, nbytes)

    def close(self, fd: int) -> None:
        self._tick("close")
        super().close(fd)
        self.fds.pop(fd, None)

    def rename(self, src: str, dst: str) -> None:
        self._tick("rename")
        super().rename(src, dst)
        sd, sn = self._split(src)
        dd, dn = self._split(dst)
        entry = self.live.get(sd, {}).pop(sn, None)
        if entry is None or not self._tracked(dd):
            return
        self.live[dd][dn] = entry
        if sd == dd:
            self._record("rename", sd, sn, dn, entry)
        else:  # across directories: two independent entry changes
            self._record("unlink", sd, sn)
            self._record("create", dd, dn, entry)

    def link(self, src: str, dst: str) -> None:
        self._tick("link")
        super().link(src, dst)
        sd, sn = self._split(src)
        dd, dn = self._split(dst)
        entry = self.live.get(sd, {}).get(sn)
        if entry is not None and self._tracked(dd):
            self.live[dd][dn] = entry
            self._record("create", dd, dn, entry)

    def unlink(self, path: str) -> None:
        self._tick("unlink")
        super().unlink(path)
        d, name = self._split(path)
        if self._tracked(d) and self.live[d].pop(name, None) is not None:
            self._record("unlink", d, name)

    def mkdir(self, path: str) -> None:
        self._tick("mkdir")
        super().mkdir(path)
        d, name = self._split(path)
        p = os.path.abspath(path)
        self.dirs[p] = _Dir()
        self.live[p] = {}
        if self._tracked(d):
            self.live[d][name] = ("d", p)
            self._record("create", d, name, ("d", p))

    def rmdir(self, path: str) -> None:
        self._tick("rmdir")
        super().rmdir(path)
        d, name = self._split(path)
        self.live.pop(os.path.abspath(path), None)
        if self._tracked(d) and self.live[d].pop(name, None) is not None:
            self._record("unlink", d, name)

    def datasync(self, fd: int) -> None:     # the simulated disk keeps no times: the same as fsync
        self.fsync(fd)

    def fsync_dir(self, path: str) -> None:
        self._tick("fsync_dir")
        p = os.path.abspath(path or ".")
        if not self._tracked(p):
            return super().fsync_dir(path)
        keep = []
        for op in self.unsynced:
            if op.kind not in _DATA and op.target == p:
                _apply_entry(self.dirs[p].durable, op)
            else:
                keep.append(op)
        self.unsynced = keep

    # -- the post-crash image ----------------------------------------------------
    def choose(self, rng: random.Random, mode: str | None = None) -> tuple[str, list[_Op], str]:
        """Pick which unsynced operations reach the disk: (mode, ops in apply order, description)."""
        ops = list(self.unsynced)
        mode = mode or rng.choice(MODES)
        if mode == "none":
            chosen = []
        elif mode == "all":
            chosen = ops
        elif mode == "prefix":
            chosen = ops[: rng.randint(0, len(ops))]
        elif mode == "torn":
            chosen = ops[: rng.randint(1, len(ops))] if ops else []
        else:
            p = rng.random()
            chosen = [o for o in ops if rng.random() < p]
            if mode == "reorder":
                rng.shuffle(chosen)
        desc = f"{mode}: {len(chosen)}/{len(ops)} unsynced ops applied"
        writes = [i for i, o in enumerate(chosen) if o.kind == "write"]
        tear = None
        if mode == "torn":
            if chosen and chosen[-1].kind == "write":
                tear = len(chosen) - 1
            elif writes:
                tear = writes[-1]
        elif writes and mode in ("subset", "reorder") and rng.random() < 0.3:
            tear = rng.choice(writes)
        if tear is not None:
            op = chosen[tear]
            pos, data = op.args
            keep = rng.randint(0, max(0, len(data) - 1))
            tail = b""
            if rng.random() < 0.5:   # the sector after a torn write holds garbage, not nothing
                n = rng.randint(1, max(1, len(data) - keep))
                tail = rng.randbytes(n) if rng.random() < 0.7 else bytes(n)
            chosen = list(chosen)
            chosen[tear] = _Op(op.seq, "write", op.target, (pos, data[:keep] + tail))
            desc += f", write #{op.seq} torn at {keep}/{len(data)} (+{len(tail)} garbage)"
        return mode, chosen, desc

    def image_tree(self, chosen: list[_Op]) -> dict:
        """{relative path: bytes} of files and {relative dir path: None} of directories."""
        dirs = {p: dict(d.durable) for p, d in self.dirs.items()}
        data = {ino: bytearray(i.durable) for ino, i in self.inodes.items()}
        for op in chosen:
            if op.kind in _DATA:
                _apply_data(data[op.target], op)
            else:
                _apply_entry(dirs[op.target], op)
        out: dict[str, bytes | None] = {}

        def walk(path: str, rel: str, depth: int) -> None:
            if depth > 32:
                return
            for name, (kind, what) in sorted(dirs.get(path, {}).items()):
                r = os.path.join(rel, name) if rel else name
                if kind == "d":
                    out[r] = None
                    walk(what, r, depth + 1)
                else:
                    out[r] = bytes(data[what])
        walk(self.root, "", 0)
        return out

    def image(self, dst: str, rng: random.Random, mode: str | None = None) -> str:
        """Write the post-crash tree under ``dst`` (merged with what is there); returns a description."""
        _, chosen, desc = self.choose(rng, mode)
        materialize(self.image_tree(chosen), dst)
        return desc


def crash_at_every_operation(work: str, before: dict, operation, check) -> int:
    """Cut the power at each file-system operation of ``operation`` in turn; returns how many it makes.

    ``before`` is the tree that exists (durable) when ``operation(root, fs)`` starts
    ({relative path: bytes, or None for a directory}, as :meth:`SimFS.image_tree`
    gives). A first run, in ``work/count``, counts the operations; then for every
    crash_at from 1 to that count, ``operation`` runs in a fresh ``work/c{crash_at}``
    on a SimFS that loses power at operation crash_at (completing anyway is an
    AssertionError), and each post-crash tree, one per mode of :data:`MODES` drawn
    with ``random.Random(crash_at)``, must satisfy ``check(tree)`` (AssertionError
    naming crash_at, the operation cut and the mode otherwise)."""
    count = os.path.join(work, "count")
    materialize(before, count)
    probe = SimFS(count)
    operation(count, probe)
    for crash_at in range(1, probe.ops + 1):
        root = os.path.join(work, f"c{crash_at}")
        materialize(before, root)
        sim = SimFS(root, crash_at=crash_at)
        try:
            operation(root, sim)
        except Crash:
            pass
        else:
            raise AssertionError(f"the operation completed although the power was cut at operation {crash_at}")
        rng = random.Random(crash_at)
        for mode in MODES:
            tree = sim.image_tree(sim.choose(rng, mode)[1])
            if not check(tree):
                raise AssertionError(f"power cut at operation {crash_at} ({sim.crash_op}), {mode}: {sorted(tree)}")
    return probe.ops


def materialize(tree: dict, dst: str) -> None:
    os.makedirs(dst, exist_ok=True)
    for rel in sorted(tree):
        p = os.path.join(dst, rel)
        if tree[rel] is None:
            os.makedirs(p, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "wb") as f:
                f.write(tree[rel])


_DATA = ("write", "trunc")      # operations on a file's data (made durable by its fsync)


def _apply_data(buf: bytearray, op: _Op) -> None:
    if op.kind == "trunc":
        del buf[op.args[0]:]
    else:
        _apply_write(buf, *op.args)


def _apply_write(buf: bytearray, pos: int, data: bytes) -> None:
    if pos > len(buf):
        buf.extend(bytes(pos - len(buf)))   # a hole reads as zeros
    buf[pos:pos + len(data)] = data


def _apply_entry(entries: dict, op: _Op) -> None:
    if op.kind == "create":
        name, entry = op.args
        entries[name] = entry
    elif op.kind == "unlink":
        entries.pop(op.args[0], None)
    elif op.kind == "rename":
        src, dst, entry = op.args
        entries.pop(src, None)
        entries[dst] = entry
