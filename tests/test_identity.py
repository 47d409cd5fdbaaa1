"""Model identity: every weight byte, the config and the dtype; weight files hashed once."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pckernels.engine import PromptCache
from pckernels.integration.identity import file_digest, model_fingerprint, tensors_digest, weight_files
from pckernels.prefix.testing import tiny_tokenizer
from test_engine import tiny_llama


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMPTCACHE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("where", ["embedding", "middle-layer", "last-element"])
def test_any_changed_weight_changes_the_identity(tokenizer, where):
    """A fine-tune that differs in one value anywhere gets another identity (a strided sample of
    each tensor, as before, misses values between its samples)."""
    a = tiny_llama(2048, layers=3)
    b = tiny_llama(2048, layers=3)
    assert model_fingerprint(a, torch.float32) == model_fingerprint(b, torch.float32)
    target = {"embedding": (b.model.embed_tokens.weight, (0, 1)),
              "middle-layer": (b.model.layers[1].mlp.up_proj.weight, (3, 5)),
              "last-element": (b.model.layers[2].self_attn.o_proj.weight, (-1, -1))}[where]
    with torch.no_grad():
        target[0][target[1]] += 1e-3
    assert model_fingerprint(a, torch.float32) != model_fingerprint(b, torch.float32)


def test_identity_covers_dtype_config_and_buffers(tokenizer):
    a = tiny_llama(len(tokenizer))
    assert model_fingerprint(a, torch.float32) != model_fingerprint(a, torch.bfloat16)
    b = tiny_llama(len(tokenizer), rope_theta=500000.0)
    assert model_fingerprint(a, torch.float32) != model_fingerprint(b, torch.float32)
    before = tensors_digest(a)
    a.register_buffer("extra", torch.ones(3))
    assert tensors_digest(a) != before


def test_file_digest_is_remembered_until_the_file_changes(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x" * 1000)
    memo = tmp_path / "memo.json"
    true = file_digest(weights, memo_path=memo)
    entries = json.loads(memo.read_text())
    (key, entry), = entries.items()
    entry["sha256"] = "remembered"
    memo.write_text(json.dumps({key: entry}))
    assert file_digest(weights, memo_path=memo) == "remembered"  # a stat, no rehash
    weights.write_bytes(b"y" * 1000)
    os.utime(weights, ns=(1, 1))
    assert file_digest(weights, memo_path=memo) not in ("remembered", true)
    memo.write_text("{not json")
    assert file_digest(weights, memo_path=memo) == file_digest(weights, memo_path=tmp_path / "fresh.json")


def _save(model, tokenizer, directory):
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_from_pretrained_identifies_a_local_model_by_its_files(tokenizer, tmp_path, cache_dir):
    """Two fine-tunes saved side by side differ only in one value: different identities, so
    blocks in a shared disk tier are never crossed; the same files give the same identity."""
    base = tiny_llama(len(tokenizer))
    tuned = tiny_llama(len(tokenizer))
    with torch.no_grad():
        tuned.model.layers[0].mlp.down_proj.weight[7, 11] += 1e-3
    a_dir = _save(base, tokenizer, tmp_path / "a")
    b_dir = _save(tuned, tokenizer, tmp_path / "b")
    a = PromptCache.from_pretrained(str(a_dir), store_dir=False, dtype=torch.float32, placement="schema")
    b = PromptCache.from_pretrained(str(b_dir), store_dir=False, dtype=torch.float32, placement="schema")
    assert a.model_id != b.model_id
    assert a.model_id == model_fingerprint(a.model, torch.float32, weight_files(a_dir))
    assert [p.name for p in weight_files(a_dir)] == ["model.safetensors"]
    assert (cache_dir / "identity.json").is_file()
    again = PromptCache.from_pretrained(str(a_dir), store_dir=False, dtype=torch.float32, placement="schema")
    assert again.model_id == a.model_id


def test_prompt_cache_takes_an_explicit_identity(tokenizer):
    pc = PromptCache(tiny_llama(len(tokenizer)), tokenizer, model_id="my-model-v3", placement="schema")
    assert pc.model_id == "my-model-v3"
