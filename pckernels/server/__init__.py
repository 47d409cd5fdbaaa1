"""``promptcache serve``: an OpenAI-compatible HTTP server over one engine (``docs/server.md``)."""

from pckernels.server.app import create_app
from pckernels.server.protocol import APIError
from pckernels.server.tenants import Tenant, Tenants, load_keys, server_secret

__all__ = ["APIError", "Tenant", "Tenants", "create_app", "load_keys", "server_secret"]
