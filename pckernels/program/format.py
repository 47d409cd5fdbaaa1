"""The chat format role helpers expand in: a tokenizer's inside ``chat_format(tokenizer)``, else
the plain fallback (``"User: …\\n"``). Per thread or task (a context variable)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

from pckernels.pml.roles import PLAIN_FORMAT, RoleFormat, role_format

_FORMAT: contextvars.ContextVar[RoleFormat] = contextvars.ContextVar("pckernels_program_format",
                                                                     default=PLAIN_FORMAT)


@contextlib.contextmanager
def chat_format(tokenizer: Any = None) -> Iterator[RoleFormat]:
    """Role helpers called inside this block expand in ``tokenizer``'s chat format (``None``:
    the plain fallback). Per thread/task (a context variable)."""
    token = _FORMAT.set(PLAIN_FORMAT if tokenizer is None else role_format(tokenizer))
    try:
        yield _FORMAT.get()
    finally:
        _FORMAT.reset(token)


def current_format() -> RoleFormat:
    """The chat format in effect for this thread or task."""
    return _FORMAT.get()
