"""``promptcache encode`` and ``promptcache cache ls | du | clear`` on a tiny local model."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from pckernels.cli import app
from pckernels.store import list_blocks
from test_engine import SCHEMA, tiny_llama, tokenizer  # noqa: F401  (tokenizer is a fixture)


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_encode_then_list_measure_and_clear(model_dir, tmp_path):
    schema = tmp_path / "guide.xml"
    schema.write_text(SCHEMA, encoding="utf-8")
    store = tmp_path / "kv"
    runner = CliRunner()
    common = ["--model", str(model_dir), "--store-dir", str(store), "--device", "cpu", "--dtype", "float32"]
    first = runner.invoke(app, ["encode", str(schema), *common])
    assert first.exit_code == 0, first.output
    blocks = len(list_blocks(store))
    assert blocks > 0 and f"{blocks} encoded" in first.output
    again = runner.invoke(app, ["encode", str(schema), *common])
    assert again.exit_code == 0 and "0 encoded" in again.output and f"{blocks} already on disk" in again.output
    listing = runner.invoke(app, ["cache", "ls", "--store-dir", str(store)])
    assert listing.exit_code == 0 and "paris" in listing.output and f"{blocks} blocks" in listing.output
    usage = runner.invoke(app, ["cache", "du", "--store-dir", str(store)])
    assert usage.exit_code == 0 and "total" in usage.output
    cleared = runner.invoke(app, ["cache", "clear", "--store-dir", str(store), "--yes"])
    assert cleared.exit_code == 0 and f"removed {blocks}" in cleared.output
    assert list_blocks(store) == []


def test_encode_reports_a_bad_schema(model_dir, tmp_path):
    bad = tmp_path / "bad.xml"
    bad.write_text("<schema name='x'><module></schema>", encoding="utf-8")
    result = CliRunner().invoke(app, ["encode", str(bad), "--model", str(model_dir), "--store-dir",
                                      str(tmp_path / "kv"), "--device", "cpu"])
    assert result.exit_code == 2 and "error" in result.output
