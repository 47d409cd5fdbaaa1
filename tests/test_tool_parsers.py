"""Tool-call parsers beside Hermes: Llama-3 JSON, Mistral and pythonic (vLLM's formats). For each:
whole and streamed reconstruction are equal (content deltas joined, then the call deltas), a
malformed call stays text, several calls parse, arguments are JSON; ``auto`` picks the format
the chat template teaches."""

from __future__ import annotations

import json
import random

import pytest

from pckernels.server.tool_parsers import BY_NAME, PARSERS, ForcedCallParser, ToolStream, pick_parser, template_parser

CASES = {
    "hermes": [
        ('I will look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
         "I will look.", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ],
    "llama3_json": [
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}',
         None, [("get_weather", {"city": "Paris", "days": 2})]),
        ('{"name": "a", "parameters": {"x": [1, 2]}}; {"name": "b", "arguments": {"y": null}}',
         None, [("a", {"x": [1, 2]}), ("b", {"y": None})]),
    ],
    "mistral": [
        ('Checking. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}, '
         '{"name": "get_time", "arguments": {"zone": "utc"}}]',
         "Checking.", [("get_weather", {"city": "Rome"}), ("get_time", {"zone": "utc"})]),
        ('[TOOL_CALLS][{"name": "f", "arguments": {}}]', None, [("f", {})]),
    ],
    "pythonic": [
        ('[get_weather(city="Paris", days=2), get_time(zone=\'utc\', exact=True, extra=None)]',
         None, [("get_weather", {"city": "Paris", "days": 2}),
                ("get_time", {"zone": "utc", "exact": True, "extra": None})]),
        ("[tools.search(query='a, b', limit=[1, {'k': -2.5}])]", None,
         [("tools.search", {"query": "a, b", "limit": [1, {"k": -2.5}]})]),
    ],
}

MALFORMED = {
    "hermes": ["<tool_call>{not json}</tool_call>", "plain text"],
    "llama3_json": ['{"name": "f", "parameters": {"x": 1}', '{"name": "f", "parameters": {}} and then words',
                    '{"name": "f"} and more', 'Sure: {"name": "f", "parameters": {}}', '{"parameters": {}}',
                    "plain text"],
    "mistral": ['[TOOL_CALLS] [{"name": "f", "arguments": {}', '[TOOL_CALLS] [{"arguments": {}}]',
                "[TOOL_CALLS] nope", "plain text"],
    "pythonic": ["[f(1, 2)]", "[f(a=g())]", "[f(a=__import__('os').system('true'))]", "[f(**kw)]", "[1, 2]",
                 "[f(a=1)", "plain [f(a=1)]", "[]", "plain text"],
}


def calls_of(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def streamed(parser, text, pieces):
    stream, content = ToolStream(parser), ""
    for end in pieces:
        content += stream.push(text[:end])
    rest, deltas = stream.finish(text)
    for k, delta in enumerate(deltas):
        assert delta["index"] == k and delta["type"] == "function" and delta["id"].startswith("call_")
    return content + rest, deltas


def cuts(text, seed):
    rng = random.Random(seed)
    ends = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 7))) if len(text) > 1 else []
    return [list(range(1, len(text) + 1)), ends + [len(text)]]


@pytest.mark.parametrize("name", PARSERS)
def test_whole_and_streamed_agree(name):
    parser = BY_NAME[name]
    for text, content, calls in CASES[name]:
        got_content, got_calls = parser.parse(text)
        assert got_content == content and calls_of(got_calls) == calls
        for arguments in got_calls:
            assert isinstance(arguments["function"]["arguments"], str)
        for seed, pieces in enumerate(cuts(text, 1)):
            shown, deltas = streamed(parser, text, pieces)
            assert shown == (content or "") and calls_of(deltas) == calls, (name, seed)


@pytest.mark.parametrize("name", PARSERS)
def test_malformed_stays_text(name):
    parser = BY_NAME[name]
    for text in MALFORMED[name]:
        assert parser.parse(text) == (text, []), text
        for pieces in cuts(text, 2):
            assert streamed(parser, text, pieces) == (text, [])


def test_streaming_holds_back_only_what_may_be_a_call():
    stream = ToolStream(BY_NAME["mistral"])
    assert stream.push("Hello [TOOL") == "Hello"  # a trailing space waits: it may end the content
    assert stream.push("Hello [TOOL_CALLS] [") == ""
    stream = ToolStream(BY_NAME["pythonic"])
    assert stream.push("  ") == "" and stream.push("  The answer") == "  The answer"
    stream = ToolStream(BY_NAME["llama3_json"])
    assert stream.push("<|python") == "" and stream.push('{"na') == ""
    stream = ToolStream(BY_NAME["hermes"])
    assert stream.push("Sure <tool_") == "Sure" and stream.push("Sure <tool_call>{") == ""


def test_auto_picks_the_template_format(tokenizer):  # noqa: F811
    assert template_parser("{{ '<tool_call>\\n' }}") == "hermes"
    assert template_parser("{{ '[TOOL_CALLS] ' + tool_calls|tojson }}") == "mistral"
    assert template_parser('{{- "<|python_tag|>" }}{"name": ... "parameters"') == "llama3_json"
    assert template_parser('[func_name1(params_name1=params_value1, ...)] <|eot_id|> "parameters"') == "pythonic"
    assert template_parser({"default": "x", "tool_use": "<tool_call>"}) == "hermes"
    assert template_parser(None) == "hermes"
    assert pick_parser("auto", tokenizer).name == template_parser(tokenizer.chat_template)
    assert pick_parser("pythonic", tokenizer).name == "pythonic"
    with pytest.raises(ValueError, match="tool-call parser"):
        pick_parser("json", tokenizer)


from test_engine import tokenizer  # noqa: E402,F401  (a fixture)


WHOLE_CALL = '<tool_call>\n{"name": "City", "arguments": {"name": "Paris", "country": "France"}}\n</tool_call>'


@pytest.mark.parametrize("function", ["City", None])
def test_a_cut_forced_call_is_still_a_call(function):
    """A forced call cut by max_tokens comes back as a call with its arguments so far (invalid
    JSON), as OpenAI and vLLM send it, instead of as content (issue 43: LangChain's
    with_structured_output answered None). Whole, several and streamed answers are unchanged."""
    parser = ForcedCallParser(function)
    for cut in (len('<tool_call>\n{"name": "City", "arguments": {"name": "Pa'), len(WHOLE_CALL) - 16,
                len('<tool_call>\n{"name": "City"'), len('<tool_call>\n{"name": "City", "argu')):
        content, [call] = parser.parse(WHOLE_CALL[:cut])
        assert content is None and call["function"]["name"] == "City", WHOLE_CALL[:cut]
        arguments = call["function"]["arguments"]
        assert WHOLE_CALL[:cut].endswith(arguments) and not _is_json(arguments)
        stream = ToolStream(parser)
        assert stream.push(WHOLE_CALL[:cut]) == ""
        rest, [delta] = stream.finish(WHOLE_CALL[:cut])
        assert rest == "" and delta["function"] == call["function"] and delta["index"] == 0
    # cut before the name is whole: a named choice knows it, `required` does not
    early = WHOLE_CALL[:len('<tool_call>\n{"na')]
    content, calls = parser.parse(early)
    assert (content, [c["function"] for c in calls]) == ((None, [{"name": "City", "arguments": ""}]) if function
                                                          else (early, []))
    # whole calls, and a second cut after a whole first one
    content, [call] = parser.parse(WHOLE_CALL)
    assert content is None and json.loads(call["function"]["arguments"]) == {"name": "Paris", "country": "France"}
    content, (first, second) = parser.parse(WHOLE_CALL + "\n" + WHOLE_CALL[:40])
    assert content is None and json.loads(first["function"]["arguments"])["name"] == "Paris"
    assert second["function"]["name"] == "City" and not _is_json(second["function"]["arguments"])
    # text without a block (what no forced grammar writes) is left alone
    assert parser.parse("Paris") == ("Paris", [])


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


CITY = {"type": "object", "properties": {"name": {"type": "string"}, "country": {"type": "string"}},
        "required": ["name", "country"], "additionalProperties": False}


def test_a_named_choice_forces_exactly_one_call(tokenizer):  # noqa: F811
    """``tool_choice`` naming a function is one call, whatever ``parallel_tool_calls`` says (OpenAI
    and vLLM): SmolLM2 repeated the forced call until max_tokens, and instructor's TOOLS mode raised
    on the ``length`` finish. ``required`` stays one or more calls, one when parallel is false."""
    from pckernels.generation.grammar import Grammars
    from pckernels.server.tools import forced

    grammars = Grammars(tokenizer)
    tools = [{"type": "function", "function": {"name": "City", "parameters": CITY}}]

    def accepts(lark: str, text: str) -> bool:
        matcher = grammars.lark(lark).matcher()._matcher
        ids = tokenizer.encode(text, add_special_tokens=False)
        return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()

    named = {"type": "function", "function": {"name": "City"}}
    for choice, parallel, several in [(named, None, False), (named, True, False), ("required", None, True),
                                      ("required", True, True), ("required", False, False)]:
        lark = forced(tools, choice, parallel)
        assert accepts(lark, WHOLE_CALL) and accepts(lark, WHOLE_CALL + "\n")
        assert not accepts(lark, WHOLE_CALL[:-3])
        assert accepts(lark, WHOLE_CALL + "\n" + WHOLE_CALL) == several, (choice, parallel)
