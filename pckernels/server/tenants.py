"""API keys, tenants and the cache salt the server derives for each tenant.

Every cache key a tenant's request makes (module blocks and prefix blocks) carries the tenant's
salt: ``HMAC-SHA256(server secret, tenant name)``. The client never chooses it, so one tenant can
neither reuse another's cached states nor learn from a fast answer that another tenant sent the
same text (the timing side channel of a shared cache). Schemas an admin declares *shared* are
encoded without a salt and visible to every tenant, on purpose.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

SECRET_ENV = "PROMPTCACHE_SALT_SECRET"
SECRET_FILE = "server-salt.key"


@dataclass(frozen=True)
class Tenant:
    """Who a request is from: ``name``, the ``salt`` of its cache keys and whether it may declare
    shared schemas (``admin``)."""

    name: str
    salt: str
    admin: bool = False


class Tenants:
    """Bearer API keys -> :class:`Tenant`. Without keys there is one tenant, ``default``, whose
    salt is empty (its cache is the library's own) and every request is from it."""

    def __init__(self, keys: dict[str, tuple[str, bool]] | None, secret: bytes) -> None:
        self._secret = secret
        self.open = not keys
        self._by_key: dict[str, Tenant] = {}
        for key, (name, admin) in (keys or {}).items():
            self._by_key[key] = Tenant(name, self.salt_for(name), admin)
        self.default = Tenant("default", "", True) if self.open else None

    def salt_for(self, tenant: str) -> str:
        """The cache salt of ``tenant`` (hex), derived with the server's secret."""
        return hmac.new(self._secret, tenant.encode("utf-8"), hashlib.sha256).hexdigest()[:32]

    def authenticate(self, authorization: str | None) -> Tenant | None:
        """The tenant of an ``Authorization: Bearer KEY`` header; None when the key is missing or
        unknown (always the default tenant when the server runs without keys)."""
        if self.open:
            return self.default
        if not authorization or not authorization.lower().startswith("bearer "):
            return None
        presented = authorization[7:].strip()
        for key, tenant in self._by_key.items():
            if hmac.compare_digest(key.encode(), presented.encode()):
                return tenant
        return None

    @property
    def names(self) -> list[str]:
        return sorted({t.name for t in self._by_key.values()})


def load_keys(path: str | os.PathLike) -> dict[str, tuple[str, bool]]:
    """Read an API-key file: a JSON object ``{"KEY": "tenant", "KEY2": {"tenant": "t",
    "admin": true}}``. Raises ``ValueError`` naming the problem."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read the API-key file {str(path)!r}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"the API-key file {str(path)!r} is not JSON: {exc}") from None
    if not isinstance(data, dict) or not data:
        raise ValueError(f"the API-key file {str(path)!r} must be a non-empty JSON object of key -> tenant")
    keys: dict[str, tuple[str, bool]] = {}
    for key, value in data.items():
        if isinstance(value, str):
            name, admin = value, False
        elif isinstance(value, dict) and isinstance(value.get("tenant"), str):
            name, admin = value["tenant"], bool(value.get("admin", False))
        else:
            raise ValueError(f"API key {key[:4]}…: expected a tenant name or {{\"tenant\": ..., \"admin\": ...}}")
        if len(key) < 8 or not name:
            raise ValueError(f"API key {key[:4]}…: keys need at least 8 characters and a tenant name")
        keys[key] = (name, admin)
    return keys


def server_secret(store_dir: str | os.PathLike | None = None) -> bytes:
    """The secret tenant salts are derived from: ``$PROMPTCACHE_SALT_SECRET``; else a random one
    kept in ``store_dir`` (so a restarted server finds its disk tier again; created 0600); else
    a random one for this process only."""
    env = os.environ.get(SECRET_ENV)
    if env:
        return env.encode("utf-8")
    if store_dir is None:
        return secrets.token_bytes(32)
    path = Path(store_dir) / SECRET_FILE
    try:
        return bytes.fromhex(path.read_text().strip())
    except (OSError, ValueError):
        pass
    value = secrets.token_bytes(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(value.hex())
    return value
