"""A throw-away ``redis-server`` on loopback, or a cluster of them, for tests and benchmarks of the
remote tier.

Needs the ``redis-server`` binary (Debian: ``apt-get install redis-server``; Valkey's
``valkey-server`` works too), and ``redis-cli`` (``valkey-cli``; Debian's ``redis-tools``, which
``redis-server`` depends on) for a cluster. Nothing is persisted: no RDB snapshots, no AOF.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time

SERVER_BINARIES = ("redis-server", "valkey-server")
CLI_BINARIES = ("redis-cli", "valkey-cli")


def server_binary() -> str | None:
    """Path of ``redis-server`` (or ``valkey-server``), ``None`` when neither is installed."""
    for name in SERVER_BINARIES:
        path = shutil.which(name)
        if path:
            return path
    return None


def cli_binary() -> str | None:
    """Path of ``redis-cli`` (or ``valkey-cli``), ``None`` when neither is installed."""
    for name in CLI_BINARIES:
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

    def __init__(self, port: int | None = None, extra: list[str] | None = None, dir: str | None = None,
                 password: str | None = None) -> None:
        binary = server_binary()
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
        self.binary = binary
        self.port = port or free_port()
        self.password = password
        """``requirepass`` (and ``masterauth``, for a cluster's replicas) when given; the URL carries it."""
        self.extra = list(extra or []) + (["--requirepass", password, "--masterauth", password] if password else [])
        self.dir = dir or tempfile.mkdtemp(prefix="promptcache-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

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
                    if s.recv(16).startswith((b"+PONG", b"-NOAUTH")):
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


class LocalRedisCluster:
    """A Redis Cluster of ``masters`` (3) ``redis-server --cluster-enabled yes`` processes on loopback,
    each with ``replicas`` (0) more, joined with ``redis-cli --cluster create``; ``start`` waits
    until every node says ``cluster_state:ok``.

    ``node_timeout_ms``: how soon the others flag a dead node as failed; ``full_coverage``: the
    servers' ``cluster-require-full-coverage`` (``False``: the live masters keep serving their slots
    while one is down). ``kill(i)`` ends node ``i`` at once (SIGKILL; its keys are lost);
    ``restart(i)`` starts it again, empty, on its port with its ``nodes.conf``: it rejoins with its
    slots. Use as a context manager or call ``stop``.
    """

    def __init__(self, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 1000, full_coverage: bool = False,
                 extra: list[str] | None = None, password: str | None = None) -> None:
        cli = cli_binary()
        if cli is None:
            raise FileNotFoundError("redis-cli is not installed (apt-get install redis-tools)")
        self.cli = cli
        self.dir = tempfile.mkdtemp(prefix="promptcache-cluster-")
        args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(int(node_timeout_ms)),
                "--cluster-require-full-coverage", "yes" if full_coverage else "no", *(extra or [])]
        self.replicas = int(replicas)
        self.nodes: list[LocalRedis] = []
        for i in range(masters * (1 + self.replicas)):
            node_dir = os.path.join(self.dir, f"node{i}")
            os.makedirs(node_dir)
            # The cluster bus port is set (Redis >= 7): the default, port + 10000, may be taken or past 65535.
            self.nodes.append(LocalRedis(extra=[*args, "--cluster-port", str(free_port())], dir=node_dir,
                                         password=password))
        self.password = password

    @property
    def url(self) -> str:
        """The explicit cluster URL naming every node (with the password, when the nodes require one)."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis+cluster://{auth}" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def node_url(self, i: int = 0) -> str:
        """A plain ``redis://`` URL of node ``i`` (cluster mode is detected from it)."""
        return self.nodes[i].url

    def start(self, timeout_s: float = 30.0) -> "LocalRedisCluster":
        deadline = time.monotonic() + timeout_s
        try:
            for node in self.nodes:
                node.start()
            addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
            auth = ["-a", self.password, "--no-auth-warning"] if self.password else []
            done = subprocess.run([self.cli, *auth, "--cluster", "create", *addresses,
                                   "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                                  capture_output=True, text=True, timeout=max(1.0, deadline - time.monotonic()))
            if done.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
            self.wait_ok(max(1.0, deadline - time.monotonic()))
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ok(self, timeout_s: float = 20.0) -> None:
        """Wait until every running node says ``cluster_state:ok`` and knows every other node."""
        deadline = time.monotonic() + timeout_s
        while True:
            states = [self.info(i) for i, n in enumerate(self.nodes) if n.proc is not None]
            if all(s.get("cluster_state") == "ok" and int(s.get("cluster_known_nodes", 0)) == len(self.nodes)
                   for s in states):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the cluster did not reach cluster_state:ok within {timeout_s} s: {states}")
            time.sleep(0.05)

    def masters(self) -> list[int]:
        """Indices of the running nodes that are masters now (``ROLE``)."""
        out = []
        for i, node in enumerate(self.nodes):
            if node.proc is None:
                continue
            try:
                with node.client(socket_timeout=1.0) as client:
                    if client.execute_command("ROLE")[0] in (b"master", "master"):
                        out.append(i)
            except Exception:
                continue
        return out

    def info(self, i: int) -> dict[str, str]:
        """``CLUSTER INFO`` of node ``i`` as a dict (empty when it does not answer)."""
        try:
            with self.nodes[i].client(socket_timeout=1.0) as client:
                text = client.execute_command("CLUSTER", "INFO")
        except Exception:
            return {}
        text = text.decode() if isinstance(text, bytes) else str(text)
        return dict(line.split(":", 1) for line in text.split() if ":" in line)

    def client(self, **options):
        """A ``redis.cluster.RedisCluster`` on this cluster (tests inspect keys with it)."""
        from redis.cluster import ClusterNode, RedisCluster

        return RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", n.port) for n in self.nodes],
                            password=self.password, **options)

    def node_of(self, key: str | bytes, client=None) -> int:
        """Index of the node (the master) that holds ``key``'s slot, by the slot map of ``client`` (a
        :meth:`client`, made here when not given)."""
        own = client is None
        client = client or self.client()
        try:
            port = client.get_node_from_key(key).port
        finally:
            if own:
                client.close()
        return next(i for i, n in enumerate(self.nodes) if n.port == int(port))

    def kill(self, i: int) -> None:
        """End node ``i`` at once, like a crash (its keys are lost)."""
        self.nodes[i].kill()

    def restart(self, i: int, timeout_s: float = 20.0) -> None:
        """Start node ``i`` again (empty) and wait until the cluster is ok."""
        self.nodes[i].start()
        self.wait_ok(timeout_s)

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "LocalRedisCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
