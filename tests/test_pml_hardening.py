"""Hostile or unusual input is refused early, with bounded work and memory, and always as a
located PMLError (found by adversarial testing, issue 15)."""

from __future__ import annotations

import time
import tracemalloc

import pytest

from pckernels.pml import PMLError, parse_prompt, parse_schema
from pml_tokenizers import byte_tokenizer

TOK = byte_tokenizer()


class CountingTokenizer:
    """Wraps a tokenizer and counts the characters it is asked to encode."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.chars = 0

    def __call__(self, texts, **kwargs):
        self.chars += sum(map(len, texts)) if isinstance(texts, list) else len(texts)
        return self._inner(texts, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def refused(text, tokenizer=TOK, **kwargs) -> PMLError:
    with pytest.raises(PMLError) as info:
        parse_schema(text, tokenizer, **kwargs)
    assert info.value.line is not None and info.value.column is not None, info.value
    return info.value


def peak_mib(call) -> float:
    tracemalloc.start()
    try:
        call()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak / 2**20


HUGE_UNION = ('<schema name="s"><union>' + "".join(
    f'<module name="m{i}"><param name="p" len="4194304"/></module>' for i in range(4))
    + "</union></schema>")


def test_huge_param_lengths_are_refused_before_the_layout_allocates():
    assert len(HUGE_UNION.encode()) < 300
    errors = []
    assert peak_mib(lambda: errors.append(refused(HUGE_UNION, max_positions=8192))) < 16
    assert "len=4194304 on parameter 'p' is past the model's limit of 8192 positions" in \
        errors[0].message
    assert (errors[0].line, errors[0].column) == (1, 43)
    errors.clear()
    assert peak_mib(lambda: errors.append(refused(HUGE_UNION))) < 16
    assert "reserve 8388608 positions in all, more than 4194304 (Limits.max_positions)" in \
        errors[0].message


def test_len_with_thousands_of_digits_is_a_located_error():
    error = refused('<schema name="s"><module name="m"><param name="p" len="' + "9" * 5000
                    + '"/></module></schema>')
    assert "(5000 digits) on parameter 'p' is past the limit of" in error.message
    assert "len=007" not in refused('<schema name="s"><module name="m">x<param name="p" '
                                    'len="007"/></module></schema>', max_positions=5).message


def test_schema_past_the_position_limit_is_refused_without_tokenizing_all_of_it():
    modules = "".join(f'<module name="m{i}">{i}' + " word" * 800 + "</module>" for i in range(1000))
    text = f'<schema name="s">{modules}</schema>'
    counting = CountingTokenizer(TOK)
    error = refused(text, counting, max_positions=8192)
    assert "does not fit: module 'm2' ends at position" in error.message
    assert "the model's limit of 8192 positions" in error.message
    assert counting.chars < len(text) / 2


def test_one_huge_text_is_refused_from_a_prefix():
    text = '<schema name="s">\n<module name="doc">' + "word " * 250_000 + "</module></schema>"
    counting = CountingTokenizer(TOK)
    error = refused(text, counting, max_positions=8192)
    assert "module 'doc' ends past position" in error.message
    assert (error.line, error.column) == (2, 1)
    assert counting.chars < len(text) / 4
    counting = CountingTokenizer(TOK)
    assert parse_schema(text, counting).length == 1_250_000 - 1


def best_of_two(call) -> float:
    times = []
    for _ in range(2):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def test_comments_and_role_tags_cost_linear_time():
    n = 120_000
    plain = '<schema name="s"><module name="m">' + "word " * n + "</module></schema>"
    comments = '<schema name="s"><module name="m">' + "word <!---->" * n + "</module></schema>"
    base = best_of_two(lambda: parse_schema(plain, TOK))
    assert best_of_two(lambda: parse_schema(comments, TOK)) < 2.5 * base + 0.2
    roles = '<schema name="s"><module name="m">' + "<user>w</user>" * (n // 4) + \
        "</module></schema>"
    assert best_of_two(lambda: parse_schema(roles, TOK)) < 2.5 * base + 0.2
    prompt = '<prompt schema="s">' + "word <!---->" * n + "</prompt>"
    schema = parse_schema('<schema name="s">x</schema>', TOK)
    assert best_of_two(lambda: parse_prompt(prompt, schema)) < 2.5 * base + 0.2


@pytest.mark.parametrize("src", ["a" * 300, "a/" * 3000 + "b"])
def test_src_names_the_os_refuses_are_located_errors(tmp_path, src):
    error = refused(f'<schema name="s">\n  <module name="m" src="{src}"/></schema>',
                    base_dir=tmp_path)
    assert (error.line, error.column) == (2, 3)
    assert "cannot be read: File name too long" in error.message
    assert "characters)" in error.message and len(error.message) < 300


def test_latin1_schema_is_a_located_error():
    error = refused('<schema name="s">\n  <module name="m">café</module></schema>'
                    .encode("latin-1"))
    assert "not valid UTF-8" in error.message and "save the file as UTF-8" in error.message
    assert (error.line, error.column) == (2, 23)


def test_latin1_schema_file_through_the_engine_is_a_located_error(tmp_path):
    from pckernels.engine.namespaces import read_source

    path = tmp_path / "s.xml"
    path.write_bytes('<schema name="s">\n<module name="m">é</module></schema>'.encode("latin-1"))
    text, base_dir = read_source(path)
    assert base_dir == tmp_path.resolve()
    error = refused(text)
    assert (error.line, error.column) == (2, 18)


def test_scaffold_member_with_nested_modules_is_a_located_schema_error():
    error = refused('<schema name="s"><scaffold name="f">\n<module name="a">a'
                    '<module name="b">b</module></module></scaffold></schema>')
    assert "scaffold 'f': member 'a' contains nested modules" in error.message
    assert (error.line, error.column) == (2, 1)
