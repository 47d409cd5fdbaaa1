"""Engine exactness: cached mode against the module-masked reference forward (the oracle).

A tiny random Llama (GQA) with the embedded SmolLM2 tokenizer; exactness needs no trained weights.
Tolerances: fp32 first-logits max-abs <= 1e-3 and identical greedy tokens; bf16 max-abs <= 0.1
(logits of these random models are O(1); bf16 keeps 8 bits of mantissa).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from pckernels import PMLError
from pckernels.engine import PromptCache

FP32_TOL = 1e-3
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def tokenizer():
    from pckernels.integration.embedded import load_tokenizer

    return load_tokenizer()


def tiny_llama(vocab_size: int, *, seed: int = 0, layers: int = 2, dtype=torch.float32, **overrides):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=vocab_size, hidden_size=48, intermediate_size=96, num_hidden_layers=layers,
               num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=2048, rope_theta=10000.0,
               tie_word_embeddings=True)
    cfg.update(overrides)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**cfg))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.to(dtype).eval()


@pytest.fixture(scope="module")
def cache(tokenizer):
    return PromptCache(tiny_llama(len(tokenizer)), tokenizer, placement="schema")


SCHEMA = """
<schema name="guide">
  <system>You answer questions about the documents.</system>
  <module name="intro">Welcome to the guide. It covers three cities.</module>
  <union name="city">
    <module name="paris">Paris is the capital of France. The Eiffel Tower is 330 metres tall.</module>
    <module name="tokyo">Tokyo is the capital of Japan. The Skytree is 634 metres tall and opened in 2012.</module>
  </union>
  <module name="plan">Plan a trip of <param name="duration" len="5"/> days for <param name="who" len="4"/> people.
    <module name="budget">Keep the budget under <param name="amount" len="3"/> euros.</module>
    <module name="food">Include local food.</module>
  </module>
  <scaffold name="pair">
    <module name="fact-a">The red door opens on Mondays.</module>
    <module name="fact-b">The blue door opens when the red one is closed.</module>
  </scaffold>
</schema>
"""

PROMPTS = {
    "all-of-union-one": '<prompt schema="guide"><intro/><paris/><user>How tall is the tower?</user><assistant/></prompt>',
    "other-member": '<prompt schema="guide"><tokyo/><user>When did it open?</user><assistant/></prompt>',
    "none": '<prompt schema="guide"><user>Say hello.</user><assistant/></prompt>',
    "params-short": '<prompt schema="guide"><plan duration="3" who="two"/><user>Go.</user><assistant/></prompt>',
    "params-missing": '<prompt schema="guide"><plan duration="ten"/><user>Go.</user><assistant/></prompt>',
    "nested": '<prompt schema="guide"><plan duration="4" who="five"><budget amount="900"/><food/></plan>'
              '<user>Plan it.</user><assistant/></prompt>',
    "nested-some": '<prompt schema="guide"><intro/><plan duration="2" who="1"><food/></plan>'
                   '<user>And food?</user><assistant/></prompt>',
    "scaffold-all": '<prompt schema="guide"><fact-a/><fact-b/><user>When does the blue door open?</user>'
                    '<assistant/></prompt>',
    "scaffold-by-name": '<prompt schema="guide"><pair/><user>Which door?</user><assistant/></prompt>',
    "scaffold-part": '<prompt schema="guide"><fact-b/><user>Which door?</user><assistant/></prompt>',
    "everything": '<prompt schema="guide"><intro/><tokyo/><plan duration="7" who="2"><budget amount="50"/>'
                  '<food/></plan><fact-a/><fact-b/><user>Summarise.</user><assistant/></prompt>',
    "text-only": '<prompt schema="guide">Just some trailing text without roles.</prompt>',
}


@pytest.fixture(scope="module")
def schema(cache):
    return cache.add_schema(SCHEMA)


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_cached_matches_reference(cache, schema, name):
    ref = cache.generate(PROMPTS[name], mode="reference", max_new_tokens=NEW_TOKENS)
    got = cache.generate(PROMPTS[name], mode="cached", max_new_tokens=NEW_TOKENS)
    assert got.prompt_token_ids == ref.prompt_token_ids
    assert got.positions == ref.positions
    assert (got.first_logits - ref.first_logits).abs().max().item() <= FP32_TOL
    assert got.token_ids == ref.token_ids
    assert got.cached_tokens + got.computed_tokens <= len(got.prompt_token_ids)
    assert got.first_logits.dtype == torch.float32 and got.first_logits.shape == (len(cache.tokenizer),)


SHUFFLED = {
    # Imports out of schema order (the paper's §3.4: positions come from the schema) -> the same
    # prompt in schema order when there is one.
    "everything": '<prompt schema="guide"><fact-b/><plan duration="7" who="2"><food/><budget amount="50"/></plan>'
                  '<tokyo/><fact-a/><intro/><user>Summarise.</user><assistant/></prompt>',
    "nested-some": '<prompt schema="guide"><plan duration="2" who="1"><food/></plan><intro/>'
                   '<user>And food?</user><assistant/></prompt>',
    "scaffold-all": '<prompt schema="guide"><fact-b/><fact-a/><user>When does the blue door open?</user>'
                    '<assistant/></prompt>',
    "text-between": '<prompt schema="guide"><fact-b/><tokyo/><plan duration="3" who="two"><food/></plan> Facts follow.'
                    '<module name="intro"/><user>Go.</user><assistant/></prompt>',
    "scaffold-then-union": '<prompt schema="guide"><pair/><paris/><intro/><user>Which door?</user><assistant/></prompt>',
}


@pytest.mark.parametrize("name", sorted(SHUFFLED))
def test_imports_in_any_order_cached_matches_reference(cache, schema, name):
    ref = cache.generate(SHUFFLED[name], mode="reference", max_new_tokens=NEW_TOKENS)
    got = cache.generate(SHUFFLED[name], mode="cached", max_new_tokens=NEW_TOKENS)
    assert got.prompt_token_ids == ref.prompt_token_ids and got.positions == ref.positions
    assert (got.first_logits - ref.first_logits).abs().max().item() <= FP32_TOL
    assert got.token_ids == ref.token_ids
    if name in PROMPTS:
        ordered = cache.generate(PROMPTS[name], mode="cached", max_new_tokens=NEW_TOKENS)
        assert got.prompt_token_ids == ordered.prompt_token_ids and got.positions == ordered.positions
        assert torch.equal(got.first_logits, ordered.first_logits) and got.token_ids == ordered.token_ids


def test_importing_a_module_twice_is_refused(cache, schema):
    with pytest.raises(PMLError, match="module 'intro' is imported twice") as info:
        cache.generate('<prompt schema="guide"><intro/><paris/><intro/><user>Hi</user></prompt>')
    assert (info.value.line, info.value.column) == (1, 40)


def test_cached_counts_tokens(cache, schema):
    got = cache.generate(PROMPTS["params-short"], max_new_tokens=1)
    plan = schema.modules["plan"]
    slot_len = sum(p.length for p in plan.params)
    cached = len(schema.modules[""].token_ids) + len(plan.token_ids) - slot_len
    assert got.cached_tokens == cached
    assert got.cached_tokens + got.computed_tokens == len(got.prompt_token_ids)


def test_masking_is_in_effect(cache, schema):
    """Baseline (plain causal attention, contiguous positions) must differ from cached mode
    when modules are imported: proves the module mask and schema positions are applied."""
    base = cache.generate(PROMPTS["everything"], mode="baseline", max_new_tokens=1)
    got = cache.generate(PROMPTS["everything"], mode="cached", max_new_tokens=1)
    assert base.prompt_token_ids == got.prompt_token_ids
    assert base.positions == list(range(len(base.prompt_token_ids)))
    assert (base.first_logits - got.first_logits).abs().max().item() > 1e-2


def test_text_only_prompt_equals_baseline_suffix_positions(cache, schema):
    got = cache.generate(PROMPTS["text-only"], max_new_tokens=2)
    assert got.positions[-1] == schema.length + got.computed_tokens - 1


def test_arena_is_reused_and_blocks_stay_resident(cache, schema):
    """Requests one after another reuse the arena's rows; a block already resident is not copied again."""
    cache.generate(PROMPTS["everything"], max_new_tokens=4)
    arena = cache.scheduler.arena
    ptr, growths = arena.data.data_ptr(), arena.growths
    placed = cache.scheduler.counters["blocks_placed"]
    for _ in range(2):
        cache.generate(PROMPTS["everything"], max_new_tokens=4)
    assert cache.scheduler.counters["blocks_placed"] == placed
    for name in ("none", "nested", "all-of-union-one"):
        cache.generate(PROMPTS[name], max_new_tokens=4)
    assert arena.data.data_ptr() == ptr and arena.growths == growths
    assert arena.referenced_rows() == 0


def test_poisoned_rows_never_reach_output(cache, schema):
    """Every arena row a request reads was written for it: with every free row poisoned (finite,
    so masked rows still contribute exactly nothing) the answer is bitwise the clean one."""
    arena = cache.scheduler.arena
    arena.drop_idle()
    clean = cache.generate(PROMPTS["nested"], max_new_tokens=NEW_TOKENS)
    arena.drop_idle()
    arena.poison_()
    got = cache.generate(PROMPTS["nested"], max_new_tokens=NEW_TOKENS)
    assert torch.isfinite(got.first_logits).all()
    assert got.token_ids == clean.token_ids
    assert torch.equal(got.first_logits, clean.first_logits)
    assert (arena.data[:, :, :, arena.capacity - 1] == 1e3).all()


def test_same_schema_is_not_reencoded(cache, schema):
    blocks = len(cache.store)
    again = cache.add_schema(SCHEMA)
    assert again is schema
    assert len(cache.store) == blocks


def test_blocks_keep_real_kv_heads(cache, schema):
    cfg = cache.model.config
    for key in cache.store.keys():
        block = cache.store.get(key)
        assert block.shape[:3] == (cfg.num_hidden_layers, 2, cfg.num_key_value_heads)
        assert block.dtype == torch.float32


@pytest.mark.parametrize("bad, match", [
    ('<prompt schema="nope"><user>hi</user></prompt>', "nope"),
    ('<prompt schema="guide"><paris/><tokyo/><user>hi</user></prompt>', "union"),
    ('<prompt schema="guide"><plan duration="one two three four five six seven eight nine ten"/></prompt>',
     "duration"),
    ('<prompt schema="guide"><parris/><user>hi</user></prompt>', "paris"),
    ('<prompt schema="guide"><user>unclosed</prompt>', "line 1"),
])
def test_bad_prompt_raises_and_cache_stays_usable(cache, schema, bad, match):
    before = cache.generate(PROMPTS["nested"], max_new_tokens=2)
    with pytest.raises(PMLError, match=match):
        cache.generate(bad)
    after = cache.generate(PROMPTS["nested"], max_new_tokens=2)
    assert after.token_ids == before.token_ids
    assert torch.equal(after.first_logits, before.first_logits)


@pytest.mark.parametrize("content, line, column, match", [
    ('<schema name="bad">\n<module name="m">café</module></schema>'.encode("latin-1"), 2, 21, "not valid UTF-8"),
    (b'<schema name="bad"><scaffold name="f">\n  <module name="a">a<module name="b">b</module></module>'
     b"</scaffold></schema>", 2, 3, "member 'a' contains nested modules"),
])
def test_bad_schema_file_is_located_and_changes_nothing(cache, schema, tmp_path, content, line, column, match):
    path = tmp_path / "bad.xml"
    path.write_bytes(content)
    before = (dict(cache.schemas), len(cache.store))
    with pytest.raises(PMLError, match=match) as info:
        cache.add_schema(path)
    assert (info.value.line, info.value.column) == (line, column)
    assert (dict(cache.schemas), len(cache.store)) == before


ENDING_WITH_AN_IMPORT = [
    "<intro/>",
    "<intro/><paris/>",
    "",  # the schema's anonymous text alone
    # The argument is computed, but the module's cached text after it comes last.
    '<user>Plan:</user>\n<plan duration="3" who="two"/>',
    "<tokyo/><pair/>",
]


@pytest.mark.parametrize("placement, body", [*(("schema", b) for b in ENDING_WITH_AN_IMPORT),
                                             *(("compact", b) for b in ENDING_WITH_AN_IMPORT[:3])])
def test_a_prompt_ending_with_an_import_is_answered_exactly(tokenizer, body, placement):
    """The last cached token is computed afresh over every earlier live token (its cached row
    hidden): equal to the reference forward with the same token recomputed, whatever else the
    defaults recompute. Compact prompts only where nothing moved against the anonymous text (the
    reference's limit, ``test_defaults``)."""
    cache = PromptCache(tiny_llama(len(tokenizer)), tokenizer, placement=placement)
    cache.add_schema(SCHEMA)
    text = f'<prompt schema="guide">{body}</prompt>'
    got = cache.generate(text, max_new_tokens=6)
    ref = cache.generate(text, mode="reference", max_new_tokens=6)
    assert got.token_ids == ref.token_ids
    assert torch.isfinite(got.first_logits).all()
    assert (got.first_logits - ref.first_logits).abs().max().item() <= FP32_TOL
    pure = cache.generate(text, max_new_tokens=6, recompute=0)
    assert pure.computed_tokens >= 1 and pure.cached_tokens + pure.computed_tokens <= len(pure.prompt_token_ids)
    assert cache.generate(text, mode="baseline", max_new_tokens=1).token_ids
    cache.close()


def test_streaming_yields_the_generated_text(cache, schema):
    whole = cache.generate(PROMPTS["scaffold-all"], max_new_tokens=8)
    assert "".join(cache.stream(PROMPTS["scaffold-all"], max_new_tokens=8)) == whole.text


def test_streaming_never_emits_the_start_of_a_stop_string(cache, schema):
    whole = cache.generate(PROMPTS["scaffold-all"], max_new_tokens=24)
    assert len(whole.text) > 12
    stop = whole.text[8:12]
    final = cache.generate(PROMPTS["scaffold-all"], max_new_tokens=24, stop=stop).text
    assert len(final) <= 8
    pieces, sent = [], ""
    for piece in cache.stream(PROMPTS["scaffold-all"], max_new_tokens=24, stop=stop):
        sent += piece
        assert final.startswith(sent), (sent, final)
        pieces.append(piece)
    assert sent == final


def test_sampling_is_seeded(cache, schema):
    a = cache.generate(PROMPTS["none"], max_new_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    b = cache.generate(PROMPTS["none"], max_new_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    assert a.token_ids == b.token_ids


def test_bf16_cached_matches_reference(tokenizer):
    pc = PromptCache(tiny_llama(len(tokenizer), seed=1, dtype=torch.bfloat16), tokenizer, placement="schema")
    pc.add_schema(SCHEMA)
    for name in ("everything", "params-short", "scaffold-all"):
        ref = pc.generate(PROMPTS[name], mode="reference", max_new_tokens=1)
        got = pc.generate(PROMPTS[name], mode="cached", max_new_tokens=1)
        assert (got.first_logits - ref.first_logits).abs().max().item() <= 0.1


def test_unsupported_model_is_a_clear_error(tokenizer):
    from transformers import RwkvConfig, RwkvForCausalLM

    from pckernels import UnsupportedModelError

    model = RwkvForCausalLM(RwkvConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, attention_hidden_size=16,
                                       intermediate_size=32, context_length=64))
    with pytest.raises(UnsupportedModelError, match="llama"):
        PromptCache(model, tokenizer, placement="schema")


def test_prompt_filling_max_positions_is_refused(tokenizer):
    """A prompt using the model's last position parses but leaves none to generate at: generate()
    refuses it with the error complete() raises, which is also a PMLError (as every PML rejection)."""
    from pckernels import PromptTooLongError

    pc = PromptCache(tiny_llama(len(tokenizer), max_position_embeddings=64), tokenizer, placement="schema")
    pc.add_schema('<schema name="short"><system>Be brief.</system></schema>')
    prompts = ['<prompt schema="short"><user>' + " a" * k + "</user><assistant/></prompt>" for k in range(64)]
    full = next(p for p in prompts if max(pc.resolve(p).position_ids) == 63)
    for mode in ("cached", "reference", "baseline"):
        with pytest.raises(PromptTooLongError, match="reaches position 63, leaving no room to generate within "
                                                     "the model's 64 positions") as err:
            pc.generate(full, mode=mode)
        assert isinstance(err.value, PMLError)
        assert (err.value.last_position, err.value.limit, err.value.line) == (63, 64, None)


def test_store_dir_false_means_the_same_in_both_constructors(tokenizer, tmp_path, monkeypatch):
    """``store_dir=False``: no disk tier, in ``PromptCache(...)`` as in ``from_pretrained``;
    ``True``: the default directory."""
    model = tiny_llama(len(tokenizer))
    assert PromptCache(model, tokenizer, store_dir=False, placement="schema").store.disk is None
    monkeypatch.setenv("PROMPTCACHE_CACHE_DIR", str(tmp_path))
    assert PromptCache(model, tokenizer, store_dir=True, placement="schema").store.disk is not None


def test_prompt_and_answer_fit_the_models_positions(tokenizer):
    """A 50-token prompt on a 64-position model answers 14 tokens (positions 50 to 63) with
    ``"length"``: prompt and answer together can be sent again; PML prompts and drafts alike."""
    for lookahead in (0, 4):
        pc = PromptCache(tiny_llama(len(tokenizer), max_position_embeddings=64), tokenizer, lookahead=lookahead,
                         placement="schema")
        ids = [(7 * i) % 200 + 3 for i in range(50)]
        no_eos = {t: -100.0 for t in pc.eos_ids}
        result = pc.complete(ids, max_new_tokens=30, logit_bias=no_eos)
        assert len(result.token_ids) == 14 and result.finish_reason == "length"
        pc.add_schema('<schema name="short"><system>Be brief.</system></schema>')
        pml = pc.generate('<prompt schema="short"><user>' + " a" * 40 + "</user><assistant/></prompt>",
                          max_new_tokens=60, logit_bias=no_eos)
        assert max(pml.positions) + 1 + len(pml.token_ids) == 64 and pml.finish_reason == "length"
        pc.close()


@pytest.mark.slow
def test_embedded_model_demo_schema_is_exact():
    from importlib import resources
    import json

    pc = PromptCache.from_pretrained("smollm2", placement="schema")
    demo = resources.files("pckernels") / "data" / "demo"
    with resources.as_file(demo / "city_guide.xml") as path:
        pc.add_schema(path)
    prompts = json.loads((demo / "prompts.json").read_text())
    for item in prompts[:3]:
        ref = pc.generate(item["prompt"], mode="reference", max_new_tokens=12)
        got = pc.generate(item["prompt"], mode="cached", max_new_tokens=12)
        assert got.token_ids == ref.token_ids
        assert (got.first_logits - ref.first_logits).abs().max().item() <= FP32_TOL
        assert got.text.strip()


def test_complete_reuses_prefixes_exactly(cache):
    messages = [{"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": "Name three colours of the rainbow, please."}]
    fresh = cache.complete(messages, max_new_tokens=4, reuse=False)
    first = cache.complete(messages, max_new_tokens=4)
    again = cache.complete(messages, max_new_tokens=4)
    for got in (first, again):
        assert got.token_ids == fresh.token_ids
        assert torch.equal(got.first_logits, fresh.first_logits)
    assert again.cached_tokens > 0
    assert cache.stats()["prefix"]["hit_tokens"] >= again.cached_tokens


def test_modules_read_in_short_runs_match_one_forward(tokenizer):
    """A unit longer than the encoder's ``run_tokens`` is read in runs over the rows before it:
    its blocks equal one forward's to fp32 rounding, and cached answers still match the oracle.
    The buffer is NaN-poisoned first, so a run reading a row not yet written cannot pass."""
    model = tiny_llama(len(tokenizer), seed=3)
    whole = PromptCache(model, tokenizer, placement="schema")
    runs = PromptCache(model, tokenizer, placement="schema")
    runs.encoder.run_tokens = 3
    runs.encoder.buffer.ensure_capacity(256)
    runs.encoder.buffer.poison_()
    a, b = whole.add_schema(SCHEMA), runs.add_schema(SCHEMA)
    units = [(m, "") for m in a.modules] + [("fact-a", "pair"), ("fact-b", "pair")]
    for module, scaffold in units:
        one, split = whole.fetch_block(a, module, scaffold), runs.fetch_block(b, module, scaffold)
        assert one.shape == split.shape and not split.isnan().any()
        assert (one - split).abs().max().item() <= 1e-5, module
    for name in ("everything", "scaffold-all", "nested"):
        ref = runs.generate(PROMPTS[name], mode="reference", max_new_tokens=NEW_TOKENS)
        got = runs.generate(PROMPTS[name], mode="cached", max_new_tokens=NEW_TOKENS)
        assert (got.first_logits - ref.first_logits).abs().max().item() <= FP32_TOL
        assert got.token_ids == ref.token_ids
    whole.close()
    runs.close()
