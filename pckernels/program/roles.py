"""What a prompt program's body calls at run time: role helpers and the ``MaxTokens`` marker.

The role helpers return plain strings, so the decorated function stays an ordinary Python
function. Their text depends on the chat format in effect (``pckernels.program.format``):
``ProgramCall.render(tokenizer)`` sets the tokenizer's (:func:`pckernels.pml.role_format`, the
same expansion PML role tags get) for the thread or task that renders; outside a render the
plain fallback applies (``"User: …\\n"``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pckernels.program.call import ProgramCall
from pckernels.program.format import current_format


@dataclass(frozen=True)
class MaxTokens:
    """Declares a ``str`` parameter's maximum length in tokens: ``Annotated[str, MaxTokens(32)]``.

    Interpolated into the prompt, such a parameter becomes a PML ``<param len="32"/>``; an
    argument longer than that is refused when the program is run on an engine.
    """

    tokens: int

    def __post_init__(self) -> None:
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 1:
            raise ValueError(f"MaxTokens needs a positive int, not {self.tokens!r}")


def _expand(role: str, content: str) -> str:
    if isinstance(content, ProgramCall):
        content = str(content)
    if not isinstance(content, str):
        raise TypeError(f"{role}() takes a str, not {type(content).__name__}")
    found = current_format()
    if role not in found.affixes:
        raise ValueError(f"{role}() cannot be expanded: {found.unsupported.get(role, 'unsupported role')}")
    prefix, suffix = found.affixes[role]
    return prefix + content + suffix


def system(content: str) -> str:
    """A system message: the chat format's prefix + ``content`` + suffix (PML ``<system>``)."""
    return _expand("system", content)


def user(content: str) -> str:
    """A user message (PML ``<user>``)."""
    return _expand("user", content)


_NO_CONTENT = object()


def assistant(content: str = _NO_CONTENT) -> str:  # type: ignore[assignment]
    """An assistant message (PML ``<assistant>``); without ``content``, the generation prompt
    (PML ``<assistant/>``: what ``add_generation_prompt=True`` appends)."""
    if content is _NO_CONTENT:
        return current_format().generation_prompt
    return _expand("assistant", content)


ROLE_HELPERS = {system: "system", user: "user", assistant: "assistant"}
"""The helpers the compiler recognizes, by identity, and the PML role tag of each."""
