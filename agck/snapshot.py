"""Periodic snapshots of a running pipeline, and bit-exact resume.

Two forms over one engine, :class:`Snapshotter`::

    @checkpoint_every(10, store="ckpts/", run="doc-pipeline")
    def step(state, i):
        ...
        return state

    for i in range(total):          # unchanged user loop: after a crash, the
        state = step(state, i)      # steps already checkpointed are skipped
    step.close()                    # checkpoints the last step, flushes

and the loop form::

    with Snapshotter("ckpts/", "doc-pipeline", every=10) as snap:
        state = snap.restore(state)
        for i in snap.steps(total):
            ...
            snap.update(state)

A checkpoint at step ``k`` holds the state after ``k`` completed steps, the RNG
states, and a fingerprint of the software and hardware. Capture happens at a
step boundary and is by value: in async mode every mutable part of the state
(containers, sets, bytearrays, arrays, tensors, state_dict() results) is copied
there, the tensors into reusable staging buffers (pinned host memory for CUDA
tensors, one synchronization per device), and encoding plus the durable write
run on a background thread; at most ``max_in_flight`` (1-64) snapshots are
pending (backpressure). A failed write is raised on the next step or at close,
never swallowed, naming its step and the steps queued behind it that were not
written; an exception of ``on_durable`` is raised as a ``SnapshotError`` that
says the checkpoint itself is durable.

What a SIGKILL loses: the steps completed since ``last_durable_step``, and
nothing else. SIGTERM and SIGINT finish the step in progress, take a final
checkpoint (not under torch.distributed, whose ranks would not agree on its step;
pending ones are flushed there), then exit with status 128 + the signal's number,
after one log line naming the step and with no traceback; a handler the program
installed before the snapshotter gets the signal first.

The parts: capture of the state and RNG states (:mod:`agck.capture`), the staging
copies of async mode (:mod:`agck.staging`), and where checkpoints go, one
process's puts or one rank's part of a collective write (:mod:`agck.snapshot_run`).
This module is the engine over them: cadence, the writer thread, backpressure,
failures, resume, signals, and the decorator.
"""

from __future__ import annotations

import atexit
import collections
import copy
import ctypes
import functools
import inspect
import logging
import numbers
import os
import platform
import queue
import signal
import threading
import time
import warnings
from typing import Any, Callable, Iterator

try:
    import resource
except ImportError:  # pragma: no cover (not on Windows)
    resource = None

from . import applog, durable, failpoints
# capture's names are agck.snapshot's too (crashtests, tests and user code import them from here)
from .capture import TAG, capture, fingerprint, restore_into, rng_state, set_rng_state  # noqa: F401
from .codec import encode_plain
from .errors import AgckError, ContentChangedError, SnapshotError, UsageError
from .names import check_run, check_step
from .snapshot_run import SnapshotRun, open_run
from .staging import TOUCH_MIN, Stager, has_cuda
from .stores import Store, open_store

log = logging.getLogger("agck")

_Stager, _TOUCH_MIN = Stager, TOUCH_MIN     # their names before agck.staging (tests use them)


class FingerprintWarning(UserWarning):
    """Resuming under different software or hardware: bit-exactness may not hold."""


# --- the background writer's priority -------------------------------------------

# The writer runs beside the pipeline and is never what the pipeline waits for,
# except at backpressure or close. Its I/O goes at the lowest best-effort I/O
# priority (honoured by the bfq and mq-deadline schedulers), so the pipeline's
# own reads come first. Its CPU priority is left alone by default
# (WRITER_NICE = 0): the writer shares the GIL with the pipeline, and a
# low-priority thread preempted while it holds the GIL stalls the pipeline
# until it runs again; on a busy machine that cost more than it saved.
WRITER_NICE = 0
WRITER_IDLE_IO = True
_IOPRIO_WHO_PROCESS = 1
_IOPRIO_CLASS_BE = 2
_IOPRIO_SYSCALL = {"x86_64": 251, "aarch64": 30, "arm64": 30, "riscv64": 30, "ppc64le": 273, "s390x": 282}


def _yield_to_pipeline() -> None:
    """Lower this thread's I/O priority (and its CPU priority by WRITER_NICE);
    on Linux both are per thread. Best effort: a refusal changes nothing."""
    if not platform.system() == "Linux":
        return  # elsewhere a thread id passed as a pid could name another process
    tid = threading.get_native_id()
    if WRITER_NICE:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + WRITER_NICE))
        except (OSError, AttributeError):
            pass
    nr = _IOPRIO_SYSCALL.get(platform.machine())
    if nr is not None and WRITER_IDLE_IO:
        try:
            ctypes.CDLL(None, use_errno=True).syscall(nr, _IOPRIO_WHO_PROCESS, tid, (_IOPRIO_CLASS_BE << 13) | 7)
        except (OSError, AttributeError):
            pass


def _thread_cpu() -> tuple[float, float | None]:
    """(user, system) CPU seconds of the calling thread; system is None where
    only the sum is available."""
    if resource is not None and hasattr(resource, "RUSAGE_THREAD"):
        r = resource.getrusage(resource.RUSAGE_THREAD)
        return r.ru_utime, r.ru_stime
    return time.thread_time(), None


# --- the engine -------------------------------------------------------------------

class _Signals:
    """SIGTERM and SIGINT while snapshotters are open: one handler, which passes the
    signal to the newest open one. The handlers found before the first are put back
    when the last closes, whatever order they close in (each keeping its own
    predecessor's would leave a closed one's handler installed)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    owners: list = []       # open snapshotters, newest last
    saved: dict = {}        # signal -> the handler before the first owner

    @classmethod
    def add(cls, snap) -> None:
        if not cls.owners:
            for sig in cls.SIGNALS:
                try:
                    cls.saved[sig] = signal.signal(sig, cls.dispatch)
                except (ValueError, OSError):
                    pass
        cls.owners.append(snap)

    @classmethod
    def remove(cls, snap) -> None:
        if snap in cls.owners:
            cls.owners.remove(snap)
            if not cls.owners:
                cls.restore_all()

    @classmethod
    def restore_all(cls) -> None:
        cls.owners.clear()
        for sig, old in cls.saved.items():
            try:
                if signal.getsignal(sig) == cls.dispatch:    # not one installed after ours
                    signal.signal(sig, old)
            except (ValueError, OSError, TypeError):
                pass
        cls.saved.clear()

    @classmethod
    def dispatch(cls, signum, frame) -> None:
        if cls.owners:
            cls.owners[-1]._on_signal(signum, frame)
        else:      # all closed in the meantime: as if we had never been here
            cls.restore_all()
            signal.raise_signal(signum)


def _count(value: Any, name: str) -> int:
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1:
        return int(value)
    raise UsageError(f"{name} must be a positive integer, not {value!r}")


MAX_IN_FLIGHT = 64     # each slot holds a staged copy of the whole state


def _in_flight(value: Any) -> int:
    n = _count(value, "max_in_flight")
    if n > MAX_IN_FLIGHT:
        raise UsageError(f"max_in_flight must be at most {MAX_IN_FLIGHT}, not {value!r}",
                         hint="each pending snapshot holds a staged copy of the whole state")
    return n


def _options(every: int, *, resume: bool = True, mode: str = "auto", max_in_flight: int = 1,
             on_durable: Callable[[int, str], Any] | None = None, meta: Any = None,
             handle_signals: bool = True, capture_rng: bool = True, distributed: bool | None = None) -> dict:
    """The Snapshotter's options, checked and normalized before anything is opened."""
    if not isinstance(mode, str) or mode not in ("auto", "async", "sync"):
        raise UsageError(f"mode must be 'auto', 'async' or 'sync', not {mode!r}")
    for name, flag in (("resume", resume), ("handle_signals", handle_signals), ("capture_rng", capture_rng)):
        if not isinstance(flag, bool):
            raise UsageError(f"{name} must be True or False, not {flag!r}")
    if distributed is not None and not isinstance(distributed, bool):
        raise UsageError(f"distributed must be True, False or None, not {distributed!r}")
    if on_durable is not None and not callable(on_durable):
        raise UsageError(f"on_durable must be callable or None, not {on_durable!r}")
    # Checked here, not in the background write, nested as snapshot() writes it (the
    # checkpoint's meta['user']); copied, so later edits cannot reach a checkpoint.
    encode_plain({"fingerprint": None, "user": meta, "snapshot": True}, "meta")
    meta = copy.deepcopy(meta)
    return {"every": _count(every, "every"), "resume": resume, "mode": mode,
            "max_in_flight": _in_flight(max_in_flight), "on_durable": on_durable, "meta": meta,
            "handle_signals": handle_signals, "capture_rng": capture_rng, "distributed": distributed}


_OPTION_NAMES = frozenset(inspect.signature(_options).parameters) - {"every"}


class Snapshotter:
    """Checkpoints a pipeline's state every ``every`` steps into ``store``.

    ``mode``: ``"async"`` (stage and persist in the background), ``"sync"``
    (persist before returning), or ``"auto"`` (async when the state holds CUDA
    tensors, else sync). ``on_durable(step, ref)`` is called once a checkpoint is
    durable. ``resume=False`` deletes the run's existing checkpoints before the
    first new one is written, so a later crash can never resume into the old run.
    ``meta`` (plain data, checked and copied here) goes into every checkpoint as
    its ``meta['user']``.

    ``distributed``: under torch.distributed (None, the default: whenever a default
    process group of more than one rank is initialized), every rank makes its own
    Snapshotter of the same run at the same point of its program, each rank's state
    is written as its own part in parallel, and a step becomes visible only when
    every part is durable, through one commit record (README, "Multi-rank
    checkpoints"). Restore then takes the newest step whose every part verifies,
    on every rank alike. A signal does not add an out-of-cadence checkpoint there
    (the ranks would not agree on its step): pending ones are flushed and the
    process exits.

    Arguments are checked before the store is opened: a bad one raises
    :class:`UsageError` naming it (a bad run name :class:`InvalidRunNameError`,
    unencodable meta :class:`EncodeError`). After :meth:`close`, every method
    but ``close`` and ``flush`` raises :class:`UsageError`.
    """

    def __init__(self, store: Store | str, run: str, *, every: int = 10, resume: bool = True,
                 mode: str = "auto", max_in_flight: int = 1, on_durable: Callable[[int, str], Any] | None = None,
                 meta: Any = None, handle_signals: bool = True, capture_rng: bool = True,
                 distributed: bool | None = None):
        opts = _options(every, resume=resume, mode=mode, max_in_flight=max_in_flight, on_durable=on_durable,
                        meta=meta, handle_signals=handle_signals, capture_rng=capture_rng, distributed=distributed)
        self.run = check_run(run)
        self._own_store = not isinstance(store, Store)
        self.store = open_store(store)
        self.every = opts["every"]
        self.resume = resume
        self.mode = mode
        self.max_in_flight = opts["max_in_flight"]
        self.on_durable = on_durable
        self.meta = opts["meta"]
        self.capture_rng = capture_rng
        self.start_step = 0
        self.last_durable_step: int | None = None
        self.last_durable_ref: str | None = None
        self.recovery = None
        self.blocked_seconds: list[float] = []   # time the pipeline waited per snapshot
        # per persisted snapshot, newest last: step, thread, start/end (perf_counter), and the
        # CPU seconds (user, system) of the thread that encoded and wrote it
        self.write_stats: collections.deque = collections.deque(maxlen=10_000)
        self.prepare_stats: dict | None = None   # the same for making the staging buffers ahead
        self._state: Any = None
        self._restored = False
        self._started_over = False
        self._taken: int | None = None            # the step of the newest snapshot taken (durable or pending)
        self._error: BaseException | None = None
        self._queue: queue.Queue | None = None
        self._worker: threading.Thread | None = None
        self._stagers: list[Stager] = []
        self._free_stagers: queue.Queue | None = None
        self._pending = 0
        self._cv = threading.Condition()
        self._closed = False
        self._stop_signal: int | None = None
        self._error_step: int | None = None
        self._failed = 0           # background writes that failed (the writer's count)
        self._raised = 0           # of those, raised in the pipeline's thread
        self._skipped: list[int] = []             # steps queued behind a failed write, not written
        self._async: bool | None = None if mode == "auto" else mode == "async"
        self._fingerprint: dict | None = None
        self._prepared = False                    # staging buffers made ahead of the first snapshot
        # the large CPU tensors of the last durable async snapshot, by id: (weakref, version signature)
        self._seen: dict[int, tuple] = {}
        self.dropped_steps: list[int] = []        # snapshots not written: a tensor taken uncopied changed
        self._untrusted: set[int] = set()         # ids of tensors caught changing behind their version counter
        self.epoch: int | None = None              # this incarnation of the run (_incarnate)
        # where checkpoints go and come from: this process's puts, or under torch.distributed
        # this rank's part of collective writes; chosen here, once, and never asked again
        self._target: SnapshotRun = open_run(self.store, self.run, distributed)
        if handle_signals:
            self._install_signals()
        atexit.register(self._close_at_exit)

    def _check_open(self) -> None:
        if self._closed:
            raise UsageError(f"the snapshotter of run {self.run!r} is closed",
                             hint="create a new Snapshotter to continue the run")

    # -- resume ----------------------------------------------------------------
    def restore(self, state: Any = None) -> Any:
        """Restore the run's last valid checkpoint into ``state`` (in place for
        modules, optimizers and dicts) and set ``start_step``. On a fresh run,
        or with ``resume=False``, returns ``state`` unchanged.

        Raises :class:`UsageError` if the newest valid checkpoint of the run was
        not written by a snapshotter (a plain ``store.put``): it holds no step
        boundary state to resume from, and the run is left as it is."""
        self._check_open()
        self._restored = True
        self._incarnate()
        if not self.resume:
            self._start_over()
            self._state = state
            return state
        # meta_source: the record whose meta and ref stand for the step (a commit record
        # under torch.distributed, where ck is this rank's part)
        self.recovery, meta_source = self._target.find()
        rec, ck = self.recovery, self.recovery.checkpoint
        self._target.check_restorable(ck)
        for rj in rec.rejected:
            log.warning("agck: run %r: skipped step %d (%s): %s", self.run, rj.step, rj.ref, rj.reason)
        if ck is None:
            if rec.candidates:
                log.warning("agck: run %r: none of %d checkpoints verifies; starting over",
                            self.run, rec.candidates)
            self._state = state
            return state
        saved = ck.state
        meta = meta_source.meta if isinstance(meta_source.meta, dict) else {}
        if meta.get("snapshot") is not True or not isinstance(saved, dict) or "state" not in saved:
            raise UsageError(f"run {self.run!r}: the newest valid checkpoint (step {ck.step}) was not written by "
                             "a snapshotter, so there is no step boundary to resume from", ref=ck.ref,
                             hint="give the snapshotter a run of its own, or pass resume=False to start over "
                                  "(it deletes the run's checkpoints)")
        fp = meta.get("fingerprint")
        now = fingerprint()
        if fp and {k: fp.get(k) for k in now} != now:
            diff = {k: (fp.get(k), now[k]) for k in now if fp.get(k) != now[k]}
            warnings.warn(f"resuming run {self.run!r} at step {ck.step} under a different environment {diff}: "
                          "results may not be bit-identical to an uninterrupted run", FingerprintWarning,
                          stacklevel=2)
        if self.capture_rng and "rng" in saved:
            set_rng_state(saved["rng"])
        restored = restore_into(state, saved["state"])
        self.start_step = ck.step
        self.last_durable_step = ck.step
        self.last_durable_ref = meta_source.ref
        self._state = restored
        log.info("agck: run %r resumed at step %d from %s", self.run, ck.step, ck.ref)
        return restored

    def _incarnate(self) -> None:
        """Once, before this snapshotter restores or writes anything: begin a new epoch
        of the run (:meth:`Store.begin_epoch`). Every put carries it, so a snapshotter
        of an earlier incarnation still running somewhere (a job restarted elsewhere
        while the old one hung) can no longer commit: its puts fail with
        :class:`StaleEpochError`, raised as a :class:`SnapshotError` in its pipeline."""
        if self.epoch is None:
            self.epoch = self._target.begin_epoch()

    def _start_over(self) -> None:
        """resume=False: delete the run's old checkpoints, once, before anything new is written."""
        if self._started_over:
            return
        self._started_over = True
        self._target.delete_all(self.epoch)

    # -- the loop form ---------------------------------------------------------
    def steps(self, total: int | None = None) -> Iterator[int]:
        """Yield step indices from ``start_step``; after each step's body the
        step counts as completed and a snapshot is taken every ``every`` steps
        (and after the last one)."""
        self._check_open()
        if total is not None:
            total = check_step(total, "total")
        if not self._restored:
            self.restore(self._state)
        return self._steps(total)

    def _steps(self, total: int | None) -> Iterator[int]:
        i = self.start_step
        while total is None or i < total:
            self.raise_pending()
            yield i
            done = i + 1
            last = total is not None and done == total
            self.completed(done, self._state, force=last)
            i = done

    def update(self, state: Any) -> None:
        """Tell the snapshotter the current state (when it is a new object)."""
        self._check_open()
        self._state = state

    def completed(self, steps_done: int, state: Any, *, force: bool = False) -> None:
        """``steps_done`` steps are complete and ``state`` is their result."""
        self._check_open()
        steps_done = check_step(steps_done, "steps_done")
        self._state = state
        # (under torch.distributed every rank must take the same steps: no extra one on a signal)
        if force or steps_done % self.every == 0 or (self._stop_signal is not None
                                                     and self._target.checkpoint_on_signal):
            self.snapshot(steps_done, state)
        elif not self._prepared:
            self._prepare_staging(state)
        if self._stop_signal is not None:
            self._exit_on_signal()

    # -- snapshots -------------------------------------------------------------
    def snapshot(self, step: int, state: Any = None) -> None:
        """Checkpoint ``state`` as the state after ``step`` completed steps."""
        self._check_open()
        step = check_step(step)
        self.raise_pending()
        self._incarnate()
        if not self.resume:
            self._start_over()
        state = self._state if state is None else state
        t0 = time.perf_counter()
        # of AppendLogs: written before the checkpoint, compressed where the store compresses
        store = getattr(self._target, "store", None)
        segments = applog.Segments(self._target.log_dest(),
                                   level=store.compression.active_level if store is not None else None,
                                   sealer=getattr(store, "sealer", None))
        # the step first: what changes at every checkpoint sits together, before the
        # state, not between the end of a growing list and the RNG states (chunking)
        try:
            tree = {"step": step, "state": capture(state, segments)}
            if self.capture_rng:
                tree["rng"] = rng_state()
        except BaseException:
            applog.not_written(segments)
            raise
        if self._fingerprint is None:
            self._fingerprint = fingerprint()
        meta = {"fingerprint": self._fingerprint, "user": self.meta, "snapshot": True}
        if self._async is None:
            self._async = has_cuda(tree)
        if not self._async:
            self.blocked_seconds.append(0.0)
            ref = self._persist(step, tree, meta, self.last_durable_step, segments=segments)
            self._taken = step
            self.blocked_seconds[-1] = time.perf_counter() - t0
            self._acknowledge(step, ref)
            return
        self._start_worker()
        try:
            stager = self._free_stagers.get()          # backpressure: waits while max_in_flight are pending
        except BaseException:
            applog.not_written(segments)
            raise
        try:     # any failure from here gives the stager back: the next snapshot would wait for it forever
            self.raise_pending()
            # ({} still notes this staging's tensors, for the snapshot after it)
            seen = self._seen if self._seen and self._target.can_confirm_unchanged(self.epoch) else {}
            try:
                staged = stager.stage(tree, seen, self._untrusted)
            except AgckError:
                raise
            except Exception as e:
                raise SnapshotError(f"staging step {step} of run {self.run!r} failed: {type(e).__name__}: {e}",
                                    hint="nothing was written; the previous checkpoint is untouched") from e
            failpoints.hit("snapshot.after_stage")
        except BaseException:
            self._free_stagers.put(stager)
            applog.not_written(segments)
            raise
        with self._cv:
            self._pending += 1
        self._queue.put((step, staged, meta, stager, self._raised, segments))
        self._taken = step
        self.blocked_seconds.append(time.perf_counter() - t0)

    def _persist(self, step, tree, meta, parent, stager: Stager | None = None, segments=()) -> str:
        t0, (u0, s0) = time.perf_counter(), _thread_cpu()
        referenced = stager.referenced if stager is not None else ()
        self._target.write_segments(segments)      # durable before the checkpoint that counts their items
        ref = self._target.write(step, tree, meta=meta, parent=parent, epoch=self.epoch, expect_unchanged=referenced)
        u1, s1 = _thread_cpu()
        self.write_stats.append({"step": step, "thread": threading.current_thread().name, "start": t0,
                                 "end": time.perf_counter(), "cpu_user_s": u1 - u0,
                                 "cpu_sys_s": None if s0 is None else s1 - s0,
                                 "referenced_bytes": stager.referenced_bytes if stager is not None else 0})
        return ref

    def _acknowledge(self, step: int, ref: str) -> None:
        failpoints.hit("snapshot.before_ack")
        self.last_durable_step = step
        self.last_durable_ref = ref
        if self.on_durable is not None:
            try:
                self.on_durable(step, ref)
            except Exception as e:
                raise SnapshotError(f"on_durable raised for step {step} of run {self.run!r}: {type(e).__name__}: "
                                    f"{e}", ref=ref, hint="the checkpoint itself is durable; fix the callback"
                                    ) from e

    def _start_worker(self) -> None:
        if self._worker is not None:
            return
        self._queue = queue.Queue()
        self._free_stagers = queue.Queue()
        for _ in range(self.max_in_flight):
            s = Stager()
            self._stagers.append(s)
            self._free_stagers.put(s)
        self._worker = threading.Thread(target=self._work, name=f"agck-snapshot-{self.run}", daemon=True)
        self._worker.start()

    def _prepare_staging(self, state: Any) -> None:
        """Once, at a step boundary before the first snapshot: have the writer thread
        make the staging buffers the state will need, while the pipeline computes."""
        self._prepared = True
        if self._async is False or self._taken is not None:
            return
        jobs: list = []     # (stager, buffers to make); every stager taken here goes back through the job
        try:
            tree = {"step": 0, "state": capture(state)}
            if self.capture_rng:
                tree["rng"] = rng_state()
            if self._async is None and not has_cuda(tree):
                return   # auto mode will choose sync: nothing to stage
            self._start_worker()
            while True:
                try:
                    jobs.append((self._free_stagers.get_nowait(), []))
                except queue.Empty:
                    break
            for i, (stager, _) in enumerate(jobs):
                jobs[i] = (stager, stager.plan(tree))
        except Exception as e:  # only a head start: the snapshot itself reports what is wrong
            log.debug("agck: planning staging buffers failed: %s", e)
        if jobs:
            self._queue.put(_Prepare(jobs))

    def _work(self) -> None:
        _yield_to_pipeline()
        durable.writes_in_background()
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, _Prepare):
                t0, (u0, s0) = time.perf_counter(), _thread_cpu()
                for stager, missing in item.jobs:
                    try:
                        stager.make(missing, lambda: self._closed)
                    except Exception as e:  # staging allocates again, and raises, in the pipeline's thread
                        log.debug("agck: preparing staging buffers failed: %s", e)
                u1, s1 = _thread_cpu()
                self.prepare_stats = {"start": t0, "end": time.perf_counter(), "cpu_user_s": u1 - u0,
                                      "cpu_sys_s": None if s0 is None else s1 - s0}
                for stager, _ in item.jobs:
                    self._free_stagers.put(stager)
                continue
            step, staged, meta, stager, raised, segments = item
            try:
                # written unless a write failed that the pipeline had not been told of when it
                # queued this one: decided by the queue's order alone, so ranks of one job,
                # whose writes fail together, write (or skip) the same steps
                if self._failed == raised:
                    ref = self._persist(step, staged, meta, self.last_durable_step, stager, segments)
                    self._seen = stager.now
                    self._acknowledge(step, ref)
                else:            # queued behind a failure, not written: said with it
                    applog.not_written(segments)
                    self._skipped.append(step)
            except ContentChangedError as e:
                # A tensor taken uncopied changed without its version counter saying so (an
                # edit through .numpy() or .data, as EMA weights and hand-written optimizers
                # make), or while it was read: this snapshot cannot hold the step's state, so
                # it is not written. The next one copies every tensor, and the tensors caught
                # changing are copied from then on: a run loses at most one snapshot to each.
                self._seen = {}
                caught = [stager.referenced_ids[a] for a in e.addresses if a in stager.referenced_ids] \
                    or list(stager.referenced_ids.values())     # not known which: every one passed uncopied
                self._untrusted.update(caught)
                self.dropped_steps.append(step)
                log.warning("agck: step %d of run %r was not checkpointed (%s); %d tensor(s) changed behind "
                            "their version counter and are copied at every snapshot from now on", step,
                            self.run, e, len(caught))
            except BaseException as e:  # surfaced to the pipeline thread, never swallowed
                self._seen = {}
                self._failed += 1          # before _error: raise_pending reads them in the other order
                self._error_step = step
                self._error = e
            finally:
                del staged
                self._free_stagers.put(stager)
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()

    def raise_pending(self) -> None:
        """Raise a background write's failure in the caller's thread."""
        e = self._error
        if e is not None:
            self._error = None
            self._raised = self._failed
            skipped, self._skipped = self._skipped, []
            if isinstance(e, SnapshotError):      # already says what happened (on_durable)
                raise e
            also = f"; steps {skipped} queued behind it were not written either" if skipped else ""
            what = f"the background snapshot of step {self._error_step} of run {self.run!r} failed"
            cause = str(e) if isinstance(e, AgckError) else f"{type(e).__name__}: {e}"
            raise SnapshotError(f"{what}: {cause}{also}", ref=getattr(e, "ref", None),
                                hint="the previous checkpoint is untouched") from e

    def flush(self) -> None:
        """Wait until every pending snapshot is durable (or raise its failure)."""
        with self._cv:
            while self._pending:
                self._cv.wait()
        self.raise_pending()

    def _close_at_exit(self) -> None:
        # Join the worker before the interpreter finalizes: a daemon thread still
        # inside torch then is killed mid C++ frame and the process aborts.
        try:
            self.close()
        except Exception as e:  # at interpreter exit there is nobody left to raise to
            log.error("agck: pending snapshot of run %r failed at exit: %s", self.run, e)

    def close(self) -> None:
        """Flush pending snapshots, stop the worker, restore signal handlers.
        Idempotent; afterwards the snapshotter refuses further use."""
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()
        finally:
            if self._worker is not None:
                self._queue.put(None)
                self._worker.join()
                self._worker = None
            self._restore_signals()
            atexit.unregister(self._close_at_exit)
            self._target.close()
            if self._own_store:
                self.store.close()
            if self.dropped_steps:
                log.warning("agck: run %r: %d snapshot(s) were not written, a tensor passed uncopied having "
                            "changed behind its version counter (steps %s); %d tensor(s) were copied at every "
                            "snapshot after it was caught", self.run, len(self.dropped_steps),
                            self.dropped_steps[:10], len(self._untrusted))

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except AgckError as e:
                log.error("agck: %s", e)  # the original exception is the one to see

    # -- signals ---------------------------------------------------------------
    def _install_signals(self) -> None:
        if threading.current_thread() is threading.main_thread():
            _Signals.add(self)

    def _restore_signals(self) -> None:
        _Signals.remove(self)

    def _on_signal(self, signum, frame) -> None:
        # The state is mid-step here; the final checkpoint is taken at the next
        # step boundary, then the process exits (_exit_on_signal).
        if self._stop_signal is not None:  # a second signal: stop now
            _Signals.restore_all()
            signal.raise_signal(signum)
            return
        self._stop_signal = signum
        then = "checkpointing" if self._target.checkpoint_on_signal else "flushing the pending checkpoints of"
        log.warning("agck: %s received: %s run %r at the end of this step, then exiting",
                    signal.Signals(signum).name, then, self.run)

    def _exit_on_signal(self) -> None:
        """After the final checkpoint, exit as a command line tool does on a signal: one
        line naming the step, then SystemExit(128 + signum), the status a shell reports
        for the signal, with the program's finally blocks and atexit handlers run and
        no traceback (Python's SIGINT handler would print one through this frame, on
        every rank). A handler the program installed before ours gets the signal
        first, as if agck had not been there."""
        signum = self._stop_signal
        self.close()    # flushes, and puts back the handlers found before ours
        if signal.getsignal(signum) not in _PYTHON_HANDLERS:
            signal.raise_signal(signum)
        name, step = signal.Signals(signum).name, self.last_durable_step
        log.warning("agck: %s: run %r %s; exiting with status %d", name, self.run,
                    "has no checkpoint" if step is None else f"is checkpointed at step {step}", 128 + signum)
        raise SystemExit(128 + signum)


# no handling of the program's own: the default actions, KeyboardInterrupt, or ignoring
# (which our handler overrode while it was installed)
_PYTHON_HANDLERS = (signal.SIG_DFL, signal.SIG_IGN, signal.default_int_handler)


class _Prepare:
    """A writer job: make staging buffers ahead of the first snapshot."""

    def __init__(self, jobs):
        self.jobs = jobs


# --- the decorator ----------------------------------------------------------------

def checkpoint_every(n: int, *, store: Store | str = "ckpts/", run: str | None = None, total: int | None = None,
                     **options):
    """Decorate ``step(state, i, ...) -> state`` to checkpoint every ``n`` steps.

    The first call restores the run's last valid checkpoint into the state it is
    given; calls for steps already covered by that checkpoint return the
    restored state without running, so the caller's loop needs no change to
    resume. ``run`` defaults to the function's qualified name; ``options`` are
    the Snapshotter's, checked here. The wrapper has ``.snapshotter``
    (``last_durable_step``, ``flush()``) and ``.close()``.

    The end of the loop gets a checkpoint too: with ``total``, the call for step
    ``total - 1`` takes one; and ``close()`` checkpoints the state the last call
    returned if its step has none yet (unless that call raised). Call ``close()``
    right after the loop, before changing the state."""
    n = _count(n, "n")
    if total is not None:
        total = check_step(total, "total")
    unknown = set(options) - _OPTION_NAMES
    if unknown:
        raise UsageError(f"checkpoint_every: unknown option(s) {', '.join(sorted(unknown))}",
                         hint=f"options are {', '.join(sorted(_OPTION_NAMES))}")
    _options(n, **options)

    def decorate(fn):
        run_name = check_run(run or f"{fn.__module__}.{fn.__qualname__}".replace("<", "").replace(">", ""))
        snap: Snapshotter | None = None
        last: tuple[int, Any] | None = None      # (steps done, state) of the last call that returned
        closed = False

        @functools.wraps(fn)
        def wrapper(state, i, *args, **kwargs):
            nonlocal snap, last
            if closed:
                raise UsageError(f"{fn.__qualname__} is closed: its snapshotter of run {run_name!r} was closed",
                                 hint="decorate the function again to start another pass")
            i = check_step(i, "step index")
            if total is not None and i >= total:
                raise UsageError(f"step index {i} is past total={total}")
            if snap is None:
                snap = Snapshotter(store, run_name, every=n, **options)
                wrapper.snapshotter = snap
                state = snap.restore(state)
            snap._check_open()
            if i < snap.start_step:
                return snap._state          # covered by the restored checkpoint
            snap.raise_pending()
            last = None                     # a call that raises leaves the state half-stepped
            out = fn(state, i, *args, **kwargs)
            last = (i + 1, out)
            snap.completed(i + 1, out, force=total is not None and i + 1 == total)
            return out

        def close():
            nonlocal closed
            if closed:
                return
            closed = True
            if snap is None:
                return
            try:
                if last is not None and last[0] != snap._taken and not snap._closed:
                    snap.snapshot(*last)
            finally:
                snap.close()

        wrapper.snapshotter = None
        wrapper.close = close
        return wrapper

    return decorate
