"""Prompt programs (``pckernels.program``) for tests/test_program.py and the CLI tests: one per
construct. Separators start the piece after them (``"\\nText"``), so module boundaries fall where
the tokenizer splits anyway and token ids equal those of the whole rendered string."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

from pckernels.program import MaxTokens, assistant, program, system, user

Question = Annotated[str, MaxTokens(24)]


class Tone(Enum):
    CALM = "calm"
    BRISK = "brisk"


DOCS = ("Paris is the capital of France.", "Tokyo is the capital of Japan.", "Lima is the capital of Peru.")
NUMBERED = tuple(enumerate(DOCS, 1))


@program
def literal() -> str:
    return system("You are terse.") + user("Say hi.") + assistant()


@program
def flag(brief: bool, question: Question) -> str:
    """``if`` -> a module."""
    p = system("You are a helpful assistant.")
    if brief:
        p += system("Answer in one sentence.")
    p += user(question)
    p += assistant()
    return p


@program
def branches(level: str, question: Question) -> str:
    """``if``/``elif``/``else`` on a str -> a union."""
    p = system("You teach.")
    if level == "beginner":
        p += user("I am new to this.")
    elif level == "expert":
        p += user("I know the field well.")
    else:
        p += user("I know a little.")
    p += user(question)
    p += assistant()
    return p


@program
def tone(tone: Tone, question: Question) -> str:
    """``match`` on an enum -> a union (no default: nothing for other values)."""
    p = system("You reply.")
    match tone:
        case Tone.CALM:
            p += system("Stay calm and gentle.")
        case Tone.BRISK:
            p += system("Be brisk.")
    p += user(question)
    p += assistant()
    return p


@program
def count(n: int, question: Question) -> str:
    """``match`` on an int with an or-pattern and a default (the original compiler drops these)."""
    p = system("Count things.")
    match n:
        case 1:
            p += system("There is one item.")
        case 2 | 3:
            p += system("There are a few items.")
        case _:
            p += system("There are many items.")
    p += user(question)
    p += assistant()
    return p


@program
def nested(kind: str, detail: bool, n: int, question: Question) -> str:
    """A union inside a module inside a union, and a module inside a member."""
    p = system("You describe places.")
    if kind == "city":
        p += "\nCities are dense."
        if detail:
            p += "\nThey have many districts."
            match n:
                case 1:
                    p += "\nOne district is shown."
                case _:
                    p += "\nSeveral districts are shown."
    elif kind == "village":
        p += "\nVillages are small."
    p += user(question)
    p += assistant()
    return p


@program
def trip(duration: Annotated[str, MaxTokens(8)], who: Annotated[str, MaxTokens(4)], food: bool = False) -> str:
    """Parameters: at the root (a module of their own) and in a conditional module."""
    p = f"Plan a trip of {duration} days"
    if food:
        p += f"\nInclude food for {who} people."
    return p


@program
def planner(days: Annotated[str, MaxTokens(8)], foodie: bool, question: Question) -> str:
    """Calls to another program -> nested modules (arguments: parameters and constants)."""
    p = system("You plan trips.")
    p += user(trip(days, "two", food=foodie))
    p += trip("1", "one")
    p += user(question)
    p += assistant()
    return p


@program
def rag(chosen: frozenset, question: Question) -> str:
    """A loop over a module-level tuple -> one module per document, imported when chosen."""
    p = system("Answer from the documents.")
    for doc in DOCS:
        if doc in chosen:
            p += f"\nDocument: {doc}"
    p += user(question)
    p += assistant()
    return p


@program
def every_doc(question: Question) -> str:
    """A loop without a test: every element's module is always imported."""
    p = "Documents:"
    for index, doc in NUMBERED:
        p += f"\n{index}. {doc}"
    p += f"\nQuestion: {question}"
    p += "\nAnswer:"
    return p


@program
def odd(name: Annotated[str, MaxTokens(12)], on: bool) -> str:
    """Empty strings, unicode, XML characters and a parameter used twice."""
    p = ""
    p += ""
    p += "Grüße aus 東京 ✓ <tag> & \"quotes\""
    if on:
        pass
    if not on:
        p += f"\nName: {name}, again {name!r}"
    p += user(f"Hi {name}")
    p += assistant()
    return p


@program
def fstring(name: Annotated[str, MaxTokens(8)], question: Question) -> str:
    """One f-string, LangChain style."""
    return f"You help {name}.\nQuestion: {question}\nAnswer:"
