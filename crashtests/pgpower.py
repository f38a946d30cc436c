"""A private Postgres cluster whose server processes run under the power-cut shim.

:class:`PowerCluster` is a :class:`crashtests.pgcluster.PgCluster` whose
``postgres`` (the postmaster and every process it forks) is started with
``crashtests/powercut.c`` preloaded, tracking the data directory. ``initdb``
runs without it: it syncs everything it writes, so what it leaves is durable.
After :meth:`kill` with ``"sigkill"``, :meth:`cut` leaves the data directory as a
power cut would have; :meth:`restart` then runs crash recovery on that image.
"""

from __future__ import annotations

import os
import pwd
import random
import subprocess

from . import powercut
from .pgcluster import BINDIR, OS_USER, PgCluster


class PowerCluster(PgCluster):
    @property
    def cutlog(self) -> str:
        """The shim's log: beside the data directory, writable by the ``postgres`` user."""
        return os.path.join(self.base, "powercut.log")

    def launch(self) -> None:
        """Start the server under the shim (or restart it after a cut) and wait until it answers."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("the cluster is already running")
        pe = powercut.env({}, self.data, self.cutlog)
        pw = pwd.getpwnam(OS_USER)
        os.chown(self.cutlog, pw.pw_uid, pw.pw_gid)
        # runuser may clean the environment; env(1) puts the variables on postgres itself
        shim = [f"{k}={pe[k]}" for k in ("LD_PRELOAD", "AGCK_POWERCUT_DIR", "AGCK_POWERCUT_LOG")]
        self._log = open(os.path.join(self.base, "server.log"), "ab")
        self.proc = subprocess.Popen(["runuser", "-u", OS_USER, "--", "env", *shim, f"{BINDIR}/postgres",
                                      "-D", self.data],
                                     stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, cwd="/")
        self.wait_ready()

    def cut(self, mode: str = "drop", rng: random.Random | None = None, *, dirs: str = "linux") -> dict:
        """The power cut on the data directory (the server must be down: :meth:`kill` first);
        :func:`crashtests.powercut.cut`'s summary."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("cut the power only after the server was killed")
        return powercut.cut(self.data, self.cutlog, mode, rng, dirs=dirs)
