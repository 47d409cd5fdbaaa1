"""Salted namespaces (a server's tenants): schemas and prefix blocks of one salt are invisible to,
and never reused by, another; the shared (unsalted) namespace is visible to all; outputs are the
same whatever the salt (bitwise from a clean arena)."""

from __future__ import annotations

import pytest

from pckernels.engine import PromptCache
from pckernels.errors import UnknownSchemaError
from test_engine import PROMPTS, SCHEMA, tiny_llama, tokenizer  # noqa: F401  (tokenizer is a fixture)

PROMPT = PROMPTS["all-of-union-one"]


@pytest.fixture
def pc(tokenizer):
    engine = PromptCache(tiny_llama(len(tokenizer)), tokenizer, store_dir=None, placement="schema")
    yield engine
    engine.close()


def test_a_salted_schema_is_seen_by_its_salt_only(pc):
    pc.add_schema(SCHEMA, salt="a")
    assert "guide" not in pc.schemas
    with pytest.raises(UnknownSchemaError) as err:
        pc.generate(PROMPT, max_new_tokens=2)
    assert err.value.schema == "guide" and err.value.line == 1
    with pytest.raises(UnknownSchemaError):
        pc.submit(pc.request(PROMPT, max_new_tokens=2, salt="b"))
    assert pc.submit(pc.request(PROMPT, max_new_tokens=2, salt="a")).result().cached_tokens > 0


def test_same_text_under_two_salts_shares_no_block_and_answers_the_same(pc):
    a = pc.add_schema(SCHEMA, salt="a")
    encodes = pc.stats()["encodes"]
    b = pc.add_schema(SCHEMA, salt="b")
    assert pc.stats()["encodes"] == 2 * encodes, "the second salt must encode its own blocks"
    assert {pc.block_key(a, m) for m in a.modules}.isdisjoint({pc.block_key(b, m) for m in b.modules})
    pc.evict_resident()
    out_a = pc.submit(pc.request(PROMPT, max_new_tokens=6, salt="a")).result()
    pc.evict_resident()
    out_b = pc.submit(pc.request(PROMPT, max_new_tokens=6, salt="b")).result()
    assert out_a.token_ids == out_b.token_ids
    assert out_a.first_logits.equal(out_b.first_logits)


def test_shared_schemas_are_visible_to_every_salt_and_own_ones_shadow_them(pc):
    pc.add_schema(SCHEMA)
    shadow = SCHEMA.replace("It covers three cities.", "It covers cities.")
    pc.add_schema(shadow, salt="a")
    assert pc.schemas_for("b")["guide"] is pc.schemas["guide"]
    assert pc.schemas_for("a")["guide"].digest != pc.schemas["guide"].digest
    assert pc.remove_schema("guide", salt="a")
    assert not pc.remove_schema("guide", salt="a")
    assert pc.schemas_for("a")["guide"] is pc.schemas["guide"]


def test_prefix_blocks_are_not_reused_across_salts(pc):
    prompt = "The same long document, " * 40
    first = pc.submit(pc.complete_request(prompt, max_new_tokens=3, salt="a")).result()
    again = pc.submit(pc.complete_request(prompt, max_new_tokens=3, salt="a")).result()
    other = pc.submit(pc.complete_request(prompt, max_new_tokens=3, salt="b")).result()
    plain = pc.submit(pc.complete_request(prompt, max_new_tokens=3)).result()
    assert first.cached_tokens == 0 and again.cached_tokens > 0
    assert other.cached_tokens == 0 and plain.cached_tokens == 0
    assert first.token_ids == again.token_ids == other.token_ids == plain.token_ids
