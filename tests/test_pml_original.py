"""The original implementation's PML (yale-sys/prompt-cache): its files parse, and its spellings
keep their meaning — ``<union scaffold=…>`` (accepted, ignored with a warning), empty modules,
``cache="false"`` (computed in every prompt, never stored). See tests/data/original_pml/."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from pckernels import PMLError
from pckernels.engine import PromptCache
from pckernels.pml import ROOT, Segment, check_answerable, parse_prompt, parse_schema
from pml_tokenizers import byte_tokenizer, ids
from test_engine import FP32_TOL, tiny_llama, tokenizer  # noqa: F401  (tokenizer is a fixture)

DATA = Path(__file__).parent / "data" / "original_pml"
FILES = sorted(DATA.glob("*.xml"))
SCHEMA_FILES = [f for f in FILES if f.read_text(encoding="utf-8").lstrip().startswith(("<schema", "<!--"))]
TOK = byte_tokenizer()


def test_the_copies_are_there():
    assert len(SCHEMA_FILES) >= 5 and (DATA / "prompt_mbti.xml") in FILES
    assert "MIT License" in (DATA / "README.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("path", SCHEMA_FILES, ids=lambda p: p.name)
def test_every_original_schema_parses(path, tokenizer, caplog):
    with caplog.at_level(logging.WARNING, logger="pckernels.pml"):
        schema = parse_schema(path.read_bytes(), tokenizer, label=path.name)
    assert schema.length > 0 and len(schema.modules) > 1
    if 'scaffold="' in path.read_text(encoding="utf-8").split("<union", 1)[-1].split(">", 1)[0]:
        assert "is accepted and ignored" in caplog.text


MALFORMED = {"schema_qanda.xml", "code_generation_game.xml"}
"""Original files that are not well-formed XML (a bare ``&`` or ``<`` in text)."""


@pytest.mark.skipif(not os.environ.get("PROMPTCACHE_ORIGINAL_PML"),
                    reason="set PROMPTCACHE_ORIGINAL_PML to a checkout of yale-sys/prompt-cache")
def test_every_schema_of_an_original_checkout(tokenizer):
    """Every ``*.xml`` under ``$PROMPTCACHE_ORIGINAL_PML`` whose root is ``<schema>`` parses,
    except the malformed ones, which are located errors."""
    root = Path(os.environ["PROMPTCACHE_ORIGINAL_PML"])
    parsed = 0
    for path in sorted(root.rglob("*.xml")):
        data = path.read_bytes()
        if b"<schema" not in data[:4096]:
            continue
        if any(path.name.endswith(name) for name in MALFORMED):
            with pytest.raises(PMLError, match="written &amp; or &lt;") as info:
                parse_schema(data, tokenizer)
            assert info.value.line is not None and info.value.column is not None
            continue
        assert parse_schema(data, tokenizer, label=str(path)).length > 0
        parsed += 1
    assert parsed >= 5


PROMPTS = {
    # The README's prompt (minus <task2/>, which its schema does not declare).
    "readme": '<prompt schema="default"><preface param-name="test"><nested/><system3 message="just doing some test"/>'
              '<user2/></preface><task><task-robot-control speed="fast"/></task>'
              "<user>What will be the next movement of the robot?</user><assistant>It will move forward.</assistant>"
              "<user>What would be the speed then?</user><assistant/></prompt>",
    "uncached-members": '<prompt schema="default"><task><task-random/></task><preface><user1/><system2/></preface>'
                        "<user>Which system prompt?</user><assistant/></prompt>",
    "mbti-shuffled": (DATA / "prompt_mbti.xml").read_text(encoding="utf-8").replace(
        "<E/><N/><T/><P/>", "<P/><E/><T/><N/><user>Describe Alex.</user><assistant/>"),
    "persona-readme": "<prompt schema='persona'><age><young-adult/></age><residence><seaside/></residence>"
                      "<education><doctorate/></education><occupation><technology/></occupation>"
                      "<martial-status><married/></martial-status><personality><introverted/></personality>"
                      "<user>Introduce about yourself.</user><assistant/></prompt>",
    "persona-no-choice": "<prompt schema='persona'><personality><default/></personality><age><default/></age>"
                         "<user>Who are you?</user><assistant/></prompt>",
}


@pytest.fixture(scope="module")
def engine(tokenizer):
    cache = PromptCache(tiny_llama(len(tokenizer)), tokenizer, placement="schema")
    for path in SCHEMA_FILES:
        if path.name != "schema_summary_sample.xml":
            cache.add_schema(path)
    return cache


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_original_prompts_cached_match_reference(engine, name):
    ref = engine.generate(PROMPTS[name], mode="reference", max_new_tokens=4)
    got = engine.generate(PROMPTS[name], mode="cached", max_new_tokens=4)
    assert got.prompt_token_ids == ref.prompt_token_ids and got.positions == ref.positions
    assert (got.first_logits - ref.first_logits).abs().max().item() <= FP32_TOL
    assert got.token_ids == ref.token_ids


def test_uncached_modules_are_never_stored_and_are_computed_per_prompt(engine):
    schema = engine.schemas["default"]
    stored = {key.module for key in engine.store.keys() if key.schema == "default"}
    assert {"preface/system2", "preface/user1"} & stored == set()
    assert {"preface/system1", "preface/user2", ROOT} <= stored
    modules = schema.modules
    got = engine.generate(PROMPTS["uncached-members"], max_new_tokens=1)
    resolved = engine.resolve(PROMPTS["uncached-members"])
    text = sum(len(s.token_ids) for s in resolved.segments if s.kind == "text" and s.module is None)
    assert got.computed_tokens == text + len(modules["preface/system2"].token_ids) + len(
        modules["preface/user1"].token_ids)
    cached = (ROOT, "preface", "task", "task/task-random")
    slots = sum(p.length for m in cached for p in modules[m].params)
    assert got.cached_tokens == sum(len(modules[m].token_ids) for m in cached) - slots > 0
    assert got.cached_tokens + got.computed_tokens == len(got.prompt_token_ids)
    assert len({key.module for key in engine.store.keys() if key.schema == "default"}) == len(stored)


# --- the spellings, one by one, on the byte tokenizer -------------------------------------


def test_union_scaffold_is_accepted_and_ignored_with_one_warning(caplog):
    body = ('<union{}><module name="a">aaa</module><module name="b">b</module></union>'
            '<union{}><module name="c">c</module></union>tail')
    with caplog.at_level(logging.WARNING, logger="pckernels.pml"):
        plain = parse_schema(f'<schema name="s">{body.format("", "")}</schema>', TOK)
        assert caplog.text == ""
        scaffolded = body.format(' scaffold="b"', ' scaffold="x"')
        with_scaffold = parse_schema(f'<schema name="s">\n{scaffolded}</schema>', TOK, label="u.xml")
    assert caplog.text.count("WARNING") == 1
    assert "u.xml: schema 's': scaffold= on 2 <union> element(s) (the first at line 2, column 1)" in caplog.text
    assert with_scaffold.layout == plain.layout and with_scaffold.modules == plain.modules


def test_empty_modules_take_no_positions_and_import_nothing():
    s = parse_schema('<schema name="e">S<union name="u"><module name="none"></module><module name="x">xx</module>'
                     '</union><module name="blank"> <!-- c --> </module><module name="y">y</module></schema>', TOK)
    assert (s.modules["none"].token_ids, s.modules["none"].start, s.modules["none"].length) == ((), 1, 0)
    assert (s.modules["blank"].start, s.modules["blank"].length, s.modules["y"].start) == (3, 0, 3)
    p = parse_prompt('<prompt schema="e"><none/><blank/><y/>?</prompt>', s)
    assert p.modules == (ROOT, "none", "blank", "y")
    assert [seg.kind for seg in p.segments] == ["cached", "cached", "text"]
    with pytest.raises(PMLError, match="'none' and 'x' belong to the same union 'u'"):
        parse_prompt('<prompt schema="e"><none/><x/></prompt>', s)


def test_empty_src_file_is_an_empty_module(tmp_path):
    (tmp_path / "empty.txt").write_text("  \n")
    s = parse_schema('<schema name="e">S<module name="m" src="empty.txt"/></schema>', TOK, base_dir=tmp_path)
    assert s.modules["m"].token_ids == ()


CACHE = parse_schema('<schema name="c"><module name="sys">S</module>'
                     '<module name="live" cache="false">L<param name="p" len="4"/>M'
                     '<module name="inner">I</module></module>'
                     '<module name="after" cache="true">A</module></schema>', TOK)


def test_cache_false_makes_the_module_and_its_children_uncached_text():
    assert [m.cached for m in CACHE.modules.values()] == [True, True, False, False, True]
    p = parse_prompt('<prompt schema="c"><after/><live p="ab"><inner/></live><sys/>?</prompt>', CACHE)
    assert p.segments == (
        Segment("cached", ids(TOK, "S"), (0,), "sys"),
        Segment("text", ids(TOK, "L"), (1,), "live"),
        Segment("argument", ids(TOK, "ab"), (2, 3), "live", "p"),
        Segment("text", ids(TOK, "M"), (6,), "live"),
        Segment("text", ids(TOK, "I"), (7,), "live/inner"),
        Segment("cached", ids(TOK, "A"), (8,), "after"),
        Segment("text", ids(TOK, "?"), (9,)),
    )
    check_answerable(parse_prompt('<prompt schema="c"><sys/><live/></prompt>', CACHE))


@pytest.mark.parametrize("body, message, column", [
    ('<module name="m" cache="no">x</module>', "cache='no': expected cache=\"true\"", 18),
    ('<module name="m" cache="false"><module name="n" cache="true">x</module></module>',
     "cache=\"true\" inside module 'm', which is not cached", 49),
    ('<scaffold name="f"><module name="m" cache="false">x</module></scaffold>',
     "scaffold 'f': a scaffold member cannot have cache=\"false\"", 37),
    ('<module name="m" cache="false"><scaffold name="f"><module name="n">x</module></scaffold></module>',
     "a <scaffold> cannot be inside module 'm', which has cache=\"false\"", 49),
])
def test_cache_attribute_errors_are_located(body, message, column):
    with pytest.raises(PMLError) as info:
        parse_schema(f'<schema name="s">{body}</schema>', TOK)
    assert message in info.value.message
    assert (info.value.line, info.value.column) == (1, column)


def test_the_originals_malformed_xml_is_refused_with_a_hint():
    with pytest.raises(PMLError, match=r"malformed XML: .*written &amp; or &lt;") as info:
        parse_schema('<schema name="q">\n<module name="b">an R&B group</module></schema>', TOK)
    assert info.value.line == 2
    with pytest.raises(PMLError, match="written &amp; or &lt;"):
        parse_schema('<schema name="g"><module name="c">if 0 <= x < n: pass</module></schema>', TOK)


def test_overlong_parameter_scaffold_is_ignored_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="pckernels.pml"):
        s = parse_schema('<schema name="p"><module name="m">x<parameter name="q" length="2" scaffold="abc"/>'
                         "</module></schema>", TOK)
    assert s.modules["m"].params[0].default == ()
    assert "scaffold='abc' on parameter 'q' is 3 tokens, longer than its length=2; ignored" in caplog.text
    with pytest.raises(PMLError, match="the default of parameter 'q' is 3 tokens"):
        parse_schema('<schema name="p"><module name="m">x<param name="q" len="2" default="abc"/></module></schema>',
                     TOK)


def test_uncached_module_computed_like_text_matches_reference(tokenizer):
    cache = PromptCache(tiny_llama(len(tokenizer), seed=2), tokenizer, placement="schema")
    cache.add_schema('<schema name="c"><system>Be brief.</system><module name="doc">The sky is blue.</module>'
                     '<module name="today" cache="false">Today is <param name="day" len="4"/>, sunny.</module>'
                     '<module name="tail">Answer questions.</module></schema>')
    for prompt in ('<prompt schema="c"><tail/><today day="Monday"/><doc/><user>Colour?</user><assistant/></prompt>',
                   '<prompt schema="c"><today/><user>Weather?</user><assistant/></prompt>',
                   '<prompt schema="c"><doc/><today day="Friday"/></prompt>'):
        ref = cache.generate(prompt, mode="reference", max_new_tokens=4)
        got = cache.generate(prompt, mode="cached", max_new_tokens=4)
        assert (got.first_logits - ref.first_logits).abs().max().item() <= FP32_TOL
        assert got.token_ids == ref.token_ids
    assert "today" not in {key.module for key in cache.store.keys()}
    assert torch.isfinite(got.first_logits).all()
