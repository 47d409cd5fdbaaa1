"""Role tags (``<system>``, ``<user>``, ``<assistant>``) through the tokenizer's chat template.

Each role's *prefix* and *suffix* strings are found by rendering the template with a
sentinel as the message content and splitting the rendered text around the sentinel. The
render is diffed against the same conversation without the message, so text the template
adds for other reasons (a default system message when the first message is not a system
message, a BOS string the template writes before any message) stays out of the affixes;
that BOS belongs to the start of the schema (see ``RoleFormat.conversation_start``). The
*generation prompt* (an empty ``<assistant/>``) is what ``add_generation_prompt=True`` appends.

A tokenizer without a chat template gets the plain fallback ``PLAIN_FORMAT``:
``"System: {content}\\n"``, ``"User: {content}\\n"``, ``"Assistant: {content}\\n"`` and the
generation prompt ``"Assistant:"``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

from pckernels.pml.tokens import PerTokenizer

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
_SENTINEL = "PMLSENTINEL7Q3Z"
_OTHER = ("PMLCONTEXTAAA", "PMLCONTEXTBBB")

_CONTEXTS: dict[str, tuple[tuple[tuple[str, str], ...], ...]] = {
    "system": ((),),
    "user": ((("system", _OTHER[0]),), (("user", _OTHER[0]), ("assistant", _OTHER[1])), ()),
    "assistant": ((("system", _OTHER[0]), ("user", _OTHER[1])), (("user", _OTHER[1]),)),
}
_GENERATION_CONTEXTS = ((("system", _OTHER[0]), ("user", _OTHER[1])), (("user", _OTHER[1]),))


@dataclass(frozen=True)
class RoleFormat:
    """How role tags expand: ``affixes[role] = (prefix, suffix)`` and the generation prompt.

    A role missing from ``affixes`` is one the chat template cannot render on its own.
    """

    affixes: Mapping[str, tuple[str, str]]
    generation_prompt: str
    from_template: bool
    unsupported: Mapping[str, str] = field(default_factory=dict)
    """Why a role is missing from ``affixes``."""
    conversation_start: str = ""
    """Text the template writes once before the first message (a BOS string), kept out of
    the affixes; a schema using role tags starts with it unless the tokenizer adds BOS."""


PLAIN_FORMAT = RoleFormat(
    affixes={"system": ("System: ", "\n"), "user": ("User: ", "\n"),
             "assistant": ("Assistant: ", "\n")},
    generation_prompt="Assistant:",
    from_template=False,
)

_FORMATS: PerTokenizer[RoleFormat] = PerTokenizer()


def role_format(tokenizer: Any) -> RoleFormat:
    """The role expansions for ``tokenizer`` (cached per tokenizer and template)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or not template.strip():
        return PLAIN_FORMAT
    return _FORMATS.get(tokenizer, template, lambda: _from_template(tokenizer))


def _render(tokenizer: Any, messages: tuple[tuple[str, str], ...], generation: bool) -> str | None:
    try:
        text = tokenizer.apply_chat_template(
            [{"role": role, "content": content} for role, content in messages],
            tokenize=False, add_generation_prompt=generation)
    except Exception as exc:  # templates raise arbitrary errors for conversations they refuse
        log.debug("chat template refused %s: %s", messages, exc)
        return None
    return text if isinstance(text, str) else None


def _delta(tokenizer: Any, context: tuple[tuple[str, str], ...],
           extra: tuple[tuple[str, str], ...], generation: bool = False) -> str | None:
    """What rendering ``context + extra`` appends to rendering ``context``."""
    full = _render(tokenizer, context + extra, generation)
    if full is None:
        return None
    if context or generation:
        base = _render(tokenizer, context, False)
    else:
        base = _render(tokenizer, (), False) or ""
    if base is None or not full.startswith(base):
        return None
    return full[len(base):]


def _from_template(tokenizer: Any) -> RoleFormat:
    affixes: dict[str, tuple[str, str]] = {}
    unsupported: dict[str, str] = {}
    from_empty: list[str] = []
    for role in ROLES:
        for context in _CONTEXTS[role]:
            delta = _delta(tokenizer, context, ((role, _SENTINEL),))
            if delta is None or delta.count(_SENTINEL) != 1 or any(o in delta for o in _OTHER):
                continue
            prefix, suffix = delta.split(_SENTINEL)
            affixes[role] = (prefix, suffix)
            if not context:
                from_empty.append(role)
            break
        else:
            unsupported[role] = (f"the tokenizer's chat template cannot render a {role!r} "
                                 "message on its own")
    start = _conversation_start(tokenizer, affixes, from_empty)
    if start:
        for role in from_empty:
            prefix, suffix = affixes[role]
            if prefix.startswith(start):
                affixes[role] = (prefix[len(start):], suffix)
    generation = None
    for context in _GENERATION_CONTEXTS:
        delta = _delta(tokenizer, context, (), generation=True)
        if delta:
            generation = delta
            break
    if generation is None:
        generation = affixes.get("assistant", PLAIN_FORMAT.affixes["assistant"])[0]
    return RoleFormat(affixes=affixes, generation_prompt=generation, from_template=True,
                      unsupported=unsupported, conversation_start=start)


def _conversation_start(tokenizer: Any, affixes: Mapping[str, tuple[str, str]],
                        from_empty: list[str]) -> str:
    """The BOS string the template writes once before the first message, else ``""``.

    Affixes found without a preceding message (the system role's) would otherwise carry it.
    It counts as a conversation start only if the template does not also write it at the
    start of later turns (where it is a turn marker, as in ChatML tokenizers whose BOS is
    ``<|im_start|>``).
    """
    bos = getattr(tokenizer, "bos_token", None)
    if not isinstance(bos, str) or not bos or not from_empty:
        return ""
    if not any(affixes[role][0].startswith(bos) for role in from_empty):
        return ""
    later = [affixes[role][0] for role in affixes if role not in from_empty]
    if not later or any(prefix.startswith(bos) for prefix in later):
        return ""
    return bos
