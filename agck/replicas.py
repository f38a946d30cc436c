"""Multi-rank checkpoints over tiers: each rank's part on its host, on peers, then durable.

:class:`TieredShardedRun` is :class:`agck.distributed.ShardedRun` for a
:class:`agck.stores.tiered.TieredStore`. Ranks that give the same local tier
(the same URL: a directory on this host's tmpfs or NVMe) are one *host*, one
failure domain; the durable tier is shared by all.

write step k (every rank, the same order)
    1. this rank puts its part in its host's local tier, and serializes it once;
    2. it sends the bytes to its ``replicas`` *holders*: the rank at its place on
       each of the next hosts of a ring of hosts, which check them and keep them
       in their own local tier (a *replica*); point to point over agck's gloo
       group, only after every rank's part is written;
    3. every outcome is gathered; only if every part and replica is kept does the
       first rank of each host put the commit record in its host's local tier
       (fenced by the epoch): the step is acknowledged *local* on every rank;
    4. every ``durable_every``-th step, each rank's copier copies its own part to
       the durable tier in the background, and rank 0's copies the commit record
       once every part it binds is there: the step is *durable*.

restore (every rank)
    the candidates are the steps with a commit record in any host's local tier or
    in the durable tier, newest first. For each, the ranks agree on its record
    (the newest epoch's), then each takes its part from its own local tier if it
    verifies, else from a holder whose replica verifies (read there, sent, checked
    again here by its checksums and its binding to the record, and written back
    into this host's tier), else from the durable tier; one all-gather of the
    verdicts takes or rejects the step on every rank alike, as in the single-tier
    walk back. A replacement host with an empty local tier restores from its peers.
"""

from __future__ import annotations

import logging
import threading
import warnings
from types import SimpleNamespace
from typing import Any, Collection

from . import failpoints, sharded
from .checkpoint import Checkpoint, dumps, loads
from .distributed import Group, ShardedRun, _describe
from .errors import (AgckError, CheckpointNotFoundError, ContentChangedError, SnapshotError, StaleEpochError,
                     UsageError)
from .recovery import store_candidates, walk_back
from .stores.tiered import Copy, NotYet, TieredStore

log = logging.getLogger("agck")


def holders_of(rank: int, host_of: list[int], replicas: int) -> list[int]:
    """The ranks that keep replicas of ``rank``'s part: the rank at its place on each
    of the next ``replicas`` hosts of the ring (fewer when there are fewer other hosts)."""
    hosts: dict[int, list[int]] = {}
    for r, h in enumerate(host_of):
        hosts.setdefault(h, []).append(r)
    order = sorted(hosts)
    h = host_of[rank]
    place = hosts[h].index(rank)
    out = []
    for j in range(1, min(replicas, len(order) - 1) + 1):
        peers = hosts[order[(order.index(h) + j) % len(order)]]
        out.append(peers[place % len(peers)])
    return out


class TieredShardedRun(ShardedRun):
    """One run's multi-rank checkpoints over a tiered store, seen from one rank."""

    def __init__(self, store: TieredStore, run: str, group: Group):
        self.store, self.run, self.group = store, run, group
        self.rank, self.world_size = group.rank, group.size
        self._committed: set[tuple[int, int]] = set()
        self._writes = 0
        urls = group.all_gather(store.local.url)
        first = {u: urls.index(u) for u in urls}          # a host is named by its first rank
        self.host_of = [first[u] for u in urls]
        self.hosts = len(first)
        self.leader = first[urls[self.rank]] == self.rank   # puts this host's commit records
        self.holders = [holders_of(r, self.host_of, store.replicas) for r in range(self.world_size)]
        self.held = [r for r in range(self.world_size) if self.rank in self.holders[r]]
        # each host's first rank makes its local parts namespace before the others open it
        self._everywhere(lambda: store.local.parts_store() if self.leader else None, "open its local tier's parts")
        self.local_parts = store.local.parts_store()
        self.parts = self.local_parts
        self._from_rank0(store.durable.parts_store, "open the durable tier's parts namespace", send=False)
        self.durable_parts = store.durable.parts_store()
        self.restored_from: str | None = None     # where this rank's restored part came from

    def _everywhere(self, fn, what: str) -> Any:
        """``fn()`` on every rank; a failure on any rank is raised on every rank."""
        try:
            value, err = fn(), None
        except Exception as e:
            value, err = None, _describe(e)
        errs = self.group.all_gather(err)
        bad = [(r, e) for r, e in enumerate(errs) if e is not None]
        if bad:
            raise SnapshotError(f"run {self.run!r}: " + "; ".join(f"rank {r} could not {what}: {e}" for r, e in bad),
                                ref=self.store.url)
        return value

    # -- incarnations ------------------------------------------------------------------
    def begin_epoch(self) -> int:
        """Rank 0 begins an epoch in the durable tier, past every host's local one;
        each host's first rank brings its local tier to it."""
        seen = self.group.all_gather((self.store.local.epoch(self.run) or 0) if self.leader else 0)

        def begin() -> int:
            epoch = self.store.durable.begin_epoch(self.run)
            while epoch <= max(seen):
                epoch = self.store.durable.begin_epoch(self.run)
            return epoch
        epoch = self._from_rank0(begin, "begin a new epoch")
        self._everywhere(lambda: self.store.raise_local_epoch(self.run, epoch) if self.leader else None,
                         f"bring its local tier to epoch {epoch}")
        return epoch

    def clean_partial(self) -> list[str]:
        """Each host's first rank removes its local tier's parts no commit record binds
        and none can any more (earlier incarnations'); rank 0 the durable tier's, sparing
        those of a step some host's tier has a commit record of (its durable commit may
        not have been made: they are what a restore falls back to)."""
        local_steps = self.group.all_gather(self.store.local.steps(self.run) if self.leader else [])
        committed = set().union(*map(set, local_steps))
        removed: list[str] = []
        try:
            if self.leader:
                removed += sharded.clean_partial(self.store.local, self.run)
            if self.rank == 0:
                parts = self.store.durable.parts_store(create=False)
                for p in sharded.partial_parts(self.store.durable, self.run):
                    if p.removable and p.step not in committed and parts is not None:
                        try:
                            parts.delete(sharded.part_run(p.run, p.epoch, p.rank), p.step)
                            removed.append(p.ref)
                        except CheckpointNotFoundError:
                            pass
        except Exception as e:    # only housekeeping: `agck recover --clean` reports what is left
            log.warning("agck: run %r: removing partial parts failed: %s", self.run, _describe(e))
        self.group.barrier()
        return removed

    def delete_all(self, epoch: int) -> None:
        """resume=False: every host's local commit records and parts, and the durable tier's."""
        def delete() -> None:
            tiers = ([self.store.local] if self.leader else []) + ([self.store.durable] if self.rank == 0 else [])
            for tier in tiers:
                for s in tier.steps(self.run):
                    tier.delete(self.run, s, epoch=epoch if tier is self.store.local else None)
                sharded.clean_partial(tier, self.run)
        self._everywhere(delete, "delete the old checkpoints")

    # -- write ---------------------------------------------------------------------------
    def write(self, step: int, state: Any, *, meta: Any, parent: int | None, epoch: int,
              expect_unchanged: Collection[int] = ()) -> str:
        """This rank's part of ``step`` in its host's tier and its holders', then the
        local commit; returns the commit record's ref once the step is acknowledged
        local on every rank (the durable copy follows in the background). Raises on
        every rank alike when it is not, as :meth:`ShardedRun.write` does."""
        nonce = sharded.new_nonce()
        payload = b""
        try:
            name = self.part_run(epoch)
            if (epoch, step) in self._committed:
                raise UsageError(f"step {step} of run {self.run!r} is already committed in epoch {epoch}",
                                 hint="checkpoint a later step, or begin a new epoch to rewrite it")
            sharded.put_part(self.local_parts, self.run, step, epoch, self.rank, self.world_size, nonce, state,
                             parent=parent, expect_unchanged=expect_unchanged)
            if self.holders[self.rank]:
                payload = dumps(state, run=name, step=step, parent=parent,
                                meta=sharded.part_meta(self.run, step, epoch, self.rank, self.world_size, nonce))
            mine = {"ok": True, "nonce": nonce, "step": step, "epoch": epoch, "size": len(payload)}
        except ContentChangedError as e:
            mine = {"ok": False, "changed": True, "error": _describe(e)}
        except Exception as e:
            mine = {"ok": False, "error": _describe(e)}
        failpoints.hit("dist.after_part")
        outcomes = self._parts_written(mine, step, epoch)
        nonces = [o["nonce"] for o in outcomes]
        kept = self._replicate(step, epoch, parent, outcomes, payload)
        failpoints.hit("tier.after_replicas")
        errors = self.group.all_gather(kept)
        bad = [(r, e) for r, e in enumerate(errors) if e is not None]
        if bad:
            raise SnapshotError(f"step {step} of run {self.run!r} was not committed: "
                                + "; ".join(f"rank {r} could not keep a replica: {e}" for r, e in bad),
                                ref=self.store.ref(self.run, step), hint="the previous checkpoint is untouched")
        ref = err = None
        if self.leader:
            try:
                ref = sharded.commit_step(self.store.local, self.run, step, epoch, nonces, meta=meta, parent=parent)
            except Exception as e:
                err = {"error": _describe(e), "stale": isinstance(e, StaleEpochError)}
        failpoints.hit("tier.after_local_commit")
        errors = self.group.all_gather(err)
        bad = [(r, e) for r, e in enumerate(errors) if e is not None]
        if bad:
            why = "; ".join(f"rank {r}: {e['error']}" for r, e in bad)
            if all(e["stale"] for _, e in bad):     # a newer incarnation fenced this one, on every host that said
                raise StaleEpochError(f"step {step} of run {self.run!r} was not committed: {why}",
                                      ref=self.store.ref(self.run, step))
            raise SnapshotError(f"step {step} of run {self.run!r}: every part and replica is kept but the "
                                f"commit failed: {why}", ref=self.store.ref(self.run, step),
                                hint="the previous checkpoint is untouched")
        self._committed.add((epoch, step))
        self._writes += 1
        if self._writes % self.store.durable_every == 0:
            self.store.copy_later(Copy(self.part_run(epoch), step, parts=True, awaits=self.run))
            if self.rank == 0:
                self.store.copy_later(Copy(self.run, step, epoch, ready=self._parts_durable(step, epoch, nonces)))
        if self.leader:
            self._retain()
        return ref or self.store.local.ref(self.run, step)

    def _replicate(self, step: int, epoch: int, parent: int | None, outcomes: list, payload: bytes) -> str | None:
        """Send this rank's part to its holders and keep the replicas this rank holds;
        None, or why a replica was not kept."""
        pairs = [(r, h, outcomes[r]["size"]) for r in range(self.world_size) for h in self.holders[r]]
        try:
            got = _exchange(self.group.pg, self.rank, pairs, {h: payload for h in self.holders[self.rank]})
        except Exception as e:
            return f"sending the replicas failed: {_describe(e)}"
        for r, buf in sorted(got.items()):
            want = sharded.part_meta(self.run, step, epoch, r, self.world_size, outcomes[r]["nonce"])
            try:
                ck = loads(buf.numpy(), verify=True, copy=False, ref=f"rank {r}'s part, as sent")
                if ck.meta != want:
                    return f"rank {r}'s part arrived with meta {ck.meta!r}"
                self.local_parts.put(sharded.part_run(self.run, epoch, r), step, ck.state, meta=ck.meta,
                                     parent=parent)
            except Exception as e:
                return f"rank {r}'s part: {_describe(e)}"
        return None

    def _parts_durable(self, step: int, epoch: int, nonces: list[str]):
        """The durable commit's ``ready``: every part it binds is in the durable tier
        (False: a newer step is durable already, so this one need not be)."""
        def ready() -> bool:
            newest = self.store.durable.steps(self.run, last=1)
            if newest and newest[0] > step:
                return False
            for r, nonce in enumerate(nonces):
                name = sharded.part_run(self.run, epoch, r)
                info = next((i for i in self.durable_parts.list(name) if i.step == step), None)
                bound = (info.meta or {}).get(sharded.PART_KEY) if info is not None and isinstance(info.meta, dict) \
                    else None
                if info is None or (bound is not None and bound.get("nonce") != nonce):
                    raise NotYet(f"rank {r}'s part of step {step} is not durable yet")
            failpoints.hit("tier.before_durable_commit")
            return True
        return ready

    def _retain(self) -> None:
        """Prune this host's local tier to ``keep_local`` committed steps and to
        ``keep_local_bytes`` of parts and replicas, oldest first, sparing what the
        durable tier does not make safe to delete (a step newer than its newest, a copy
        still queued) and the newest step; then drop the parts and replicas older than
        the oldest step kept."""
        keep, budget = self.store.keep_local, self.store.keep_local_bytes
        if keep is None and budget is None:
            return
        try:
            steps = self.store.local.steps(self.run)
            newest = self.store.last_durable_step(self.run)
            if len(steps) < 2 or newest is None:
                return
            drop = set(steps[:-keep]) if keep is not None and len(steps) > keep else set()
            mine = [(name, info) for name in self.local_parts.runs()
                    if (sharded.parse_part_run(name) or ("",))[0] == self.run
                    for info in self.local_parts.list(name)]
            if budget is not None:
                size: dict[int, int] = {}
                for _, info in mine:
                    size[info.step] = size.get(info.step, 0) + (info.size or 0)
                total = sum(n for s, n in size.items() if s not in drop)
                for s in steps[:-1]:
                    if total <= budget:
                        break
                    if s not in drop:
                        drop.add(s)
                        total -= size.get(s, 0)
            # one view of the durable tier for both rules below, so no part outlives its dropped record
            pending = set(self.store.pending)
            dropped = False
            for s in sorted(drop):
                if s > newest or (self.run, s) in pending:
                    break          # oldest first: what is older than a step kept is not dropped
                self.store.local.delete(self.run, s)
                dropped = True
            oldest = min(self.store.local.steps(self.run) or [steps[-1]])
            for name, info in mine:
                if info.step < oldest and info.step <= newest and (name, info.step) not in pending:
                    self.local_parts.delete(name, info.step)
                    dropped = True
            if dropped:
                self.store.local.collect_garbage()
                self.local_parts.collect_garbage()
        except (CheckpointNotFoundError, OSError) as e:    # another rank of this host, or housekeeping
            log.info("agck: run %r: pruning the local tier: %s", self.run, e)
        except AgckError as e:
            log.warning("agck: run %r: pruning the local tier failed: %s", self.run, e)

    # -- restore -------------------------------------------------------------------------
    def find(self, *, map_location=None):
        """The newest step every rank can restore from some tier (see the module docstring)."""
        here = self.store.local.steps(self.run) if self.leader else []
        hosts = self.group.all_gather(here)
        durable = self._from_rank0(lambda: self.store.durable.steps(self.run), "list the durable tier's steps")
        steps = sorted(set(durable).union(*map(set, hosts)))
        rec = walk_back(self.run, store_candidates(self.store, self.run, steps),
                        lambda c: self._judge_everywhere(c.step, map_location), count=len(steps))
        commit, part = rec.checkpoint if rec.checkpoint is not None else (None, None)
        if part is None:
            self.restored_from = None
        return commit, part, rec.rejected, len(steps)

    def _commit_here(self, step: int) -> sharded.Commit | None:
        """``step``'s commit record from this host's tier, else the durable one (verified); None if neither."""
        for tier in (self.store.local, self.store.durable):
            try:
                commit = sharded.as_commit(tier.read(self.run, step))
            except AgckError as e:
                if not (e.verdict or isinstance(e, CheckpointNotFoundError)):
                    raise
                continue
            if commit is not None:
                return commit
        return None

    def _judge_everywhere(self, step: int, map_location) -> tuple[sharded.Commit, Checkpoint]:
        """(commit, this rank's part) of ``step`` if every rank can restore it from some
        tier. Every rank makes the same collectives whatever it finds (a failure is
        carried to the gather of verdicts, :meth:`_decide`)."""
        part = fatal = None
        self.restored_from = None
        try:
            mine_commit = self._commit_here(step)
        except Exception as e:
            mine_commit, fatal = None, {"fatal": _describe(e), "local": e}
        # the ranks agree on one record: the newest epoch's, from the first rank that has it
        have = self.group.all_gather(None if mine_commit is None else mine_commit.epoch)
        epochs = [e for e in have if e is not None]
        if not epochs:
            return self._decide(step, None, None, fatal or {
                "reject": "no tier holds its commit record whole", "ref": self.store.ref(self.run, step)})
        src = have.index(max(epochs))
        body = self.group.broadcast({"state": mine_commit.state(), "meta": mine_commit.meta}
                                    if self.rank == src else None, src=src)
        try:       # the same record on every rank: what follows is decided alike everywhere
            commit = sharded.as_commit(SimpleNamespace(state=body["state"], meta=body["meta"], run=self.run,
                                                       step=step, ref=self.store.ref(self.run, step)))
        except AgckError as e:
            return self._decide(step, None, None, fatal or {"reject": e.reason, "ref": e.ref, "section": "commit"})
        if commit.world_size != self.world_size:
            return self._decide(step, commit, None, fatal or {
                "fatal": f"run {self.run!r} step {step} was checkpointed by {commit.world_size} ranks and this job "
                         f"has {self.world_size}: a snapshot's per-rank state cannot be resharded", "usage": True})
        why = "missing"
        here = False
        if fatal is None:
            try:
                here = step in self.local_parts.steps(commit.parts[self.rank].run)
            except AgckError as e:
                fatal = {"fatal": _describe(e), "local": e}
        # the ranks whose part is not here ask its holders first, so a holder reads the
        # replica while the others read their own parts
        if any(self.holders):
            part = self._from_peers(commit, not here and fatal is None, map_location)
        if part is None and here and fatal is None:
            part, fatal, why = self._own_part(commit, self.local_parts, "local", map_location)
            if part is None and fatal is None:
                log.warning("agck: %s: this host's copy of rank %d's part is damaged (%s); asking its "
                            "peers", self.store.ref(self.run, step), self.rank, why)
        damaged_here = part is None and here and fatal is None
        if any(self.holders) and any(self.group.all_gather(damaged_here)):    # a second round, for those
            got = self._from_peers(commit, damaged_here, map_location)
            part = got if got is not None else part
        if part is None and fatal is None and self.durable_parts is not None:
            part, fatal, durable_why = self._own_part(commit, self.durable_parts, "durable", map_location)
            why = f"{why}; no peer's replica; the durable tier's: {durable_why}"
        if fatal is not None:
            mine = fatal
        elif part is None:
            mine = {"reject": f"no tier holds rank {self.rank}'s part whole: this host's: {why}",
                    "ref": self.store.ref(self.run, step), "section": "part"}
        else:
            mine = {"ok": True, "commit": [commit.epoch, [p.nonce for p in commit.parts]]}
        return self._decide(step, commit, part, mine)

    def _own_part(self, commit: sharded.Commit, parts, tier: str, map_location):
        """(this rank's part read from ``parts`` and verified, None, None); else (None,
        None, why) for a verdict, (None, the fatal outcome, why) for any other error."""
        try:
            part = sharded.read_part(self.store, commit, self.rank, map_location=map_location, parts=parts)
        except AgckError as e:
            return None, None if e.verdict else {"fatal": _describe(e), "local": e}, e.reason
        self.restored_from = tier
        return part, None, None

    def _from_peers(self, commit: sharded.Commit, need: bool, map_location) -> Checkpoint | None:
        """The ranks that ``need`` their part ask a holder with a replica of it (a
        collective: every rank calls it, needing or not). The replica is read and
        verified by its holder, sent, verified and checked against the record here,
        then written back into this host's tier. Returns this rank's part if it
        needed one and a peer had it whole, else None."""
        step = commit.step
        holds = []
        for r in self.held:
            try:
                if step in self.local_parts.steps(commit.parts[r].run):
                    holds.append(r)
            except AgckError:
                pass
        plan = self.group.all_gather({"need": need, "holds": holds})
        part = None
        asks = []     # (holder, rank)
        for r in range(self.world_size):
            if plan[r]["need"]:
                src = next((h for h in self.holders[r] if r in plan[h]["holds"]), None)
                if src is not None:
                    asks.append((src, r))
        if not asks:
            return part
        outgoing = {}
        for src, r in asks:
            if src == self.rank:
                try:
                    ck = sharded.read_part(self.store, commit, r, parts=self.local_parts)
                    # the container as stored and verified here (else encoded again)
                    outgoing[r] = memoryview(ck.container).cast("B") if ck.container is not None else \
                        dumps(ck.state, run=ck.run, step=step, parent=ck.parent, meta=ck.meta)
                except AgckError as e:
                    log.warning("agck: %s: the replica of rank %d's part kept here does not verify: %s",
                                self.store.ref(self.run, step), r, e.reason)
                    outgoing[r] = b""
        sizes = self.group.all_gather([[r, len(b)] for r, b in outgoing.items()])
        size_of = {(src, r): n for src, got in enumerate(sizes) for r, n in got}
        pairs = [(src, r, size_of.get((src, r), 0)) for src, r in asks]
        got = _exchange(self.group.pg, self.rank, pairs, outgoing)
        buf = next((b for src, b in got.items()), None)
        if buf is None:
            return part
        try:
            ck = loads(buf.numpy(), verify=True, map_location=map_location,
                       ref=f"rank {self.rank}'s part of step {step}, from a peer")
            ck = sharded.check_bound(ck, commit, self.rank)
        except AgckError as e:
            log.warning("agck: %s: rank %d's part from a peer does not verify: %s", self.store.ref(self.run, step),
                        self.rank, e.reason)
            return part
        self.restored_from = "peer"
        # this host's tier holds it again (the next restore is local), written in the
        # background from the received bytes (immutable now: the state restored is a copy)
        name = commit.parts[self.rank].run
        threading.Thread(target=self._heal, args=(name, step, buf, ck.parent), name="agck-heal", daemon=False).start()
        return ck

    def _heal(self, name: str, step: int, buf, parent: int | None) -> None:
        try:
            view = loads(buf.numpy(), verify=False, copy=False)
            self.local_parts.put(name, step, view.state, meta=view.meta, parent=parent)
        except Exception as e:     # the part stays on the peer and in the durable tier
            log.warning("agck: %s: writing rank %d's part back into this host's tier failed: %s",
                        self.local_parts.ref(name, step), self.rank, e)


def _exchange(pg, rank: int, pairs: list[tuple[int, int, int]], outgoing: dict[int, Any]) -> dict[int, Any]:
    """Post every send and receive of ``pairs`` (source, destination, size) this rank
    takes part in over the group ``pg`` (``outgoing``: its bytes by destination), then
    wait for all: gloo pairs each send with its receive, so the order of posting cannot
    deadlock. Empty transfers are skipped on both sides. Returns the received buffers
    (uint8 tensors) by source rank."""
    import torch
    import torch.distributed as dist
    reqs, got = [], {}
    with warnings.catch_warnings():       # a read-only buffer: the send only reads it
        warnings.simplefilter("ignore", UserWarning)
        for src, dst, size in pairs:
            if size <= 0 or src == dst:
                continue
            if src == rank:
                reqs.append(dist.isend(torch.frombuffer(outgoing[dst], dtype=torch.uint8), dst, group=pg))
            elif dst == rank:
                got[src] = torch.empty(size, dtype=torch.uint8)
                reqs.append(dist.irecv(got[src], src, group=pg))
    for req in reqs:
        req.wait()
    return got
