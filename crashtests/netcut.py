"""Fault kind ``netcut``: the connections to the object store cut mid-request.

A trial runs a workload whose object store endpoint is a :class:`FaultProxy` in
front of the campaign's SeaweedFS server, and resets every connection through
the proxy at random instants of its run (one to five cuts, 10-400 ms apart; now
and then one that also refuses new connections for up to a second). Client and
server stay up: requests fail half-sent or half-answered, and the client retries
them or the put fails with an error, as on a flaky network. The workload either
carries on or ends with that error.

Contract: :func:`trials` runs ``cfg.n(store, "netcut")`` trials on each object
store configuration (``s3``; ``pgs3``, whose chunks go through the proxy),
``cfg.jobs`` at a time; a trial not started before the time limit is skipped.
Each is judged as a ``kill`` trial is (:meth:`crashtests.trialkit.TrialKit.check`):
every acknowledged checkpoint recovers, bit-identical, through a clean connection.
"""

from __future__ import annotations

import os
import subprocess
from urllib.parse import quote, urlsplit

from .checker import Trial
from .faultproxy import FaultProxy
from .trialkit import TrialKit, log

STORES = ("s3", "pgs3")


def trials(c: TrialKit) -> None:
    cfg = c.cfg
    if "netcut" not in cfg.faults or c.s3 is None:
        return
    stores = [s for s in cfg.stores if s in STORES]
    if not stores or not c.starts("netcut"):
        return
    c.proxy = FaultProxy("127.0.0.1", urlsplit(c.s3.endpoint).port)
    jobs = []
    for s in stores:
        for _ in range(cfg.n(s, "netcut")):
            t = c.new_trial(s, "netcut", "n", c.trial_url(s))
            jobs.append((t, _through_proxy(c, c.client_url(t))))
    log(cfg, f"connection cuts: {len(jobs)} workload processes through a fault proxy, {cfg.jobs} at a time")
    try:
        c.pool(lambda j: trial(c, *j), jobs)
    finally:
        c.proxy.close()


def _through_proxy(c: TrialKit, url: str) -> str:
    """``url`` with its object store endpoint replaced by the proxy's (an s3:// URL, or
    a Postgres URL whose agck_objects names one)."""
    return (url.replace(c.s3.endpoint, c.proxy.endpoint)
               .replace(quote(c.s3.endpoint, safe=":/"), quote(c.proxy.endpoint, safe=":/")))


def trial(c: TrialKit, t: Trial, client_url: str) -> None:
    d = os.path.join(c.work, "t", str(t.id))
    os.makedirs(d)
    p = c.spawn(c.workload_cmd(client_url, t.run, d, c.rng.choice(("sync", "async"))), d)
    cuts = 0
    try:
        c.wait_started(p, d)
        try:
            p.wait(timeout=c.rng.uniform(0, 0.6 * c.est[t.store]))
        except subprocess.TimeoutExpired:
            for _ in range(c.rng.randint(1, 5)):
                if c.rng.random() < 0.2:
                    c.proxy.cut_for(c.rng.uniform(0.1, 1.0))
                else:
                    c.proxy.cut()
                cuts += 1
                try:
                    p.wait(timeout=c.rng.uniform(0.01, 0.4))
                    break
                except subprocess.TimeoutExpired:
                    pass
        if cuts:
            t.reached = True
            t.point = f"{cuts} cuts"
        else:
            t.detail = "the workload finished before the first cut"
        if c.finish(p, 300):
            t.reasons.append("the workload hung after the connections were cut")
            t.hung = True
        if p.returncode not in (0, None):
            err = c.stderr(d).strip()
            t.detail = f"workload exited {p.returncode} after {cuts} cuts: {err.splitlines()[-1][:200] if err else ''}"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    c.check(t, d)
    c.own.done(t)
