"""What ``@program`` cannot compile is refused at decoration time with the file, line and column
of the construct and why — never compiled into a different prompt. Each refused function marks
its offending line with ``# <-``."""

from __future__ import annotations

import inspect
from typing import Annotated

import program_examples as ex
import pytest

from pckernels.errors import ProgramError
from pckernels.program import MaxTokens, assistant, program, system, user

Q = Annotated[str, MaxTokens(8)]
LIMIT = 3
NOT_A_LIST = "abc"


def helper(x: str) -> str:
    return x.upper()


def while_loop(n: int) -> str:
    p = "x"
    while n:  # <-
        p += "y"
    return p


def try_block(a: bool) -> str:
    p = "x"
    try:  # <-
        p += "y"
    except ValueError:
        pass
    return p


def with_block(a: bool) -> str:
    p = "x"
    with open("f"):  # <-
        p += "y"
    return p


def bare_string(flag: bool) -> str:
    p = ""
    "some system message"  # <-
    return p


def loop_over_argument(docs: list) -> str:
    p = "Docs:"
    for doc in docs:  # <-
        p += doc
    return p


def loop_over_a_string() -> str:
    p = "Docs:"
    for doc in NOT_A_LIST:  # <-
        p += doc
    return p


def undeclared_length(name: str) -> str:
    p = "Hello "
    p += f"{name}!"  # <-
    return p


def arbitrary_call(name: Q) -> str:
    p = "Hello "
    p += helper(name)  # <-
    return p


def method_call(name: Q) -> str:
    p = "Hello "
    p += ", ".join(["a", "b"])  # noqa: FLY002  # <-
    return p


def other_assignment(flag: bool) -> str:
    p = "x"
    q = "y"  # <-
    p += q
    return p


def nested_roles(q: Q) -> str:
    p = system("s")
    p += user(system(q))  # <-
    return p


def early_return(flag: bool) -> str:
    p = "x"
    if flag:
        return p  # <-
    return p


def guard(n: int) -> str:
    p = "x"
    match n:
        case 1 if LIMIT > 2:  # <-
            p += "one"
    return p


def capture(n: int) -> str:
    p = "x"
    match n:
        case [a, b]:  # noqa: F841  # <-
            p += "two"
    return p


def empty_assistant() -> str:
    p = user("Hi")
    p += assistant("")  # <-
    return p


def ternary(flag: bool) -> str:
    p = "x"
    p += "a" if flag else "b"  # <-
    return p


def call_in_condition(name: str) -> str:
    p = "x"
    if len(name) > LIMIT:  # <-
        p += "long"
    return p


def attribute_of_parameter(name: str) -> str:
    p = "x"
    if name.value == "A":  # <-
        p += "a"
    return p


def reads_the_prompt(flag: bool) -> str:
    p = "x"
    if p:  # <-
        p += "y"
    return p


def loop_variable_outside(flag: bool) -> str:
    p = "x"
    for doc in ex.DOCS:
        p += doc
    p += doc  # <-
    return p


def int_text() -> str:
    p = "x"
    p += 3  # <-
    return p


def subtract(flag: bool) -> str:
    p = "x"
    p -= "y"  # <-
    return p


def role_program_in_role(q: Q) -> str:
    p = system("s")
    p += user(ex.flag(True, q))  # <-
    return p


def bad_call_arguments(q: Q) -> str:
    p = system("s")
    p += ex.trip(q)  # <-
    return p


def no_return(flag: bool) -> str:
    p = "x"
    p += "y"  # <-


def star_args(*names: str) -> str:  # <-
    return "x"


def max_tokens_on_int(n: Annotated[int, MaxTokens(3)]) -> str:  # <-
    return "x"


async def asynchronous() -> str:  # <-
    return "x"


REFUSED = {
    while_loop: "while loops are not compiled",
    try_block: "try is not compiled",
    with_block: "with is not compiled",
    bare_string: "a bare string does nothing in Python",
    loop_over_argument: "a loop runs over a constant list or tuple",
    loop_over_a_string: "a loop runs over a constant list or tuple",
    undeclared_length: "parameter 'name' is interpolated but has no maximum length",
    arbitrary_call: "only role helpers (system, user, assistant) and other prompt programs are called",
    method_call: "only role helpers",
    other_assignment: "only the prompt accumulator is assigned",
    nested_roles: "role helpers do not nest",
    early_return: "return only at the end of the program",
    guard: "case guards",
    capture: "only literal, enum-member and `_` case patterns",
    empty_assistant: "empty PML <assistant/> is the generation prompt",
    ternary: "not compiled: a prompt is built from",
    call_in_condition: "a condition compares parameters with constants",
    attribute_of_parameter: "test a parameter itself",
    reads_the_prompt: "the prompt built so far cannot be read",
    loop_variable_outside: "the loop variable 'doc' is used outside its loop",
    int_text: "a prompt is built from str, not int",
    subtract: "the prompt only grows with `+=`",
    role_program_in_role: "uses role helpers, and role helpers do not nest",
    bad_call_arguments: "bad arguments for trip()",
    no_return: "a prompt program ends with `return <prompt>`",
    star_args: "*args and **kwargs are not compiled",
    max_tokens_on_int: "MaxTokens applies to str parameters",
    asynchronous: "async functions are not compiled",
}


def _marked_line(function) -> tuple[int, int]:
    lines, first = inspect.getsourcelines(function)
    for offset, line in enumerate(lines):
        if line.rstrip().endswith("# <-"):
            return first + offset, len(line) - len(line.lstrip()) + 1
    raise AssertionError(f"{function.__name__} has no `# <-` mark")


@pytest.mark.parametrize("function", list(REFUSED), ids=lambda f: f.__name__)
def test_refused_with_file_line_and_reason(function):
    with pytest.raises(ProgramError) as info:
        program(function)
    error = info.value
    line, column = _marked_line(function)
    assert REFUSED[function] in error.message, error.message
    assert error.filename == __file__
    assert error.line == line, str(error)
    if function not in (no_return, star_args, max_tokens_on_int, asynchronous):
        assert error.column is not None and error.column >= column, str(error)
    assert str(error).startswith(f"{__file__}:{line}:")
    assert isinstance(error, ValueError)


def test_refusal_points_at_the_column_of_the_construct():
    with pytest.raises(ProgramError) as info:
        program(undeclared_length)
    line, column = _marked_line(undeclared_length)
    assert (info.value.line, info.value.column) == (line, column + len('p += f"{'))
    assert "`name`" in info.value.message


def test_lambda_and_builtin_are_refused():
    with pytest.raises(ProgramError, match="only functions defined with `def`"):
        program(lambda: "x")
    with pytest.raises(ProgramError, match="cannot read the source"):
        program(len)


def test_bad_arguments_at_call_time():
    with pytest.raises(TypeError, match="flag"):
        ex.flag(True)
    with pytest.raises(ProgramError, match="cannot be written in PML"):
        ex.flag(True, "bell \x07")
    with pytest.raises(TypeError, match="must be a str"):
        ex.flag(True, 42)
