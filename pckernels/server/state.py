"""What the routes of one server share: :class:`ServerState`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pckernels.server.engine import ServingEngine
from pckernels.server.metrics import ServerMetrics
from pckernels.server.protocol import APIError
from pckernels.server.response_store import ResponseStore
from pckernels.server.schemas import SchemaRecord, SchemaRegistry
from pckernels.server.tenants import Tenants
from pckernels.server.tool_parsers import HermesParser, ToolParser


@dataclass
class ServerState:
    """The engine, tenants, schemas, metrics and limits of one server."""

    engine: ServingEngine
    tenants: Tenants
    registry: SchemaRegistry
    metrics: ServerMetrics
    model_name: str
    request_timeout: float | None
    default_max_tokens: int
    tool_parser: ToolParser = field(default_factory=HermesParser)
    """The tool-call format answers are parsed in (``serve --tool-call-parser``)."""
    startup: list[SchemaRecord] = field(default_factory=list)
    created: int = field(default_factory=lambda: int(time.time()))
    stopping: bool = False
    responses: ResponseStore = field(default_factory=ResponseStore)
    """Stored responses of ``/v1/responses`` (``store: true``), per tenant."""

    @property
    def fingerprint(self) -> str:
        return "promptcache-" + str(getattr(self.engine, "model_id", ""))[:12]

    def check_model(self, name: str) -> None:
        """Refuse a request for a model other than the one served (``default`` names it too)."""
        if name not in (self.model_name, "default"):
            raise APIError(404, f"The model {name!r} does not exist; this server serves {self.model_name!r}.",
                           param="model", code="model_not_found")
