"""PML, the Prompt Markup Language: schemas, prompts, layout and validation.

``parse_schema`` turns a ``<schema>`` into a laid-out ``Schema``; ``parse_prompt`` resolves a
``<prompt>`` against it into a ``ResolvedPrompt``. Every rejection is a ``PMLError``.
See ``docs/pml.md`` for the language reference.
"""

from pckernels.errors import PMLError
from pckernels.pml.document import NAME_RULE, Limits, is_valid_name
from pckernels.pml.model import (
    ROOT,
    LayoutEntry,
    Module,
    Param,
    ResolvedPrompt,
    Scaffold,
    Schema,
    Segment,
)
from pckernels.pml.prompt import check_answerable, parse_prompt
from pckernels.pml.roles import PLAIN_FORMAT, RoleFormat, role_format
from pckernels.pml.schema import LAYOUT_VERSION, parse_schema

__all__ = [
    "LAYOUT_VERSION",
    "NAME_RULE",
    "PLAIN_FORMAT",
    "ROOT",
    "LayoutEntry",
    "Limits",
    "Module",
    "PMLError",
    "Param",
    "ResolvedPrompt",
    "RoleFormat",
    "Scaffold",
    "Schema",
    "Segment",
    "check_answerable",
    "is_valid_name",
    "parse_prompt",
    "parse_schema",
    "role_format",
]
