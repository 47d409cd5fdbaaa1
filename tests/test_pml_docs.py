"""The examples in docs/pml.md work as documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pckernels.pml import PMLError, parse_prompt, parse_schema
from pml_tokenizers import byte_tokenizer

DOC = (Path(__file__).resolve().parent.parent / "docs" / "pml.md").read_text(encoding="utf-8")
XML_BLOCKS = re.findall(r"```xml\n(.*?)```", DOC, re.DOTALL)


def test_every_xml_example_parses(tmp_path):
    (tmp_path / "manual.txt").write_text("Press the red button to start.", encoding="utf-8")
    tokenizer = byte_tokenizer()
    schemas = {}
    prompts = 0
    for block in XML_BLOCKS:
        if block.startswith("<schema"):
            schema = parse_schema(block, tokenizer, base_dir=tmp_path)
            schemas[schema.name] = schema
        else:
            assert block.startswith("<prompt")
            parse_prompt(block, schemas)
            prompts += 1
    assert len(schemas) >= 8 and prompts >= 3


@pytest.mark.slow
def test_documented_errors_are_exact():
    from pckernels.integration.embedded import load_tokenizer

    schema = parse_schema(XML_BLOCKS[0], load_tokenizer())
    block = DOC.split("each prompt is followed by its error:\n\n```text\n")[1].split("```")[0]
    pairs = [pair.split("\n") for pair in block.strip().split("\n\n")]
    assert len(pairs) >= 5
    for prompt, message in pairs:
        with pytest.raises(PMLError) as info:
            parse_prompt(prompt, {"travel": schema})
        assert str(info.value) == message
