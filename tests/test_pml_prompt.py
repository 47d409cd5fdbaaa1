"""Prompt resolution: imports, arguments, segments and the text placement rule."""

from __future__ import annotations

import pytest

from pckernels.pml import ROOT, PMLError, Segment, check_answerable, parse_prompt, parse_schema
from pml_tokenizers import byte_tokenizer, decode, ids

TOK = byte_tokenizer()
PH = TOK.unk_token_id

TRAVEL = parse_schema("""
<schema name="travel">
  <module name="sys">You are a guide.</module>
  <module name="trip">Plan a <param name="duration" len="8"/> trip.</module>
  <union name="city">
    <module name="miami">Miami is hot.</module>
    <module name="paris">Paris is a city.</module>
  </union>
  <module name="q">Q: <param name="question" len="20" default="none"/></module>
  <module name="r">R<param name="extra" len="4"/></module>
</schema>""", TOK, max_positions=100)
SCHEMAS = {"travel": TRAVEL}


def prompt(body: str, schemas=SCHEMAS, name="travel"):
    return parse_prompt(f'<prompt schema="{name}">{body}</prompt>', schemas)


def seg(kind, text_or_ids, start, module=None, param=None):
    token_ids = ids(TOK, text_or_ids) if isinstance(text_or_ids, str) else tuple(text_or_ids)
    return Segment(kind, token_ids, tuple(range(start, start + len(token_ids))), module, param)


def test_schema_positions_used_by_the_prompts():
    assert [(TRAVEL.modules[n].start, TRAVEL.modules[n].length)
            for n in ("sys", "trip", "miami", "paris", "q", "r")] == [
        (0, 16), (16, 21), (37, 13), (37, 16), (53, 23), (76, 5)]
    assert TRAVEL.length == 81


def test_imports_arguments_and_segments():
    p = prompt('<sys/><trip duration="3 days"/><paris/> What now?')
    assert p.modules == (ROOT, "sys", "trip", "paris")
    assert p.arguments == {("trip", "duration"): ids(TOK, "3 days")}
    assert p.segments == (
        seg("cached", "You are a guide.", 0, "sys"),
        seg("cached", "Plan a ", 16, "trip"),
        seg("slot", (PH,) * 8, 23, "trip", "duration"),
        seg("argument", "3 days", 23, "trip", "duration"),
        seg("cached", " trip.", 31, "trip"),
        seg("cached", "Paris is a city.", 37, "paris"),
        seg("text", "What now?", 81),
    )
    assert decode(TOK, p.token_ids) == "You are a guide.Plan a 3 days trip.Paris is a city.What now?"
    assert p.position_ids[:29] == tuple(range(29))
    assert p.position_ids[29:] == tuple(range(31, 53)) + tuple(range(81, 90))
    assert [s.kind for s in p.uncached_segments] == ["argument", "text"]
    assert p.schema is TRAVEL and p.scaffolds == ()


def test_missing_argument_uses_default_or_nothing():
    p = prompt("<q/><r/>")
    assert p.arguments == {("q", "question"): ids(TOK, "none"), ("r", "extra"): ()}
    kinds = [(s.kind, s.param, s.position_ids[0]) for s in p.segments]
    assert kinds == [("cached", None, 53), ("slot", "question", 56), ("argument", "question", 56),
                     ("cached", None, 76), ("slot", "extra", 77)]


def test_short_argument_fills_first_slot_positions():
    p = prompt('<r extra="ab"/>')
    argument = [s for s in p.segments if s.kind == "argument"][0]
    assert argument.position_ids == (77, 78)


def test_argument_longer_than_len_is_refused():
    with pytest.raises(PMLError, match=r"parameter 'duration' of module 'trip' is 9 tokens, "
                                       r"longer than its len=8") as info:
        prompt('<trip duration="123456789"/>')
    assert (info.value.line, info.value.column) == (1, 25)


def test_argument_exactly_len_is_accepted():
    p = prompt('<trip duration="12345678"/>')
    assert p.arguments[("trip", "duration")] == ids(TOK, "12345678")


def test_text_after_last_import_starts_at_schema_length():
    p = prompt("<sys/>first <user>second</user><assistant/>")
    texts = [s for s in p.segments if s.kind == "text"]
    assert len(texts) == 1
    assert texts[0].position_ids[0] == TRAVEL.length
    assert decode(TOK, texts[0].token_ids) == "first<|user|>second<|end|>\n<|assistant|>"
    assert texts[0].position_ids == tuple(range(81, 81 + len(texts[0].token_ids)))


def test_prompt_without_imports_is_all_trailing_text():
    p = prompt("just text")
    assert p.modules == (ROOT,)
    assert p.segments == (seg("text", "just text", 81),)


def test_text_between_imports_fills_unimported_positions():
    p = prompt("<sys/> hello <paris/>")
    assert seg("text", "hello", 16) in p.segments
    p = prompt("<sys/>" + "x" * 21 + "<paris/>")
    assert seg("text", "x" * 21, 16) in p.segments


def test_text_between_imports_that_does_not_fit_is_refused():
    with pytest.raises(PMLError, match=r"needs 22 positions but only 21 are free at 16 before "
                                       r"module 'paris'.*<param name=\"buffer\" len=\"22\"/>") as info:
        prompt("<sys/>" + "x" * 22 + "<paris/>")
    assert (info.value.line, info.value.column) == (1, 31)


def test_text_before_first_import():
    p = prompt("hi <trip/>")
    assert seg("text", "hi", 0) in p.segments
    with pytest.raises(PMLError, match="at the start of the prompt needs 2 positions but only 0"):
        prompt("hi <sys/>")


def test_text_skips_anonymous_schema_text():
    s = parse_schema('<schema name="a">A<module name="m">mm</module>B<module name="n">nn</module>'
                     '</schema>', TOK)
    p = prompt("t <n/>", {"a": s}, "a")
    assert seg("text", "t", 1) in p.segments
    assert seg("cached", "A", 0, ROOT) in p.segments and seg("cached", "B", 3, ROOT) in p.segments
    assert seg("text", "tt", 1) in prompt("tt <n/>", {"a": s}, "a").segments
    with pytest.raises(PMLError, match="only 2 are free at 1 before the schema's anonymous text"):
        prompt("ttt <n/>", {"a": s}, "a")
    with pytest.raises(PMLError, match="only 0 are free at 4 before module 'n'"):
        prompt("<m/> t <n/>", {"a": s}, "a")
    assert seg("text", "t", 6) in prompt("<m/> t", {"a": s}, "a").segments


def test_param_buffer_is_how_to_make_room():
    s = parse_schema('<schema name="b"><module name="doc">Doc.</module>'
                     '<module name="ask"><param name="buffer" len="30"/>Answer briefly.</module>'
                     '</schema>', TOK)
    p = prompt('<doc/><ask buffer="Is it long?"/>', {"b": s}, "b")
    assert seg("argument", "Is it long?", 4, "ask", "buffer") in p.segments


def test_imports_in_any_order_sit_at_their_schema_positions():
    ordered = prompt('<sys/><trip duration="3 days"/><paris/><q/> What now?')
    for body in ('<paris/><q/><trip duration="3 days"/><sys/> What now?',
                 '<q/><sys/><paris/><trip duration="3 days"/> What now?'):
        shuffled = prompt(body)
        assert shuffled.segments == ordered.segments
        assert shuffled.modules == ordered.modules == (ROOT, "sys", "trip", "paris", "q")
        assert shuffled.arguments == ordered.arguments


def test_text_between_out_of_order_imports_follows_the_import_before_it():
    p = prompt("<paris/> hi <sys/> yo <r/>")
    assert seg("text", "hi", 53) in p.segments
    assert seg("text", "yo", 16) in p.segments
    p = prompt("<trip/> a <sys/> b")
    assert seg("text", "a", 37) in p.segments and seg("text", "b", 81) in p.segments
    with pytest.raises(PMLError, match=r"text after module 'q' needs 2 positions but only 0 are "
                                       r"free at 81 before the end of the schema"):
        prompt("<r/><q/> hi <sys/>")
    with pytest.raises(PMLError, match=r"text after module 'q' needs 2 positions but only 0 are "
                                       r"free at 76 before module 'r'"):
        prompt("<q/> hi <r/><sys/>")


def test_text_never_lands_on_text_placed_earlier():
    s = parse_schema('<schema name="e"><module name="a">aa</module><union>'
                     '<module name="none"> </module><module name="b">bbbbbbbb</module></union>'
                     '<module name="c">cc</module></schema>', TOK)
    assert s.modules["none"].position_ids == () and s.modules["none"].start == 2
    p = prompt("<a/> xy <none/> zw <c/>", {"e": s}, "e")
    assert seg("text", "xy", 2) in p.segments and seg("text", "zw", 4) in p.segments
    assert seg("text", "abcd", 6) in prompt("<a/> wxyz <none/> abcd <c/>", {"e": s}, "e").segments
    with pytest.raises(PMLError, match="needs 5 positions but only 4 are free at 6 before module 'c'"):
        prompt("<a/> wxyz <none/> abcde <c/>", {"e": s}, "e")


def test_two_members_of_one_union_are_refused():
    with pytest.raises(PMLError, match="'miami' and 'paris' belong to the same union 'city'") as info:
        prompt("<miami/><paris/>")
    assert (info.value.line, info.value.column) == (1, 33)


def test_duplicate_import_is_refused():
    with pytest.raises(PMLError, match="imported twice"):
        prompt("<sys/><sys/>")


def test_unknown_module_suggests_close_matches():
    with pytest.raises(PMLError, match=r"unknown module 'pariss' in schema 'travel'; did you mean "
                                       r"'paris'\?") as info:
        prompt("<sys/>\n  <pariss/>")
    assert (info.value.line, info.value.column) == (2, 3)


def test_unknown_parameter_is_refused():
    with pytest.raises(PMLError, match=r"module 'trip' has no parameter 'durration' \(its "
                                       r"parameters: duration\); did you mean 'duration'\?"):
        prompt('<trip durration="x"/>')


def test_unknown_schema_suggests_close_matches():
    with pytest.raises(PMLError, match=r"unknown schema 'travle'; did you mean 'travel'\?"):
        prompt("<sys/>", name="travle")


NESTED = parse_schema('<schema name="n"><module name="p">ab<module name="c">cd</module>ef'
                      '<module name="d">g<param name="x" len="2"/></module></module>'
                      '<module name="z">z</module></schema>', TOK)


def test_nested_imports():
    p = prompt('<p><d x="1"/></p><z/>', {"n": NESTED}, "n")
    assert p.modules == (ROOT, "p", "p/d", "z")
    assert p.segments == (
        seg("cached", "ab", 0, "p"), seg("cached", "ef", 4, "p"), seg("cached", "g", 6, "p/d"),
        seg("slot", (PH, PH), 7, "p/d", "x"), seg("argument", "1", 7, "p/d", "x"),
        seg("cached", "z", 9, "z"))


def test_qualified_import_implies_ancestors():
    p = prompt('<module name="p/c"/>', {"n": NESTED}, "n")
    assert p.modules == (ROOT, "p", "p/c")
    assert p.arguments == {}


def test_parent_import_alone_leaves_children_out():
    p = prompt("<p/> x", {"n": NESTED}, "n")
    assert p.modules == (ROOT, "p")
    assert seg("text", "x", 10) in p.segments


def test_nested_module_imported_at_top_level_gets_a_hint():
    with pytest.raises(PMLError, match=r"'p/c' is nested: import it as <module name=\"p/c\"/>"):
        prompt("<c/>", {"n": NESTED}, "n")


def test_nested_imports_in_any_order():
    ordered = prompt('<p><c/><d x="1"/></p><z/>', {"n": NESTED}, "n")
    for body in ('<z/><p><d x="1"/><c/></p>', '<module name="p/d" x="1"/><z/><p><c/></p>'):
        assert prompt(body, {"n": NESTED}, "n").segments == ordered.segments
    with pytest.raises(PMLError, match="'p/d' is imported twice"):
        prompt('<p><d/></p><module name="p/d"/>', {"n": NESTED}, "n")


def test_text_inside_an_import_is_refused():
    with pytest.raises(PMLError, match="text inside the import of 'p' is not allowed"):
        prompt("<p>hello<c/></p>", {"n": NESTED}, "n")


def test_module_tag_for_names_that_are_not_xml_names():
    s = parse_schema('<schema name="w"><module name="2024-report">r</module>'
                     '<module name="user">u<param name="k" len="3"/></module></schema>', TOK)
    p = prompt('<module name="2024-report"/><module name="user" k="v"/>', {"w": s}, "w")
    assert p.modules == (ROOT, "2024-report", "user")
    assert p.arguments[("user", "k")] == ids(TOK, "v")


SCAFFOLD = parse_schema('<schema name="sc"><scaffold name="pe"><module name="person">P</module>'
                        '<module name="event">E</module></scaffold><module name="o">O</module>'
                        '</schema>', TOK)


def test_scaffold_import_imports_all_members():
    p = prompt('<scaffold name="pe"/><o/>', {"sc": SCAFFOLD}, "sc")
    assert p.modules == (ROOT, "person", "event", "o")
    assert p.scaffolds == ("pe",)


def test_scaffold_import_by_tag_name():
    p = prompt("<pe/><o/>", {"sc": SCAFFOLD}, "sc")
    assert p.modules == (ROOT, "person", "event", "o")
    assert p.scaffolds == ("pe",)
    with pytest.raises(PMLError, match="scaffold 'pe' takes no arguments"):
        prompt('<pe x="1"/>', {"sc": SCAFFOLD}, "sc")


def test_scaffold_applies_when_all_members_imported_individually():
    assert prompt("<person/><event/>", {"sc": SCAFFOLD}, "sc").scaffolds == ("pe",)
    assert prompt("<person/>", {"sc": SCAFFOLD}, "sc").scaffolds == ()


def test_scaffold_import_errors():
    with pytest.raises(PMLError, match="unknown scaffold 'pes'.*did you mean 'pe'"):
        prompt('<scaffold name="pes"/>', {"sc": SCAFFOLD}, "sc")
    with pytest.raises(PMLError, match="'person' is imported twice"):
        prompt('<person/><scaffold name="pe"/>', {"sc": SCAFFOLD}, "sc")


def test_generation_prompt_from_empty_assistant():
    p = prompt("<sys/><user>Hi</user><assistant/>")
    assert decode(TOK, p.segments[-1].token_ids) == "<|user|>Hi<|end|>\n<|assistant|>"


def test_prompt_past_model_position_limit_is_refused():
    prompt("x" * 19)
    with pytest.raises(PMLError, match="ends at position 101, past the model's limit of 100"):
        prompt("x" * 20)


def test_segments_cover_every_token_sorted():
    p = prompt('a <trip duration="x"/><miami/><q question="why"/><r/> tail')
    starts = [s.position_ids[0] for s in p.segments]
    assert starts == sorted(starts)
    covered = sorted(pos for s in p.segments if s.kind != "argument" for pos in s.position_ids)
    assert len(covered) == len(set(covered))
    for s in p.segments:
        assert len(s.token_ids) == len(s.position_ids)
        assert list(s.position_ids) == list(range(s.position_ids[0], s.position_ids[-1] + 1))


def test_schema_given_directly():
    assert prompt("<sys/>", TRAVEL).modules == (ROOT, "sys")


def test_check_answerable_refuses_only_a_prompt_without_tokens():
    """A prompt may end with an import (the engine computes that token afresh); one without tokens
    is a located error in every mode."""
    check_answerable(prompt("<trip/> go"))
    check_answerable(prompt('<r extra="ab"/>'))
    check_answerable(prompt("<sys/>\n <paris/>"))
    check_answerable(prompt('<trip duration="x"/>'))
    check_answerable(prompt("<q/>"))
    bare = parse_schema('<schema name="b"><module name="m">m</module></schema>', TOK)
    empty = parse_prompt('<prompt schema="b"/>', bare, label="p.xml")
    with pytest.raises(PMLError, match=r"^p.xml: line 1, column 1: the prompt has no tokens"):
        check_answerable(empty)
