"""Prompt programs (``pckernels.program``): per construct, the PML prompt's baseline text is the
text the Python function returns, cached equals the module-masked reference, and the schema
parses back to the structure the compiler declared. A tiny random Llama with the SmolLM2
tokenizer (tests/test_engine.py): exactness needs no trained weights."""

from __future__ import annotations

import re
import threading

import program_examples as ex
import pytest
from pml_tokenizers import BOS_TEMPLATE, byte_tokenizer
from test_engine import FP32_TOL, tiny_llama, tokenizer  # noqa: F401  (tokenizer is a fixture)

from pckernels.engine import PromptCache
from pckernels.errors import PMLError, ProgramError
from pckernels.pml import ROOT, parse_prompt, parse_schema
from pckernels.program import Program, ProgramCall, chat_format, program

CASES = {
    # name: (program, args, kwargs, token ids equal to the whole rendered string's)
    "literal": (ex.literal, (), {}, True),
    "flag-on": (ex.flag, (True, "Why is the sky blue?"), {}, True),
    "flag-off": (ex.flag, (False, "Why is the sky blue?"), {}, True),
    "elif-first": (ex.branches, ("beginner", "What is a derivative?"), {}, True),
    "elif-second": (ex.branches, ("expert", "What is a derivative?"), {}, True),
    "elif-else": (ex.branches, ("other", "What is a derivative?"), {}, True),
    "enum": (ex.tone, (ex.Tone.BRISK, "How are you?"), {}, True),
    "int-one": (ex.count, (1, "How many?"), {}, True),
    "int-or": (ex.count, (3, "How many?"), {}, True),
    "int-default": (ex.count, (-5, "How many?"), {}, True),
    "nested-union": (ex.nested, ("city", True, 1, "Describe it."), {}, True),
    "nested-default": (ex.nested, ("city", True, 9, "Describe it."), {}, True),
    "nested-outer-only": (ex.nested, ("city", False, 1, "Describe it."), {}, True),
    "nested-other-member": (ex.nested, ("village", True, 1, "Describe it."), {}, True),
    "nested-none": (ex.nested, ("town", True, 1, "Describe it."), {}, True),
    "calls": (ex.planner, ("4", True, "Where first?"), {}, False),
    "calls-no-food": (ex.planner, ("10", False, "Where first?"), {}, False),
    "loop-some": (ex.rag, (frozenset(ex.DOCS[1:]), "Which capitals?"), {}, True),
    "loop-none": (ex.rag, (frozenset(), "Which capitals?"), {}, True),
    "loop-all": (ex.every_doc, ("Which is in Asia?",), {}, False),
    "odd": (ex.odd, ("Zoë <&>\"\n\t", False), {}, False),
    "odd-on": (ex.odd, ("", True), {}, False),
    "fstring": (ex.fstring, ("Ann", "What now?"), {}, False),
}


@pytest.fixture(scope="module")
def cache(tokenizer):
    return PromptCache(tiny_llama(len(tokenizer)), tokenizer, placement="schema")


def _call(name: str) -> ProgramCall:
    prog, args, kwargs, _ = CASES[name]
    return prog(*args, **kwargs)


@pytest.mark.parametrize("name", sorted(CASES))
def test_baseline_text_is_the_functions_text_and_cached_equals_reference(cache, tokenizer, name):
    call = _call(name)
    text = call.render(tokenizer)
    base = cache.generate(call, mode="baseline", max_new_tokens=2)
    assert tokenizer.decode(base.prompt_token_ids, clean_up_tokenization_spaces=False) == text
    if CASES[name][3]:
        assert base.prompt_token_ids == tokenizer(text, add_special_tokens=False).input_ids
    ref = cache.generate(call, mode="reference", max_new_tokens=4)
    got = cache.generate(call, mode="cached", max_new_tokens=4)
    assert got.prompt_token_ids == ref.prompt_token_ids == base.prompt_token_ids
    assert got.positions == ref.positions
    assert (got.first_logits - ref.first_logits).abs().max().item() <= FP32_TOL
    assert got.token_ids == ref.token_ids
    assert got.cached_tokens > 0


@pytest.mark.parametrize("prog", sorted({c[0] for c in CASES.values()}, key=lambda p: p.__name__),
                         ids=lambda p: p.__name__)
def test_schema_round_trips_through_the_parser(tokenizer, prog):
    schema = parse_schema(prog.schema, tokenizer)
    assert schema.name == prog.schema_name
    assert [m for m in schema.modules if m != ROOT] == prog.structure.modules
    assert schema.unions == prog.structure.unions
    params = {m: tuple(p.name for p in module.params) for m, module in schema.modules.items() if module.params}
    assert params == prog.structure.params
    again = Program(prog.function)
    assert (again.schema, again.schema_name) == (prog.schema, prog.schema_name)


def test_plain_function_stays_callable_and_renders_plain_roles():
    text = ex.flag.function(True, "Hi?")
    assert text == "System: You are a helpful assistant.\nSystem: Answer in one sentence.\nUser: Hi?\nAssistant:"
    assert ex.flag.render(True, "Hi?") == text == str(ex.flag(True, "Hi?"))
    assert ex.planner.render("4", False, "Go?").count("Plan a trip of") == 2


def test_constructs_compile_to_the_expected_pml():
    assert ex.flag.schema == (
        f'<schema name="{ex.flag.schema_name}" xml:space="preserve"\n'
        '  ><system>You are a helpful assistant.</system\n'
        '  ><module name="brief"\n    ><system>Answer in one sentence.</system\n  ></module\n></schema>')
    assert ex.flag(True, "Hi & bye?").prompt == (
        f'<prompt schema="{ex.flag.schema_name}" xml:space="preserve"><brief/><user>Hi &amp; bye?</user>'
        '<assistant/></prompt>')
    assert ex.count.structure.unions == {"n": ("n-1", "n-2-or-3", "n-default")}
    assert ex.branches.structure.unions == {"level": ("level-beginner", "level-expert", "level-else")}
    assert ex.tone.structure.unions == {"tone": ("tone-CALM", "tone-BRISK")}
    assert ex.nested.structure.modules == ["kind-city", "kind-city/detail", "kind-city/detail/n-1",
                                           "kind-city/detail/n-default", "kind-village"]
    assert ex.nested(kind="city", detail=True, n=4, question="Q").prompt.split("><", 1)[1].startswith(
        "kind-city><detail><n-default/></detail></kind-city><user>")
    assert ex.rag.structure.modules == ["doc-0", "doc-1", "doc-2"]
    assert "<doc-0/>" not in ex.rag(frozenset(ex.DOCS[1:]), "Q").prompt
    assert ex.planner.structure.modules == ["trip", "trip/food", "trip-2", "trip-2/food"]
    assert ex.planner.structure.params == {"trip": ("duration",), "trip/food": ("who",), "trip-2": ("duration",),
                                           "trip-2/food": ("who",)}
    assert ex.trip.structure.params == {"duration": ("duration",), "food": ("who",)}


def test_original_compilers_readme_example():
    """yale-sys/prompt-cache README, "Compiling Python function into PML", in this API. The
    original turns bare strings into text (they do nothing in Python: here they are refused, see
    test_refusals) and drops the union for its integer `match item:`; here it is a union."""

    @program
    def test_prompt(flag: bool, item: int) -> str:
        p = "some system message"
        if flag:
            p += "only if flag is true"
        match item:
            case 1:
                p += "item is 1"
            case 2:
                p += "item is 2"
        p += "some user message"
        return p

    name = test_prompt.schema_name
    assert name == "test_original_compilers_readme_example.test_prompt-bf1c0779ba10"  # the same in every process
    assert re.sub(r"\n *", "", test_prompt.schema) == (
        f'<schema name="{name}" xml:space="preserve">some system message<module name="flag">only if flag is '
        'true</module><union name="item"><module name="item-1">item is 1</module><module name="item-2">item '
        'is 2</module></union></schema>')
    assert test_prompt(True, 1).prompt == (f'<prompt schema="{name}" xml:space="preserve"><flag/><item-1/>'
                                           'some user message</prompt>')
    assert test_prompt(False, 2).prompt.endswith("><item-2/>some user message</prompt>")
    assert "<item-" not in test_prompt(True, 3).prompt

    @program
    def by_city(city: str) -> str:
        p = "Guide."
        match city:
            case "paris":
                p += "Paris."
            case "rome":
                p += "Rome."
        p += "Go."
        return p

    assert by_city.structure.unions == {"city": ("city-paris", "city-rome")}


def test_argument_at_max_length_passes_and_longer_is_refused_changing_nothing(tokenizer):
    cache = PromptCache(tiny_llama(len(tokenizer)), tokenizer, placement="schema")
    ten = "one two three four five six seven eight nine ten"
    assert len(tokenizer(ten, add_special_tokens=False).input_ids) == 10
    fits = " ".join(["go"] * 8)
    assert len(tokenizer(fits, add_special_tokens=False).input_ids) == 8
    with pytest.raises(ProgramError, match=r"argument 'duration' of trip\(\) is \d+ tokens, longer than its "
                                           r"MaxTokens\(8\)"):
        cache.generate(ex.planner(ten, True, "Q?"))
    assert ex.planner.schema_name not in cache.schemas and cache.stats()["encodes"] == 0
    got = cache.generate(ex.planner(fits, True, "Q?"), max_new_tokens=2)
    ref = cache.generate(ex.planner(fits, True, "Q?"), max_new_tokens=2, mode="reference")
    assert got.token_ids == ref.token_ids and ex.planner.schema_name in cache.schemas


def test_concurrent_first_calls_install_the_schema_once(tokenizer):
    cache = PromptCache(tiny_llama(len(tokenizer)), tokenizer, placement="schema")
    results, errors = {}, []

    def run(index: int) -> None:
        try:
            results[index] = cache.generate(ex.rag(frozenset(ex.DOCS[index % 3:]), "Which?"), max_new_tokens=3)
        except Exception as exc:  # collected and re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(results) == 6
    assert list(cache.schemas) == [ex.rag.schema_name]
    encodes = cache.stats()["encodes"]
    cache.generate(ex.rag(frozenset(ex.DOCS), "Which?"), max_new_tokens=1)
    assert cache.stats()["encodes"] == encodes
    for index in range(6):
        alone = cache.generate(ex.rag(frozenset(ex.DOCS[index % 3:]), "Which?"), max_new_tokens=3)
        assert alone.token_ids == results[index].token_ids


def test_complete_and_stream_take_a_call(cache, tokenizer):
    call = ex.flag(True, "Why is the sky blue?")
    assert cache.complete(call, max_new_tokens=3).token_ids == \
        cache.complete(call.render(tokenizer), max_new_tokens=3).token_ids
    assert "".join(cache.stream(call, max_new_tokens=3)) == cache.generate(call, max_new_tokens=3).text


def test_bos_and_plain_format_tokenizers():
    """A tokenizer that adds BOS puts it first (the schema's root); without a chat template roles
    expand to the plain fallback, as the function's own render does."""
    for tok, prefix in ((byte_tokenizer(BOS_TEMPLATE, add_bos=True), "<s>"), (byte_tokenizer(None), "")):
        for name in ("flag-on", "loop-some", "calls", "odd-on", "nested-union"):
            call = _call(name)
            schema = parse_schema(call.schema, tok)
            resolved = parse_prompt(call.prompt, schema)
            assert tok.decode(resolved.token_ids, clean_up_tokenization_spaces=False) == prefix + call.render(tok)
    with chat_format(byte_tokenizer(None)):
        assert ex.literal.function() == "System: You are terse.\nUser: Say hi.\nAssistant:"


def test_a_program_ending_with_a_module_is_answered_like_its_reference(cache):
    """A program whose last piece is a module (a sub-program) runs in every mode; cached mode
    computes its last cached token afresh, as for any PML prompt ending with an import."""
    call = ex.trip("3", "two", food=True)
    assert cache.generate(call, mode="baseline", max_new_tokens=1).prompt_token_ids
    ref = cache.generate(call, mode="reference", max_new_tokens=4)
    got = cache.generate(call, mode="cached", max_new_tokens=4)
    assert got.token_ids == ref.token_ids and got.computed_tokens >= 1


def test_changed_constant_is_refused_at_call_time():
    docs = ["A first document.", "A second document."]
    globals()["_MUTABLE_DOCS"] = docs

    @program
    def over(question: ex.Question) -> str:
        p = "Docs:"
        for doc in _MUTABLE_DOCS:  # noqa: F821  (set above)
            p += "\n" + doc
        p += "\nQ: " + question
        return p

    assert over("Q?").prompt
    docs.append("A third document.")
    with pytest.raises(ProgramError, match="'_MUTABLE_DOCS' changed after"):
        over("Q?")


def test_stable_names_follow_the_content():
    assert ex.flag.schema_name == Program(ex.flag.function).schema_name
    assert ex.flag.schema_name != ex.tone.schema_name
    assert program(name="helper")(ex.flag.function).schema_name.startswith("helper-")
