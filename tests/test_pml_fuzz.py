"""Property tests: arbitrary, generated and mutated PML only ever raises PMLError, and
whatever parses satisfies the layout invariants."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pckernels.pml import ROOT, Limits, PMLError, ResolvedPrompt, Schema, parse_prompt, parse_schema
from pml_tokenizers import byte_tokenizer

TOK = byte_tokenizer()
LIMITS = Limits(max_input_bytes=20_000, max_depth=12, max_positions=5_000)
FUZZ = settings(max_examples=150, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])

SEED_SCHEMA = """<schema name="s">
  <system>You are <!-- c --> kind.</system>
  <module name="a">A text <param name="p" len="4" default="d"/> more</module>
  <union name="u"><module name="x">xx</module><module name="y">yyyy</module></union>
  <module name="n">N<module name="c">C<parameter name="q" length="3"/></module>tail</module>
  <scaffold name="f"><module name="f1">F1</module><module name="f2">F2</module></scaffold>
  <user>question <module name="z">Z</module></user><assistant/>
</schema>"""
SCHEMA = parse_schema(SEED_SCHEMA, TOK, limits=LIMITS)
SCHEMAS = {"s": SCHEMA}
SEED_PROMPTS = [
    '<prompt schema="s"><a p="12"/><y/><n><c q="r"/></n><scaffold name="f"/>hi<assistant/></prompt>',
    '<prompt schema="s">pre <x/> mid <module name="n/c"/><user>end</user></prompt>',
]

FRAGMENTS = [
    "<", ">", "/>", "</", "&", "&amp;", "&#0;", "&#x10FFFF;", '"', "'", "=", "<!--", "-->",
    "<![CDATA[", "]]>", "<?pi x?>", "<!DOCTYPE x>", '<!ENTITY e "v">', "&e;", "xml:space",
    '<module name="a">', "</module>", '<module name="a/b"/>', "<union>", "</union>",
    '<scaffold name="f">', "</scaffold>", '<param name="p" len="2"/>', '<param name="p" len="0"/>',
    '<parameter name="q" length="x"/>', "<system>", "</system>", "<user>", "</user>",
    "<assistant/>", "<a/>", "<x/>", "<y/>", '<a p="toolong"/>', "<n><c/></n>", " ", "\n",
    "\t", "é", "\u2028", "\ufeff", "\x00", "\x1b", "\ud7ff", "😀", "text", "<schema", "<prompt",
]

names = st.sampled_from(["a", "b", "c", "x", "a/b", "", "1", "é", "a b", "_p", "@u"])
texts = st.text(alphabet=st.sampled_from(list("ab <>&\"'\n\té=/")), max_size=12)


@st.composite
def mutated(draw, seeds: list[str]) -> str:
    text = draw(st.sampled_from(seeds))
    for _ in range(draw(st.integers(1, 4))):
        position = draw(st.integers(0, len(text)))
        kind = draw(st.sampled_from(["insert", "delete", "duplicate", "replace"]))
        if kind == "insert":
            text = text[:position] + draw(st.sampled_from(FRAGMENTS)) + text[position:]
        elif kind == "delete":
            end = draw(st.integers(position, min(len(text), position + 20)))
            text = text[:position] + text[end:]
        elif kind == "duplicate":
            end = draw(st.integers(position, min(len(text), position + 40)))
            text = text[:end] + text[position:end] + text[end:]
        else:
            text = text[:position] + draw(st.characters()) + text[position + 1:]
    return text


def _element(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    def attrs(keys):
        return st.lists(st.tuples(st.sampled_from(keys), texts | names), max_size=3).map(
            lambda pairs: "".join(f' {k}="{v}"' for k, v in dict(pairs).items()))

    body = st.lists(children | texts, max_size=4).map("".join)
    tagged = st.tuples(st.sampled_from(["module", "union", "scaffold", "system", "user",
                                        "assistant", "param", "parameter", "a", "x"]),
                       attrs(["name", "len", "length", "default", "scaffold", "src", "p"]), body)
    return tagged.map(lambda t: f"<{t[0]}{t[1]}>{t[2]}</{t[0]}>" if t[2] else f"<{t[0]}{t[1]}/>")


generated_body = st.recursive(texts, _element, max_leaves=12)


def check_schema(schema: Schema) -> None:
    modules = schema.modules
    assert next(iter(modules)) == ROOT
    for module in modules.values():
        assert len(module.token_ids) == len(module.position_ids)
        assert all(module.start <= p < module.start + module.length for p in module.position_ids)
        assert module.start + module.length <= schema.length
        for child in module.children:
            c = modules[child]
            assert module.start <= c.start and c.start + c.length <= module.start + module.length
        for param in module.params:
            slot = module.position_ids[param.offset:param.offset + param.length]
            assert slot == tuple(range(param.start, param.start + param.length))
            assert len(param.default) <= param.length
    for members in schema.unions.values():
        assert len({modules[m].start for m in members}) == 1


def check_prompt(prompt: ResolvedPrompt) -> None:
    keys = [(s.position_ids[0], s.kind == "argument") for s in prompt.segments]
    assert keys == sorted(keys)
    taken = [p for s in prompt.segments if s.kind != "argument" for p in s.position_ids]
    assert len(taken) == len(set(taken))
    assert prompt.modules[0] == ROOT


def _parse_schema(text: str) -> None:
    try:
        schema = parse_schema(text, TOK, limits=LIMITS)
    except PMLError as error:
        assert error.message
        return
    check_schema(schema)


def _parse_prompt(text: str) -> None:
    try:
        prompt = parse_prompt(text, SCHEMAS, limits=LIMITS)
    except PMLError as error:
        assert error.message
        return
    check_prompt(prompt)


@FUZZ
@given(st.text(max_size=200))
def test_arbitrary_text(text):
    _parse_schema(text)
    _parse_prompt(text)


@FUZZ
@given(mutated([SEED_SCHEMA]))
def test_mutated_schemas(text):
    _parse_schema(text)


@FUZZ
@given(mutated(SEED_PROMPTS))
def test_mutated_prompts(text):
    _parse_prompt(text)


@FUZZ
@given(generated_body)
def test_generated_schemas(body):
    _parse_schema(f'<schema name="g">{body}</schema>')


@FUZZ
@given(generated_body)
def test_generated_prompts(body):
    _parse_prompt(f'<prompt schema="s">{body}</prompt>')


@FUZZ
@given(st.binary(max_size=200))
def test_arbitrary_bytes(data):
    _parse_schema(data)
    _parse_prompt(data)
