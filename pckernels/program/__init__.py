"""Prompt programs: Python functions compiled to PML (the paper's §3.2.4 compiler).

Decorate a function that builds its prompt from text; the decorator compiles it into a PML
schema once, and each call gives the PML prompt for its arguments::

    from typing import Annotated
    from pckernels.program import MaxTokens, assistant, program, system, user

    @program
    def helper(question: Annotated[str, MaxTokens(64)], brief: bool = False) -> str:
        p = system("You are a helpful assistant.")
        if brief:
            p += system("Answer in one sentence.")
        p += user(question)
        p += assistant()
        return p

    cache.generate(helper("Why is the sky blue?", brief=True))

``if`` becomes a module, ``if``/``elif``/``else`` and ``match`` a union, calls to other
programs nested modules, ``MaxTokens`` parameters PML parameters, and ``for x in CONSTANT``
one module per element. See ``docs/program.md``.
"""

from pckernels.errors import ProgramError
from pckernels.program.call import ProgramCall
from pckernels.program.core import Program, program
from pckernels.program.format import chat_format
from pckernels.program.roles import MaxTokens, assistant, system, user

__all__ = ["MaxTokens", "Program", "ProgramCall", "ProgramError", "assistant", "chat_format", "program",
           "system", "user"]
