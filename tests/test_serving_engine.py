"""``PromptCache`` provides every member of the server's ``ServingEngine`` Protocol with a signature
the server's calls fit (no model needed: the class and its source are inspected)."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from pckernels.engine import PromptCache
from pckernels.server.engine import ServingEngine

MEMBERS = sorted(name for name in vars(ServingEngine) if not name.startswith("_"))
METHODS = [name for name in MEMBERS if inspect.isfunction(vars(ServingEngine)[name])]
ATTRIBUTES = [name for name in MEMBERS if isinstance(vars(ServingEngine)[name], property)]


def assigned_attributes(cls: type) -> set[str]:
    """Names ``cls``'s methods assign to ``self.<name>`` (instance attributes)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) and leaf.value.id == "self":
                        names.add(leaf.attr)
    return names


def test_the_protocol_lists_what_the_server_uses():
    assert set(METHODS) | set(ATTRIBUTES) == set(MEMBERS)
    assert {"submit", "request", "complete_request", "stats", "close", "parse_schema", "install_schema",
            "warm_schema", "remove_schema"} <= set(METHODS)
    assert {"name", "model_id", "max_positions", "tokenizer"} <= set(ATTRIBUTES)
    for name in MEMBERS:
        member = vars(ServingEngine)[name]
        doc = (member.fget if isinstance(member, property) else member).__doc__
        assert doc and doc.strip(), f"ServingEngine.{name} has no docstring"


@pytest.mark.parametrize("name", ATTRIBUTES)
def test_prompt_cache_has_the_attribute(name):
    assert hasattr(PromptCache, name) or name in assigned_attributes(PromptCache), \
        f"PromptCache no longer provides {name!r}, which the server reads (ServingEngine.{name})"


@pytest.mark.parametrize("name", METHODS)
def test_prompt_cache_method_fits_the_protocol(name):
    impl = getattr(PromptCache, name, None)
    assert callable(impl), f"PromptCache no longer has {name}(), which the server calls (ServingEngine.{name})"
    want = inspect.signature(getattr(ServingEngine, name))
    have = inspect.signature(impl)
    params = have.parameters
    positional = [p.name for p in want.parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [p.name for p in params.values() if p.kind is p.POSITIONAL_OR_KEYWORD][:len(positional)] == positional, \
        f"PromptCache.{name} takes its positional parameters in another order than ServingEngine.{name}"
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    for p in want.parameters.values():
        got = params.get(p.name)
        if got is None:
            assert var_kw and p.kind is p.KEYWORD_ONLY, f"PromptCache.{name} lacks parameter {p.name!r}"
            continue
        assert got.kind is p.kind or (got.kind is got.POSITIONAL_OR_KEYWORD and p.kind is not p.VAR_KEYWORD), \
            f"PromptCache.{name}: {p.name!r} is {got.kind.description}, the server passes it {p.kind.description}"
        if p.default is not p.empty:
            assert got.default == p.default, \
                f"PromptCache.{name}: {p.name!r} defaults to {got.default!r}, ServingEngine says {p.default!r}"
    for p in params.values():
        if p.name not in want.parameters and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            assert p.default is not p.empty, f"PromptCache.{name} needs {p.name!r}, which the server never passes"
    assert have.return_annotation == want.return_annotation, \
        f"PromptCache.{name} returns {have.return_annotation}, ServingEngine says {want.return_annotation}"
