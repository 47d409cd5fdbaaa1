"""A throw-away ``redis-server`` on loopback for tests and benchmarks of the remote tier.

Needs the ``redis-server`` binary (Debian: ``apt-get install redis-server``; Valkey's
``valkey-server`` works too). Nothing is persisted: no RDB snapshots, no AOF.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time

SERVER_BINARIES = ("redis-server", "valkey-server")


def server_binary() -> str | None:
    """Path of ``redis-server`` (or ``valkey-server``), ``None`` when neither is installed."""
    for name in SERVER_BINARIES:
        path = shutil.which(name)
        if path:
            return path
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRedis:
    """A ``redis-server`` bound to 127.0.0.1 on ``port`` (a free one by default).

    ``extra``: more server arguments (``["--maxmemory", "1mb"]``). ``start`` waits until it
    answers PING; ``kill`` ends it at once (SIGKILL, like a crash); ``start`` again gives an empty
    server on the same port. Use as a context manager or call ``stop``.
    """

    def __init__(self, port: int | None = None, extra: list[str] | None = None) -> None:
        binary = server_binary()
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
        self.binary = binary
        self.port = port or free_port()
        self.extra = list(extra or [])
        self.dir = tempfile.mkdtemp(prefix="promptcache-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> "LocalRedis":
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", self.dir, "--enable-debug-command", "local", *self.extra]
        log = open(os.path.join(self.dir, "server.log"), "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {self.log()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.kill()
        raise TimeoutError(f"redis-server on port {self.port} did not answer within {timeout_s} s")

    def log(self) -> str:
        try:
            with open(os.path.join(self.dir, "server.log"), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def client(self, **options):
        import redis

        return redis.Redis.from_url(self.url, **options)

    def kill(self) -> None:
        """End the server at once (its data is lost)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "LocalRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
