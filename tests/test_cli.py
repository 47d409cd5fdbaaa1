"""The command line on bad input and on text that looks like rich markup.

Bad ``--dtype``, ``--device`` and ``--model`` end every command that takes them with one line on
stderr and exit status 2, before any model is loaded (the engine refuses them the same way).
Paths, file metadata and model output that contain ``[/x]`` are printed as they are (rich would
read them as a closing tag and crash).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors import SafetensorError
from typer.testing import CliRunner

from pckernels.cli import app
from pckernels.engine import PromptCache
from pckernels.store import BlockKey, DiskTier
from pckernels.store import disk as disk_module
from test_engine import SCHEMA, tiny_llama, tokenizer  # noqa: F401  (tokenizer is a fixture)

MARKUP = "[/x]"
ANSWER = "an answer with [/x] and [bold] in it"


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    """A tiny Llama saved under a path with ``[/x]`` in it."""
    path = tmp_path_factory.mktemp("models") / "tiny[" / "x]llama"
    tiny_llama(len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """``$PROMPTCACHE_CACHE_DIR`` (where ``run`` and ``demo`` keep blocks) with ``[/x]`` in its path."""
    path = tmp_path / "cache[" / "x]dir"
    monkeypatch.setenv("PROMPTCACHE_CACHE_DIR", str(path))
    return path


@pytest.fixture
def markup_answers(monkeypatch):
    """Every generated text contains markup-like brackets."""
    generate = PromptCache.generate

    def bracketed(self, *args, **kwargs):
        return dataclasses.replace(generate(self, *args, **kwargs), text=ANSWER)

    monkeypatch.setattr(PromptCache, "generate", bracketed)


def assert_one_line_error(result, *words: str, after_loading: bool = False) -> None:
    """Exit status 2 and one ``error:`` line, all the output unless a model was loaded first
    (whose loading progress bars come before it)."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit), result.exception
    lines = result.output.strip().splitlines()
    assert (after_loading or len(lines) == 1) and lines[-1].startswith("error: "), result.output
    for word in words:
        assert word in lines[-1], result.output


def command_lines(tmp_path, option: str, value: str) -> list[list[str]]:
    """Every command taking ``option``, with valid arguments otherwise."""
    schema = tmp_path / "schema.xml"
    schema.write_text(SCHEMA, encoding="utf-8")
    prompt = '<prompt schema="guide"><user>Hi</user><assistant/></prompt>'
    lines = [["run", str(schema), prompt, option, value], ["demo", option, value],
             ["encode", str(schema), "--store-dir", str(tmp_path / "kv"), option, value],
             ["bench", "--no-progress", "--out", str(tmp_path / "bench"), option, value]]
    if option == "--model":
        lines.append(["eval", "--out", str(tmp_path / "eval"), option, value])
    return lines


@pytest.mark.parametrize("option, value, words", [
    ("--dtype", "bogus", ("unknown dtype 'bogus'", "float32")),
    ("--dtype", "int8", ("unknown dtype 'int8'",)),
    ("--device", "bogus", ("unknown device 'bogus'",)),
    ("--device", "cuda:99", ("device 'cuda:99' is not available",)),
    ("--model", "MISSING", ("no such model directory",)),
    ("--model", "MISSING/deeper/model", ("no such model directory",)),
])
def test_bad_model_options_end_every_command_with_one_line(tmp_path, cache_dir, option, value, words):
    if value.startswith("MISSING"):
        value = str(tmp_path / value)
    for line in command_lines(tmp_path, option, value):
        result = CliRunner().invoke(app, line)
        assert_one_line_error(result, *words)
    assert not (tmp_path / "kv").exists() and not cache_dir.exists()


def test_bad_placement_ends_every_command_that_takes_it_with_one_line(tmp_path, cache_dir):
    """``--placement`` (run, demo, encode, serve) is checked before any model is loaded."""
    schema = tmp_path / "schema.xml"
    schema.write_text(SCHEMA, encoding="utf-8")
    prompt = '<prompt schema="guide"><user>Hi</user><assistant/></prompt>'
    for line in (["run", str(schema), prompt], ["demo"], ["encode", str(schema), "--store-dir", str(tmp_path / "kv")],
                 ["serve", "--port", "1"]):
        result = CliRunner().invoke(app, [*line, "--placement", "paper"])
        assert_one_line_error(result, "unknown --placement 'paper'", "compact or schema")
    assert not (tmp_path / "kv").exists() and not cache_dir.exists()


def test_model_path_that_is_a_file_is_refused(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    assert_one_line_error(CliRunner().invoke(app, ["demo", "--model", str(weights)]), "is a file")


def test_missing_schema_and_bad_mode_are_refused_before_loading(tmp_path):
    missing = str(tmp_path / f"schema{MARKUP}.xml")
    assert_one_line_error(CliRunner().invoke(app, ["run", missing, "<prompt/>", "--model", "/nowhere"]),
                          "no such model directory")
    assert_one_line_error(CliRunner().invoke(app, ["run", missing, "<prompt/>"]), "no such schema file", MARKUP)
    assert_one_line_error(CliRunner().invoke(app, ["encode", missing]), "no such schema file", MARKUP)
    assert_one_line_error(CliRunner().invoke(app, ["run", missing, "<prompt/>", "--mode", "fast"]), "unknown mode")


def test_store_dir_that_is_a_file_is_refused_by_encode(tmp_path):
    schema = tmp_path / "schema.xml"
    schema.write_text(SCHEMA, encoding="utf-8")
    store = tmp_path / f"kv{MARKUP}"
    store.parent.mkdir()
    store.write_text("a file")
    assert_one_line_error(CliRunner().invoke(app, ["encode", str(schema), "--store-dir", str(store)]),
                          "is a file", MARKUP)


def test_run_prints_paths_and_answers_with_brackets(model_dir, cache_dir, tmp_path, markup_answers):
    schema = tmp_path / "schema[" / "x]guide.xml"
    schema.parent.mkdir()
    schema.write_text(SCHEMA, encoding="utf-8")
    prompt = '<prompt schema="guide"><paris/><user>How tall?</user><assistant/></prompt>'
    common = ["--model", str(model_dir), "--device", "cpu", "--dtype", "float32", "--max-new-tokens", "2"]
    result = CliRunner().invoke(app, ["run", str(schema), prompt, "--mode", "compare", *common])
    assert result.exit_code == 0, result.output
    assert result.output.count(ANSWER) == 3
    ahead = CliRunner().invoke(app, ["run", str(schema), prompt, "--mode", "compare", "--lookahead", "3", *common])
    assert ahead.exit_code == 0 and ahead.output.count(ANSWER) == 3, ahead.output
    assert CliRunner().invoke(app, ["run", str(schema), prompt, "--lookahead", "-1", *common]).exit_code == 2
    bad_prompt = '<prompt schema="guide"><nowhere/></prompt>'
    result = CliRunner().invoke(app, ["run", str(schema), bad_prompt, *common])
    assert_one_line_error(result, "unknown module 'nowhere'", after_loading=True)


def test_demo_prints_model_path_and_answers_with_brackets(model_dir, cache_dir, markup_answers):
    result = CliRunner().invoke(app, ["demo", "--model", str(model_dir), "--device", "cpu", "--max-new-tokens", "1"])
    assert result.exit_code == 0, result.output
    assert "x]llama" in result.output and result.output.count(ANSWER) >= 2


def test_cache_commands_print_paths_and_metadata_with_brackets(tmp_path):
    store = tmp_path / "kv[" / "x]store"
    disk = DiskTier(store, budget=1 << 20)
    key = BlockKey("ab" * 32, model=f"model{MARKUP}", schema=f"s{MARKUP}", module=f"m{MARKUP}", tokens=1)
    assert disk.write(key, torch.zeros(1, 2, 1, 1, 4))
    runner = CliRunner()
    listing = runner.invoke(app, ["cache", "ls", "--store-dir", str(store)])
    assert listing.exit_code == 0, listing.output
    assert f"model{MARKUP}" in listing.output and f"m{MARKUP}" in listing.output and "x]store" in listing.output
    usage = runner.invoke(app, ["cache", "du", "--store-dir", str(store)])
    assert usage.exit_code == 0, usage.output
    assert f"model{MARKUP}" in usage.output and "x]store" in usage.output
    disk.path(key.digest).write_bytes(b"[/x] not a block")
    listing = runner.invoke(app, ["cache", "ls", "--store-dir", str(store)])
    assert listing.exit_code == 0 and "unreadable" in listing.output, listing.output
    cleared = runner.invoke(app, ["cache", "clear", "--store-dir", str(store), "--yes"])
    assert cleared.exit_code == 0 and "removed 1 block files" in cleared.output and "x]store" in cleared.output


@pytest.mark.parametrize("options, error, words", [
    ({"dtype": "bogus"}, ValueError, "unknown dtype 'bogus'"),
    ({"dtype": torch.int8}, ValueError, "unknown dtype 'torch.int8'"),
    ({"device": "bogus"}, ValueError, "unknown device 'bogus'"),
    ({"device": "cuda:99"}, ValueError, "is not available"),
])
def test_engine_refuses_bad_device_and_dtype_before_touching_the_model(tokenizer, options, error, words):
    model = tiny_llama(len(tokenizer))
    with pytest.raises(error, match=words):
        PromptCache(model, tokenizer, **options)
    with pytest.raises(error, match=words):
        PromptCache.from_pretrained("smollm2", store_dir=False, **options)
    assert next(model.parameters()).dtype == torch.float32


def test_from_pretrained_refuses_a_missing_model_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such model directory"):
        PromptCache.from_pretrained(str(tmp_path / "missing"), store_dir=False)


def test_encode_says_when_nothing_could_be_kept_on_disk(model_dir, tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: File too large (os error 27)")

    monkeypatch.setattr(disk_module, "save_file", full)
    schema = tmp_path / "schema.xml"
    schema.write_text(SCHEMA, encoding="utf-8")
    result = CliRunner().invoke(app, ["encode", str(schema), "--model", str(model_dir), "--device", "cpu",
                                      "--store-dir", str(tmp_path / "kv")])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert result.output.strip().splitlines()[-1].startswith("error: nothing kept on disk: cannot write block")
    assert "File too large" in result.output


def test_demo_fails_when_a_cached_answer_differs_from_the_reference(model_dir, cache_dir, monkeypatch):
    """The demo is also CI's smoke test of the first README command: a cached answer that is not
    the reference forward's must end it with status 1, naming the prompt."""
    generate = PromptCache.generate

    def off_by_one(self, prompt, *args, mode="cached", **kwargs):
        result = generate(self, prompt, *args, mode=mode, **kwargs)
        if mode == "cached":
            result = dataclasses.replace(result, token_ids=[t + 1 for t in result.token_ids])
        return result

    monkeypatch.setattr(PromptCache, "generate", off_by_one)
    result = CliRunner().invoke(app, ["demo", "--model", str(model_dir), "--device", "cpu", "--max-new-tokens", "1"])
    assert result.exit_code == 1, result.output
    assert "differ from the reference" in result.output
    monkeypatch.setattr(PromptCache, "generate", generate)
    result = CliRunner().invoke(app, ["demo", "--model", str(model_dir), "--device", "cpu", "--max-new-tokens", "1"])
    assert result.exit_code == 0, result.output


def test_compile_prints_the_schemas_of_a_files_programs(tmp_path):
    import program_examples as ex
    from pckernels.pml import parse_schema
    from pml_tokenizers import byte_tokenizer

    path = ex.__file__
    result = CliRunner().invoke(app, ["compile", path])
    assert result.exit_code == 0, result.output
    for prog in (ex.literal, ex.flag, ex.rag, ex.planner, ex.odd):
        assert prog.schema in result.output
    one = CliRunner().invoke(app, ["compile", f"{path}:rag"])
    assert one.exit_code == 0 and one.output == ex.rag.schema + "\n"
    assert parse_schema(one.output, byte_tokenizer()).name == ex.rag.schema_name


def test_compile_refusals_are_one_located_line(tmp_path):
    bad = tmp_path / "bad[x].py"
    bad.write_text("from pckernels.program import program\n\n@program\ndef p(n: int) -> str:\n"
                   "    s = 'x'\n    while n:\n        s += 'y'\n    return s\n", encoding="utf-8")
    assert_one_line_error(CliRunner().invoke(app, ["compile", str(bad)]), f"{bad}:6:5:", "while loops")
    empty = tmp_path / "empty.py"
    empty.write_text("X = 1\n", encoding="utf-8")
    assert_one_line_error(CliRunner().invoke(app, ["compile", str(empty)]), "defines no prompt programs")
    assert_one_line_error(CliRunner().invoke(app, ["compile", f"{empty}:X"]), "'X'", "is not a prompt program")
    assert_one_line_error(CliRunner().invoke(app, ["compile", str(tmp_path / "none.py")]), "no such file")
    broken = tmp_path / "broken.py"
    broken.write_text("def (:\n", encoding="utf-8")
    assert_one_line_error(CliRunner().invoke(app, ["compile", str(broken)]), "broken.py:1")
