"""The README's PML examples parse and run (cached equals the oracle) as written."""

import re
from pathlib import Path


from pckernels.engine import PromptCache
from test_engine import tiny_llama, tokenizer  # noqa: F401  (tokenizer is a fixture)

README = (Path(__file__).parent.parent / "README.md").read_text(encoding="utf-8")


def test_readme_pml_examples_run(tmp_path, tokenizer):
    schema_text, prompt_text = re.findall(r"```xml\n(.*?)```", README, re.S)[:2]
    (tmp_path / "manual.txt").write_text("The manual says: press the red button twice.")
    (tmp_path / "travel.xml").write_text(schema_text)
    model = tiny_llama(len(tokenizer))
    exact = PromptCache(model, tokenizer, placement="schema")
    exact.add_schema(tmp_path / "travel.xml")
    ref = exact.generate(prompt_text, mode="reference", max_new_tokens=4)
    got = exact.generate(prompt_text, max_new_tokens=4)
    assert got.token_ids == ref.token_ids
    assert (got.first_logits - ref.first_logits).abs().max().item() <= 1e-3
    default = PromptCache(model, tokenizer)
    default.add_schema(tmp_path / "travel.xml")
    assert default.resolve(prompt_text).placement == "compact"
    spelled = default.generate(prompt_text, max_new_tokens=4, recompute=8, recompute_policy="epic")
    assert default.generate(prompt_text, max_new_tokens=4).token_ids == spelled.token_ids


def test_readme_tour_prompts_parse(tokenizer):
    tour = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    schema_text = re.search(r'cache.add_schema\("""(.*?)"""\)', tour, re.S).group(1)
    prompts = re.findall(r"'(<prompt.*?)'\s*(?:'(.*?)')?\s*(?:,|\))", tour, re.S)
    cache = PromptCache(tiny_llama(len(tokenizer)), tokenizer)
    cache.add_schema(schema_text)
    assert prompts
    for head, tail in prompts:
        assert cache.generate(head + tail, max_new_tokens=2).computed_tokens > 0
