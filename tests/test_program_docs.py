"""The examples in docs/program.md run as documented (with a tiny random model in place of
SmolLM2) and print the PML shown there."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

from test_engine import tiny_llama, tokenizer  # noqa: F401  (tokenizer is a fixture)

from pckernels.engine import PromptCache

DOC = (Path(__file__).resolve().parent.parent / "docs" / "program.md").read_text(encoding="utf-8")
LOAD = 'cache = PromptCache.from_pretrained("smollm2")'


def test_program_doc_examples_run_and_print_the_documented_pml(tmp_path, tokenizer):
    blocks = re.findall(r"```python\n(.*?)```", DOC, re.DOTALL)
    assert len(blocks) == 4 and LOAD in blocks[0]
    path = tmp_path / "doc_program.py"
    path.write_text("\n\n".join(blocks).replace(LOAD, "cache = CACHE"), encoding="utf-8")
    spec = importlib.util.spec_from_file_location("doc_program", path)
    module = importlib.util.module_from_spec(spec)
    module.CACHE = PromptCache(tiny_llama(len(tokenizer)), tokenizer)
    sys.modules["doc_program"] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules["doc_program"]
    xml = re.findall(r"```xml\n(.*?)\n```", DOC, re.DOTALL)
    rag_call = module.rag(frozenset(module.PASSAGES[:2]), "How tall is the Eiffel Tower?")
    persona_call = module.persona("Ada", module.Age.SENIOR, "seaside", True, "Introduce yourself.")
    assert xml == [module.rag.schema, rag_call.prompt, persona_call.prompt]
    assert module.first.token_ids and module.reply.token_ids
    inline = re.search(r"gives `(some system message.*?)` with", DOC, re.DOTALL).group(1)
    assert re.sub(r"\n *", "", module.test_prompt.schema).find(
        inline.replace("\n", " ").split("…")[0]) > 0
