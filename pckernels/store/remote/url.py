"""Remote tier URLs: the ``redis://`` / ``valkey://`` forms checked, and passwords kept out of logs."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

SCHEMES = ("redis", "rediss", "unix", "valkey", "valkeys")


def parse_remote_url(url: str) -> str:
    """Check a remote URL (``redis://[:password@]host:port/db``, ``rediss://``, ``unix://``, or the
    ``valkey://`` / ``valkeys://`` spellings) and return it in the form redis-py reads; a
    ``ValueError`` saying what is wrong otherwise."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"remote must be a URL such as redis://127.0.0.1:6379/0, got {url!r}")
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise ValueError(f"remote URL scheme must be one of {', '.join(SCHEMES)}, got {url!r}")
    if scheme != "unix":
        if not parts.hostname:
            raise ValueError(f"remote URL has no host: {url!r}")
        try:
            parts.port
        except ValueError:
            raise ValueError(f"remote URL has a bad port: {url!r}") from None
        db = parts.path.strip("/")
        if db and not db.isdigit():
            raise ValueError(f"remote URL database must be a number, got {db!r} in {url!r}")
    scheme = {"valkey": "redis", "valkeys": "rediss"}.get(scheme, scheme)
    return urlunsplit((scheme, parts.netloc, parts.path, parts.query, parts.fragment))


def redact(url: str) -> str:
    """``url`` without its password (for logs, stats and metrics)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit((parts.scheme, user + netloc, parts.path, parts.query, parts.fragment))
