"""Every rejection is a located PMLError; hostile input (DTDs, entities, size, depth) is refused."""

from __future__ import annotations

import copy
import time

import pytest

from pckernels import PMLError as TopLevelPMLError
from pckernels.pml import Limits, PMLError, parse_prompt, parse_schema
from pml_tokenizers import byte_tokenizer

TOK = byte_tokenizer()


def schema_error(text: str, **kwargs) -> PMLError:
    with pytest.raises(PMLError) as info:
        parse_schema(text, TOK, **kwargs)
    return info.value


SCHEMA_ERRORS = [
    # (schema text, message pattern, line, column)
    ('<schema name="s">\n<module name="a">x</schema>', "malformed XML: Opening and ending tag", 2, 28),
    ("<schema name=\"s\">x</schema>trailing", "malformed XML: Extra content", 1, 28),
    ("", "malformed XML", 1, 1),
    ('<prompt schema="s"/>', 'must start with <schema name="…">, not <prompt>', 1, 1),
    ("<schema>x</schema>", 'needs a name="…" attribute', 1, 1),
    ('<schema name="s" version="2">x</schema>', "no attribute 'version'; expected: name", 1, 1),
    ('<schema name="s">\n  <module name="a/b">x</module></schema>',
     "invalid module name 'a/b': a name is 1 to 128 characters", 2, 3),
    ('<schema name="s"><module name="">x</module></schema>', "invalid module name ''", 1, 18),
    ('<schema name="s"><module name="a b">x</module></schema>', "invalid module name 'a b'", 1, 18),
    ('<schema name="s"><module name="a">x</module>\n<module name="a">y</module></schema>',
     "duplicate name 'a' at the top level of the schema", 2, 1),
    ('<schema name="s"><module name="m"><param name="a" len="1"/><module name="a">y</module>'
     "</module></schema>", "duplicate name 'a' in module 'm'", 1, 60),
    ('<schema name="s"><union name="a"><module name="x">x</module></union>'
     '<module name="a">y</module></schema>', "duplicate name 'a': a union of that name", 1, 69),
    ('<schema name="s"><module name="m"><scaffold name="a"><module name="x">x</module>'
     '</scaffold></module><module name="a">y</module></schema>',
     "duplicate name 'a': a scaffold of that name", 1, 101),
    ('<schema name="s"><union name="u"><module name="x">x</module></union>'
     '<union name="u"><module name="y">y</module></union></schema>', "duplicate name 'u'", 1, 69),
    ('<schema name="s"><module name="m">x<param name="p"/></module></schema>',
     'needs len="N"', 1, 36),
    ('<schema name="s"><module name="m">x<param name="p" len="0"/></module></schema>',
     "invalid len='0' on parameter 'p': expected a whole number of tokens, at least 1", 1, 36),
    ('<schema name="s"><module name="m">x<param name="p" len="-3"/></module></schema>',
     "invalid len='-3'", 1, 36),
    ('<schema name="s"><module name="m">x<param name="p" len="1.5"/></module></schema>',
     "invalid len='1.5'", 1, 36),
    ('<schema name="s"><module name="m">x<param name="p" len="²"/></module></schema>',
     "invalid len='²'", 1, 36),
    ('<schema name="s"><module name="m">x<param name="p" len="2" length="2"/></module></schema>',
     "takes len= or length=, not both", 1, 36),
    ('<schema name="s"><module name="m">x<param name="1p" len="2"/></module></schema>',
     "must start with a letter or '_'", 1, 36),
    ('<schema name="s">x<param name="p" len="2"/></schema>',
     r"<param> must be inside a <module>", 1, 19),
    ('<schema name="s"><union><param name="p" len="2"/></union></schema>',
     r"<param> cannot appear directly inside <union>", 1, 25),
    ('<schema name="s"><scaffold name="f"><parameter name="p" length="2"/></scaffold></schema>',
     r"<parameter> cannot appear directly inside <scaffold>", 1, 37),
    ('<schema name="s"><module name="m"><param name="p" len="2">x</param></module></schema>',
     "<param> must be empty", 1, 35),
    ('<schema name="s"><module name="m"><param name="p" len="2" default="abc"/></module></schema>',
     "the default of parameter 'p' is 3 tokens, longer than its len=2", 1, 35),
    ('<schema name="s"><modul name="m">x</modul></schema>',
     r"unknown element <modul> in a schema; expected one of <module>", 1, 18),
    ('<schema name="s" xmlns:x="urn:x"><x:module name="m">x</x:module></schema>',
     "unknown element", 1, 34),
    ('<schema name="s"><module name="m" lang="en">x</module></schema>',
     "<module> has no attribute 'lang'; expected: name, src", 1, 18),
    ('<schema name="s">  <!-- nothing -->  </schema>', "empty schema 's'", 1, 1),
    ('<schema name="s"><union name="u"></union></schema>', "empty <union>", 1, 18),
    ('<schema name="s"><union>\n  stray <module name="a">a</module></union></schema>',
     "text inside <union> must be inside one of its modules", 2, 3),
    ('<schema name="s"><scaffold name="f"><union><module name="a">a</module></union>'
     "</scaffold></schema>", r"<union> cannot appear directly inside <scaffold>", 1, 37),
    ('<schema name="s"><scaffold name="f"><module name="a"><scaffold name="g">'
     '<module name="b">b</module></scaffold></module></scaffold></schema>',
     "scaffolds do not nest", 1, 54),
    ('<schema name="s"><user><system>x</system></user></schema>',
     "<system> cannot be inside another role tag", 1, 24),
    ('<schema name="s"><user role="x">x</user></schema>', "<user> has no attribute 'role'", 1, 18),
    ('<schema name="s" xml:space="keep">x</schema>', 'xml:space must be "preserve"', 1, 1),
    ('<schema name="s">&nbsp;</schema>', "malformed XML: Entity 'nbsp' not defined", 1, 24),
]


@pytest.mark.parametrize("text,pattern,line,column", SCHEMA_ERRORS)
def test_schema_errors_are_located(text, pattern, line, column):
    error = schema_error(text)
    assert isinstance(error, ValueError) and isinstance(error, TopLevelPMLError)
    assert pattern in error.message
    assert (error.line, error.column) == (line, column), error.message


def test_error_message_names_the_source_label():
    with pytest.raises(PMLError, match=r"^travel.pml: line 1, column 18: <module> has no attribute"):
        parse_schema('<schema name="s"><module name="m" x="1"/></schema>', TOK, label="travel.pml")


def test_doctype_is_refused_before_parsing():
    billion_laughs = """<?xml version="1.0"?>
<!DOCTYPE lolz [
 <!ENTITY lol "lol">
 <!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">
 <!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">
]>
<schema name="s">&lol3;</schema>"""
    error = schema_error(billion_laughs)
    assert "<!DOCTYPE> declarations are not allowed" in error.message
    assert (error.line, error.column) == (2, 1)


def test_external_entity_is_refused(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("secret")
    xxe = f'<!DOCTYPE s [<!ENTITY x SYSTEM "file://{secret}">]><schema name="s">&x;</schema>'
    assert "not allowed" in schema_error(xxe).message
    with pytest.raises(PMLError, match="DOCTYPE"):
        parse_prompt(xxe.replace("schema", "prompt"), {})


def test_input_too_large():
    text = '<schema name="s">' + "x" * 2000 + "</schema>"
    error = schema_error(text, limits=Limits(max_input_bytes=1000))
    assert "is 2026 bytes; the limit is 1000 (Limits.max_input_bytes)" in error.message
    assert (error.line, error.column) == (1, 1001)
    with pytest.raises(PMLError, match="max_input_bytes"):
        parse_prompt(text.encode(), {}, limits=Limits(max_input_bytes=1000))


def test_nesting_too_deep():
    depth = 6
    text = ('<schema name="s">' + "".join(f'<module name="m{i}">' for i in range(depth))
            + "x" + "</module>" * depth + "</schema>")
    parse_schema(text, TOK, limits=Limits(max_depth=7))
    error = schema_error(text, limits=Limits(max_depth=6))
    assert "nesting too deep" in error.message and "Limits.max_depth" in error.message
    assert (error.line, error.column) == (1, 17 + 5 * 18 + 1)


def test_very_deep_input_is_refused_quickly():
    text = '<schema name="s">' + '<module name="m">' * 5000 + "</module>" * 5000 + "</schema>"
    start = time.perf_counter()
    error = schema_error(text)
    assert time.perf_counter() - start < 2
    assert "malformed XML" in error.message or "nesting too deep" in error.message


def test_too_many_modules_and_elements():
    text = '<schema name="s">' + "".join(f'<module name="m{i}">x</module>' for i in range(5)) + \
        "</schema>"
    assert "Limits.max_modules" in schema_error(text, limits=Limits(max_modules=4)).message
    assert "Limits.max_elements" in schema_error(text, limits=Limits(max_elements=4)).message


def test_len_beyond_position_limit():
    text = '<schema name="s"><module name="m"><param name="p" len="99999999999"/></module></schema>'
    assert "Limits.max_positions" in schema_error(text).message
    text = ('<schema name="s"><module name="m"><param name="p" len="600"/>'
            '<param name="q" len="600"/></module></schema>')
    error = schema_error(text, limits=Limits(max_positions=1000))
    assert "parameters up to 'q' reserve 1200 positions in all, more than 1000" in error.message
    text = ('<schema name="s"><module name="m">' + "x" * 500 + '<param name="q" len="600"/>'
            "</module></schema>")
    error = schema_error(text, limits=Limits(max_positions=1000))
    assert ("parameter 'q' of module 'm' ends at position 1100, past the limit of 1000 "
            "positions (Limits.max_positions)") in error.message
    assert (error.line, error.column) == (1, 535)


def test_invalid_encodings():
    error = schema_error(b'<schema name="s">\xff</schema>')
    assert "not valid UTF-8" in error.message
    error = schema_error('<schema name="s">\n\ud800</schema>')
    assert "cannot be encoded" in error.message and (error.line, error.column) == (2, 1)
    assert "must be str or bytes" in schema_error(123).message


def test_max_positions_must_be_positive():
    with pytest.raises(PMLError, match="max_positions must be positive"):
        parse_schema('<schema name="s">x</schema>', TOK, max_positions=0)


SCHEMA = parse_schema('<schema name="s"><module name="a">A<param name="p" len="2"/></module>'
                      '<module name="b">B</module></schema>', TOK)

PROMPT_ERRORS = [
    ('<schema name="s"/>', 'a prompt must start with <prompt schema="…">', 1, 1),
    ("<prompt><a/></prompt>", 'needs a schema="…" attribute', 1, 1),
    ('<prompt schema="s" lang="en"><a/></prompt>', "no attribute 'lang'", 1, 1),
    ('<prompt schema="s"><a><user>x</user></a></prompt>', "<user> cannot be inside a module import",
     1, 23),
    ('<prompt schema="s"><user><user>x</user></user></prompt>', "cannot be inside another role tag",
     1, 26),
    ('<prompt schema="s"><module p="x"/></prompt>', '<module> in a prompt needs name="…"', 1, 20),
    ('<prompt schema="s"><module name="a//b"/></prompt>', "unknown module 'a//b'", 1, 20),
    ('<prompt schema="s"><scaffold name="x"/></prompt>', "unknown scaffold 'x'", 1, 20),
    ('<prompt schema="s" xmlns:n="urn:n"><n:a/></prompt>', "namespaced element", 1, 36),
    ('<prompt schema="s"><a>\n<b/></a></prompt>', "unknown module 'b' in module 'a'", 2, 1),
    ('<prompt schema="s"><a/><b/><a/></prompt>', "imported twice", 1, 28),
    ('<prompt schema="s"><a p="abc"/></prompt>', "is 3 tokens, longer than its len=2", 1, 20),
    ('<prompt schema="s"><a q="1"/></prompt>', "module 'a' has no parameter 'q'", 1, 20),
    ('<prompt schema="s"><a/>x<b/></prompt>', "text after module 'a' needs 1 positions", 1, 24),
    ('<prompt schema="s"><a/>', "malformed XML", 1, None),
]


@pytest.mark.parametrize("text,pattern,line,column", PROMPT_ERRORS)
def test_prompt_errors_are_located(text, pattern, line, column):
    with pytest.raises(PMLError) as info:
        parse_prompt(text, {"s": SCHEMA})
    assert pattern in info.value.message
    assert info.value.line == line
    if column is not None:
        assert info.value.column == column, info.value.message


def test_failed_parse_changes_no_state():
    text = '<prompt schema="s"><a p="x"/><b/>tail</prompt>'
    schemas = {"s": SCHEMA}
    before = parse_prompt(text, schemas)
    snapshot = copy.deepcopy((SCHEMA.modules, SCHEMA.layout, SCHEMA.unions, SCHEMA.scaffolds,
                              SCHEMA.length, SCHEMA.digest))
    for bad in ('<prompt schema="s"><a p="xyz"/></prompt>', '<prompt schema="s"><b/><b/></prompt>',
                '<prompt schema="s"><zz/></prompt>', "<prompt"):
        with pytest.raises(PMLError):
            parse_prompt(bad, schemas)
    assert schemas == {"s": SCHEMA}
    assert (SCHEMA.modules, SCHEMA.layout, SCHEMA.unions, SCHEMA.scaffolds, SCHEMA.length,
            SCHEMA.digest) == snapshot
    after = parse_prompt(text, schemas)
    assert after.segments == before.segments and after.arguments == before.arguments
