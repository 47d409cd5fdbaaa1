"""Schema parsing and layout: exact positions for every construct, whitespace, roles, src=."""

from __future__ import annotations

import os

import pytest

from pckernels.pml import ROOT, LayoutEntry, Limits, PMLError, parse_schema
from pml_tokenizers import (
    BOS_TEMPLATE,
    DEFAULT_SYSTEM_TEMPLATE,
    SIMPLE_TEMPLATE,
    bpe_tokenizer,
    byte_tokenizer,
    decode,
    ids,
)

TOK = byte_tokenizer()
PH = TOK.unk_token_id


def schema(body: str, tokenizer=TOK, **kwargs):
    return parse_schema(f'<schema name="s">{body}</schema>', tokenizer, **kwargs)


def own_text(s, name, tokenizer=TOK):
    return decode(tokenizer, s.modules[name].token_ids)


def full_text(s, tokenizer=TOK):
    """All modules' own tokens in position order (for schemas without unions)."""
    pairs = sorted((p, t) for m in s.modules.values() for t, p in zip(m.token_ids, m.position_ids))
    return decode(tokenizer, [t for _, t in pairs])


def test_anonymous_text_and_sibling_modules():
    s = schema('Hi <module name="a">abc</module> mid <module name="b">de</module> end')
    assert list(s.modules) == [ROOT, "a", "b"]
    assert s.layout == (
        LayoutEntry(ROOT, "anonymous", 0, 2, None),
        LayoutEntry("a", "module", 2, 3, None),
        LayoutEntry(ROOT, "anonymous", 5, 3, None),
        LayoutEntry("b", "module", 8, 2, None),
        LayoutEntry(ROOT, "anonymous", 10, 3, None),
    )
    root = s.modules[ROOT]
    assert own_text(s, ROOT) == "Himidend"
    assert root.position_ids == (0, 1, 5, 6, 7, 10, 11, 12)
    assert root.children == ("a", "b") and root.parent is None
    assert (root.start, root.length) == (0, 13)
    a = s.modules["a"]
    assert a.token_ids == ids(TOK, "abc") and a.position_ids == (2, 3, 4)
    assert (a.start, a.length, a.parent) == (2, 3, ROOT)
    assert s.length == 13
    assert s.name == "s" and s.placeholder_token_id == PH


def test_module_start_is_sum_of_everything_before():
    s = schema('<module name="a">' + "x" * 50 + '</module><module name="b">' + "y" * 60
               + '</module><module name="c">z</module>')
    assert [s.modules[n].start for n in "abc"] == [0, 50, 110]
    assert s.length == 111


def test_union_members_share_start_and_union_reserves_longest():
    s = schema('pre<union name="u"><module name="x">xxxx</module>'
               '<module name="y">yy</module><module name="z">zzz</module></union>tail')
    assert [(s.modules[n].start, s.modules[n].length) for n in "xyz"] == [(3, 4), (3, 2), (3, 3)]
    assert LayoutEntry("u", "union", 3, 4, None) in s.layout
    assert LayoutEntry("y", "module", 3, 2, "u") in s.layout
    assert s.unions == {"u": ("x", "y", "z")}
    assert s.modules["y"].union == "u" and s.modules["y"].parent == ROOT
    assert s.modules[ROOT].position_ids[-4:] == (7, 8, 9, 10)
    assert s.length == 11


def test_unnamed_unions_get_generated_names():
    s = schema('<union><module name="a">a</module></union><union><module name="b">bb</module>'
               '<module name="c">c</module></union>')
    assert s.unions == {"@union1": ("a",), "@union2": ("b", "c")}
    assert s.modules["c"].union == "@union2"
    assert s.modules["c"].start == 1 and s.length == 3


def test_nested_modules_lie_inside_parent_span():
    s = schema('<module name="p">ab<module name="c">cd<module name="g">g</module></module>ef'
               '<union><module name="u1">uuu</module><module name="u2">u</module></union>'
               '</module>z')
    p, c, g = s.modules["p"], s.modules["p/c"], s.modules["p/c/g"]
    assert list(s.modules) == [ROOT, "p", "p/c", "p/c/g", "p/u1", "p/u2"]
    assert p.position_ids == (0, 1, 5, 6) and (p.start, p.length) == (0, 10)
    assert c.position_ids == (2, 3) and (c.start, c.length) == (2, 3) and c.parent == "p"
    assert g.position_ids == (4,) and g.ancestors(s.modules) == ("p/c", "p", ROOT)
    assert p.children == ("p/c", "p/u1", "p/u2") and c.children == ("p/c/g",)
    assert s.modules["p/u2"].start == 7 and s.modules["p/u2"].union == "@union1"
    assert LayoutEntry("@union1", "union", 7, 3, "p") in s.layout
    assert LayoutEntry("p/c/g", "module", 4, 1, "p/c") in s.layout
    assert s.modules[ROOT].position_ids == (10,)


def test_params_reserve_len_placeholders():
    s = schema('<module name="t">Plan <param name="d" len="4"/> now<param name="e" len="2"/>'
               '</module>')
    t = s.modules["t"]
    assert t.token_ids == ids(TOK, "Plan ") + (PH,) * 4 + ids(TOK, " now") + (PH,) * 2
    assert t.position_ids == tuple(range(15))
    d, e = t.params
    assert (d.name, d.module, d.start, d.length, d.offset, d.default) == ("d", "t", 5, 4, 5, ())
    assert (e.start, e.length, e.offset) == (13, 2, 13)
    assert LayoutEntry("t/d", "param", 5, 4, "t") in s.layout
    assert s.length == 15


def test_param_offset_counts_own_tokens_only_when_children_interrupt():
    s = schema('<module name="m">ab<module name="c">ccc</module>d<param name="x" len="2"/>'
               '</module>')
    x = s.modules["m"].params[0]
    assert (x.start, x.offset) == (6, 3)
    assert s.modules["m"].position_ids == (0, 1, 5, 6, 7)


def test_original_parameter_spelling_with_default():
    s = schema('<module name="m">go <parameter name="when" length="6" scaffold="today"/>'
               '</module><module name="n">x<param name="p" len="3" default="ab"/></module>')
    when = s.modules["m"].params[0]
    assert when.length == 6 and when.default == ids(TOK, "today")
    assert s.modules["n"].params[0].default == ids(TOK, "ab")


def test_scaffold_members_and_layout():
    s = schema('a<scaffold name="pe"><module name="person">pp</module>'
               '<module name="event">eee</module></scaffold><module name="other">o</module>')
    assert s.scaffolds["pe"].members == ("person", "event")
    assert s.modules["person"].scaffolds == ("pe",)
    assert s.modules["other"].scaffolds == ()
    assert LayoutEntry("pe", "scaffold", 1, 5, None) in s.layout
    assert LayoutEntry("event", "module", 3, 3, "pe") in s.layout
    assert s.modules["event"].parent == ROOT


def test_scaffold_inside_module_qualifies_members():
    s = schema('<module name="p">x<scaffold name="s1"><module name="a">a</module>'
               '<module name="b">b</module></scaffold></module>')
    assert s.scaffolds["s1"].members == ("p/a", "p/b")
    assert LayoutEntry("s1", "scaffold", 1, 2, "p") in s.layout


def test_layout_is_in_document_order():
    s = schema('r<module name="a">a<param name="x" len="1"/><module name="b">b</module></module>'
               '<union name="u"><module name="c">c</module></union>')
    assert [(e.name, e.kind) for e in s.layout] == [
        (ROOT, "anonymous"), ("a", "module"), ("a/x", "param"), ("a/b", "module"),
        ("u", "union"), ("c", "module")]


def test_whitespace_rule():
    s = schema("""
        <!-- a comment -->
        Intro line.
        <module name="doc">
            First line.
              indented  interior\tkept
            Last line.
        </module>
        <module name="t">Plan a <param name="d" len="3"/> trip <?pi data?> to X.</module>
        <module name="c">a<!-- gone -->b</module>
    """)
    assert own_text(s, ROOT) == "Intro line."
    assert own_text(s, "doc") == ("First line.\n              indented  interior\tkept\n"
                                  "            Last line.")
    assert s.modules["t"].token_ids[:7] == ids(TOK, "Plan a ")
    assert decode(TOK, s.modules["t"].token_ids[10:]) == " trip  to X."
    assert own_text(s, "c") == "ab"


def test_text_between_modules_is_stripped_at_block_edges():
    s = schema('<module name="a">A</module>\n  between  \n<module name="b">B</module>')
    assert own_text(s, ROOT) == "between"


def test_xml_space_preserve_keeps_edges():
    s = schema('<module name="a" xml:space="preserve">\n  A  \n</module>'
               '<module name="b">  B  </module>')
    assert own_text(s, "a") == "\n  A  \n"
    assert own_text(s, "b") == "B"


def test_each_text_run_is_tokenized_separately():
    tok = bpe_tokenizer()
    s = schema('<module name="m">Plan a trip<param name="x" len="2"/>to Miami</module>', tok)
    m = s.modules["m"]
    assert m.token_ids == ids(tok, "Plan a trip") + (tok.unk_token_id,) * 2 + ids(tok, "to Miami")


def test_bos_token_goes_to_root_when_tokenizer_adds_it():
    tok = byte_tokenizer(add_bos=True)
    s = schema('<module name="a">a</module>', tok)
    assert s.modules[ROOT].token_ids == (tok.bos_token_id,)
    assert s.modules["a"].start == 1
    assert s.layout[0] == LayoutEntry(ROOT, "anonymous", 0, 1, None)


def test_placeholder_falls_back_to_pad_then_eos():
    tok = byte_tokenizer()
    assert schema('<module name="a">a</module>', tok).placeholder_token_id == tok.unk_token_id
    tok.unk_token = None
    assert schema('<module name="a">a</module>', tok).placeholder_token_id == tok.eos_token_id


def test_role_tags_expand_through_chat_template():
    s = schema('<system>Be nice.</system><user><module name="q">Q?</module></user><assistant/>')
    expected = TOK.apply_chat_template(
        [{"role": "system", "content": "Be nice."}, {"role": "user", "content": "Q?"}],
        tokenize=False, add_generation_prompt=True)
    assert full_text(s) == expected
    assert own_text(s, ROOT).startswith("<|system|>Be nice.<|end|>\n<|user|>")


def test_role_tags_inside_modules_belong_to_the_module():
    s = schema('<module name="m"><user>Hello <param name="n" len="3"/></user></module>')
    m = s.modules["m"]
    assert m.token_ids[:7] == ids(TOK, "<|user|>Hello ")
    assert m.params[0].offset == 7
    assert decode(TOK, m.token_ids[10:]) == "<|end|>\n"


def test_role_expansion_skips_injected_default_system_message():
    tok = byte_tokenizer(DEFAULT_SYSTEM_TEMPLATE)
    s = schema("<user>hi</user>", tok)
    assert own_text(s, ROOT, tok) == "<|user|>hi<|end|>\n"


def test_template_bos_moves_to_schema_start():
    tok = byte_tokenizer(BOS_TEMPLATE)
    s = schema("<system>S</system><user>U</user>", tok)
    ref = tok.apply_chat_template([{"role": "system", "content": "S"},
                                   {"role": "user", "content": "U"}], tokenize=False)
    assert own_text(s, ROOT, tok) == ref
    tok_bos = byte_tokenizer(BOS_TEMPLATE, add_bos=True)
    s = schema("<system>S</system>", tok_bos)
    assert s.modules[ROOT].token_ids.count(tok_bos.bos_token_id) == 1


def test_plain_role_fallback_without_template():
    tok = byte_tokenizer(chat_template=None)
    s = schema("<system>S</system><user>U</user><assistant>A</assistant><assistant/>", tok)
    assert own_text(s, ROOT, tok) == "System: S\nUser: U\nAssistant: A\nAssistant:"


def test_src_loads_file_relative_to_base_dir(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("\n  file text  \n", encoding="utf-8")
    s = schema('<module name="doc" src="docs/a.txt"/>after', base_dir=tmp_path)
    assert own_text(s, "doc") == "file text"
    assert s.modules[ROOT].position_ids == tuple(range(9, 14))
    (tmp_path / "docs" / "a.txt").write_text("changed", encoding="utf-8")
    s2 = schema('<module name="doc" src="docs/a.txt"/>after', base_dir=tmp_path)
    assert s2.digest != s.digest


@pytest.mark.parametrize("src", ["../secret.txt", "/etc/passwd", "docs/../../secret.txt",
                                 "link.txt"])
def test_src_refuses_paths_escaping_base_dir(tmp_path, src):
    base = tmp_path / "base"
    (base / "docs").mkdir(parents=True)
    (tmp_path / "secret.txt").write_text("secret")
    os.symlink(tmp_path / "secret.txt", base / "link.txt")
    with pytest.raises(PMLError, match="escapes the schema directory|relative path"):
        schema(f'<module name="d" src="{src}"/>', base_dir=base)


def test_src_errors(tmp_path):
    with pytest.raises(PMLError, match="no such file"):
        schema('<module name="d" src="missing.txt"/>', base_dir=tmp_path)
    with pytest.raises(PMLError, match="base_dir"):
        schema('<module name="d" src="missing.txt"/>')
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(PMLError, match="must be empty"):
        schema('<module name="d" src="a.txt">text</module>', base_dir=tmp_path)
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe")
    with pytest.raises(PMLError, match="not UTF-8"):
        schema('<module name="d" src="bin.txt"/>', base_dir=tmp_path)
    (tmp_path / "big.txt").write_text("x" * 100)
    with pytest.raises(PMLError, match="max_src_bytes"):
        schema('<module name="d" src="big.txt"/>', base_dir=tmp_path,
               limits=Limits(max_src_bytes=50))


def test_names_may_hold_letters_digits_dot_dash_underscore():
    s = schema('<module name="2024-report.v1_final">r</module><module name="café">c</module>')
    assert "2024-report.v1_final" in s.modules and "café" in s.modules


def test_same_local_name_in_different_scopes():
    s = schema('<module name="a"><module name="x">1</module></module>'
               '<module name="b"><module name="x">2</module></module>')
    assert "a/x" in s.modules and "b/x" in s.modules


def test_max_positions():
    body = '<module name="a">' + "x" * 10 + "</module>"
    assert schema(body, max_positions=10).length == 10
    with pytest.raises(PMLError, match=r"does not fit: module 'a' ends at position 11, past the "
                                       r"model's limit of 10 positions \(max_positions\)"):
        schema("y" + body, max_positions=10)
    with pytest.raises(PMLError, match="anonymous text ends at position 11"):
        schema(body + "y", max_positions=10)


def test_digest_depends_on_text_and_tokenizer():
    a = schema('<module name="a">a</module>')
    assert a.digest == schema('<module name="a">a</module>').digest
    assert a.digest != schema('<module name="a">b</module>').digest
    assert a.digest != schema('<module name="a">a</module>', byte_tokenizer(BOS_TEMPLATE)).digest
    assert a.source.startswith("<schema")


def test_bytes_input_and_xml_declaration():
    text = '<?xml version="1.0" encoding="UTF-8"?>\n<schema name="s">héllo</schema>'
    s = parse_schema(text.encode("utf-8"), TOK)
    assert own_text(s, ROOT) == "héllo"
    assert parse_schema(text, TOK).length == s.length == len("héllo".encode())


def test_cdata_is_text():
    s = schema('<module name="a"><![CDATA[<b>&x]]></module>')
    assert own_text(s, "a") == "<b>&x"


def test_simple_template_used_by_default():
    assert TOK.chat_template == SIMPLE_TEMPLATE


STRICT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}"
    "{% endif %}[{{ m['role'] }}]{{ m['content'] }}[/]{% endfor %}"
)
"""Refuses system messages and ignores add_generation_prompt."""


def test_template_that_refuses_a_role():
    tok = byte_tokenizer(STRICT_TEMPLATE)
    s = schema("<user>U</user><assistant>A</assistant><assistant/>", tok)
    assert own_text(s, ROOT, tok) == "[user]U[/][assistant]A[/][assistant]"
    with pytest.raises(PMLError, match="<system> cannot be expanded: the tokenizer's chat "
                                       "template cannot render a 'system' message") as info:
        schema("x\n<system>S</system>", tok)
    assert (info.value.line, info.value.column) == (2, 1)
