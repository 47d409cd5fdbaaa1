"""Remote tier URLs: the ``redis://`` / ``valkey://`` forms and their ``+cluster`` spellings checked,
and passwords kept out of logs.

One server: ``redis://[[user]:password@]host:port[/db]``, ``rediss://`` (TLS), ``unix://path``,
``valkey://``, ``valkeys://``. A cluster: ``redis+cluster://[[user]:password@]host:port[,host:port…]``
(also ``rediss+cluster``, ``valkey+cluster``, ``valkeys+cluster``): any of its nodes, several for
start-up when one is down; database 0 only. A plain URL naming a cluster node works too (the mode
is detected on first connection, ``connect.py``).
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

CLUSTER = "+cluster"
SCHEMES = ("redis", "rediss", "unix", "valkey", "valkeys",
           "redis+cluster", "rediss+cluster", "valkey+cluster", "valkeys+cluster")
_REDIS_SPELLING = {"valkey": "redis", "valkeys": "rediss"}


def parse_remote_url(url: str) -> str:
    """Check a remote URL (the forms above) and return it with ``valkey`` spelled ``redis`` (the
    form redis-py reads, ``+cluster`` kept); a ``ValueError`` saying what is wrong otherwise."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"remote must be a URL such as redis://127.0.0.1:6379/0, got {url!r}")
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise ValueError(f"remote URL scheme must be one of {', '.join(SCHEMES)}, got {url!r}")
    base = scheme.removesuffix(CLUSTER)
    if base != "unix":
        hosts = parts.netloc.rsplit("@", 1)[-1].split(",") if scheme.endswith(CLUSTER) else [parts.netloc]
        for host in hosts:
            _check_host(parts._replace(netloc=host) if scheme.endswith(CLUSTER) else parts, url)
        db = parts.path.strip("/")
        if db and not db.isdigit():
            raise ValueError(f"remote URL database must be a number, got {db!r} in {url!r}")
        if scheme.endswith(CLUSTER) and db and int(db) != 0:
            raise ValueError(f"remote URL names database {db}, but a cluster has only database 0: {url!r}")
    scheme = _REDIS_SPELLING.get(base, base) + (CLUSTER if scheme.endswith(CLUSTER) else "")
    return urlunsplit((scheme, parts.netloc, parts.path, parts.query, parts.fragment))


def _check_host(parts, url: str) -> None:
    if not parts.hostname:
        raise ValueError(f"remote URL has no host: {url!r}")
    try:
        parts.port
    except ValueError:
        raise ValueError(f"remote URL has a bad port: {url!r}") from None


def cluster_nodes(url: str) -> list[str] | None:
    """For a ``…+cluster://`` URL (as :func:`parse_remote_url` returns it), one plain URL per node it
    names (``redis://[auth@]host:port``, ``rediss://`` for TLS) with the query kept; ``None`` for a
    URL of one server."""
    parts = urlsplit(url)
    if not parts.scheme.endswith(CLUSTER):
        return None
    scheme = parts.scheme.removesuffix(CLUSTER)
    auth, _, hosts = parts.netloc.rpartition("@")
    auth = auth + "@" if auth else ""
    return [urlunsplit((scheme, auth + host, "", parts.query, "")) for host in hosts.split(",")]


def redact(url: str) -> str:
    """``url`` without its password (for logs, stats and metrics)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit((parts.scheme, user + netloc, parts.path, parts.query, parts.fragment))
