"""Streamed text: incremental detokenisation equals a whole decode, the deltas join to the result's
text with stop strings anywhere (across tokens, across deltas), and each token's work stays small
however long the answer grows.

Property tests (hypothesis) over random token sequences of the embedded SmolLM2 tokenizer (a
byte-level BPE), encodings of multi-byte text (CJK, emoji, accents), a tokenizer with one token
per byte (every multi-byte character split across tokens) and a SentencePiece-style one (leading
space, byte fallback). The oracle is the rule as it was first written: decode everything after each
token, stop when a stop string is in it, cut at the earliest.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pckernels.generation import Detokenizer, SamplingParams, TextStream, TokenChoice
from pckernels.generation.stops import first_stop

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TEXTS = ["Hello 你好 🎉 world . , n't", "日本語のテキスト、絵文字👨‍👩‍👧‍👦 and ascii\n\nmore lines",
         "Ünïcödé ßtraße — “quotes” ‹›", "def f(x):\n    return x**2  # 平方", "🙂🙃😉 ok. Stop here. Done!",
         "Ελληνικά και русский текст", "a" * 17 + " " + "b" * 5]


@pytest.fixture(scope="module")
def smol():
    from pckernels.integration.embedded import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="module")
def byte_tok():
    from tests.pml_tokenizers import byte_tokenizer

    return byte_tokenizer()


@pytest.fixture(scope="module")
def sentencepiece_like():
    """Llama-2 style decoding: ``▁`` for a space (the first one stripped), ``<0xNN>`` byte fallback."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for word in ["▁Hello", "▁world", "▁stop", "▁here", ".", ",", "▁", "▁a", "b", "▁你", "好", "!"]:
        vocab[word] = len(vocab)
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def full(tokenizer, ids) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def oracle(tokenizer, ids, stops) -> tuple[str, int, bool]:
    """The answer's text, how many tokens it took and whether a stop string ended it, by the
    first rule: decode everything after each token."""
    for k in range(1, len(ids) + 1):
        text = full(tokenizer, ids[:k])
        cut = first_stop(text, stops)
        if cut is not None:
            return text[:cut], k, True
    return full(tokenizer, ids), len(ids), False


def streamed(tokenizer, ids, stops, groups) -> tuple[list[str], TextStream]:
    """Push ``ids`` in groups of the given sizes (cycled), as a server takes them; deltas and the stream."""
    stream = TextStream(tokenizer, stops)
    deltas, at, k = [], 0, 0
    while at < len(ids) and not stream.stopped:
        size = groups[k % len(groups)]
        deltas.append(stream.push(ids[at:at + size]))
        at, k = at + size, k + 1
    deltas.append(stream.finish())
    return deltas, stream


def check(tokenizer, ids, stops, groups) -> None:
    want, used, stopped = oracle(tokenizer, ids, stops)
    deltas, stream = streamed(tokenizer, ids, stops, groups)
    assert "".join(deltas) == want == stream.text
    assert stream.stopped == stopped and len(stream.detok.ids) == used
    # Every prefix of the deltas is a prefix of the answer: nothing shown is taken back.
    shown = ""
    for delta in deltas:
        shown += delta
        assert want.startswith(shown)


def token_ids(tokenizer):
    """Random ids of ``tokenizer``, or the ids of random multi-byte text (split at random). The
    SentencePiece-style tokenizer's random ids leave out its byte tokens: byte fallback decodes an
    invalid run of bytes to one replacement per byte, earlier text changing with later ids."""
    vocab = len(tokenizer) if tokenizer.convert_ids_to_tokens(len(tokenizer) - 1) != "<0xFF>" else 15
    random_ids = st.lists(st.integers(0, vocab - 1), max_size=40)
    text = st.lists(st.sampled_from(TEXTS) | st.text(min_size=1, max_size=12), min_size=1, max_size=4)
    encoded = text.map(lambda parts: tokenizer.encode("".join(parts), add_special_tokens=False))
    return random_ids | encoded


GROUPS = st.lists(st.integers(1, 4), min_size=1, max_size=4)


@SETTINGS
@given(data=st.data())
def test_incremental_text_is_the_whole_decode(smol, byte_tok, sentencepiece_like, data):
    tokenizer = data.draw(st.sampled_from([smol, byte_tok, sentencepiece_like]))
    ids = data.draw(token_ids(tokenizer))
    check(tokenizer, ids, [], data.draw(GROUPS))
    detok = Detokenizer(tokenizer)
    stable = "".join(detok.push(t) for t in ids)
    assert stable + detok.flush() == full(tokenizer, ids)


@SETTINGS
@given(data=st.data())
def test_deltas_join_to_the_cut_answer_with_random_stop_strings(smol, byte_tok, sentencepiece_like, data):
    tokenizer = data.draw(st.sampled_from([smol, byte_tok, sentencepiece_like]))
    ids = data.draw(token_ids(tokenizer))
    text = full(tokenizer, ids)
    # Stop strings from the answer itself (so they do occur, often across tokens) and random ones.
    inner = st.integers(0, max(0, len(text) - 1)).flatmap(
        lambda a: st.integers(a + 1, min(len(text), a + 6)).map(lambda b: text[a:b])) if text else st.just("x")
    stops = data.draw(st.lists(inner | st.text(min_size=1, max_size=4) | st.sampled_from([". ", "\n", "好", "🎉"]),
                               min_size=1, max_size=3))
    check(tokenizer, ids, stops, data.draw(GROUPS))


def test_a_stop_string_split_across_deltas_is_held_back_then_cut(byte_tok):
    """One byte per token: "STOP" arrives a letter at a time and is cut; "S" is held while it may
    begin "STOP", until the 4-byte emoji after it is complete (never shown in parts), which is then
    held itself (it may begin "🎉y") until "x" comes."""
    ids = byte_tok.encode("aS🎉xSTOP tail", add_special_tokens=False)
    stream = TextStream(byte_tok, ["STOP", "🎉y"])
    deltas = [stream.push([t]) for t in ids]
    assert stream.stopped and "".join(deltas) + stream.finish() == "aS🎉x"
    assert deltas[:2] == ["a", ""]
    assert deltas[2:6] == ["", "", "", "S"]
    assert deltas[6] == "🎉x"


class CountingTokenizer:
    """A tokenizer that records the length of every ``decode`` call."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.lengths: list[int] = []

    def decode(self, ids, **kwargs) -> str:
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)

    def __len__(self) -> int:
        return len(self.tokenizer)


def answer_ids(smol, n: int) -> list[int]:
    rng = random.Random(7)
    ids: list[int] = []
    while len(ids) < n:
        ids += smol.encode(rng.choice(TEXTS) + " ", add_special_tokens=False)
    return ids[:n]


def per_token_work(counting: CountingTokenizer, push, ids) -> list[int]:
    """Ids decoded for each token pushed."""
    work = []
    for token in ids:
        before = sum(counting.lengths)
        push(token)
        work.append(sum(counting.lengths) - before)
    return work


def test_the_work_per_token_does_not_grow_with_the_answer(smol):
    """2,000 tokens, two stop strings that never occur: the ids decoded per token are as few for
    the last hundred tokens as for the first hundred (and a handful at most), for the stream and
    for the engine's token choice."""
    ids = answer_ids(smol, 2000)
    stops = ["<END>", "\n\n\n\n"]
    counting = CountingTokenizer(smol)
    stream = TextStream(counting, stops)
    work = per_token_work(counting, lambda t: stream.push([t]), ids)
    assert not stream.stopped and max(counting.lengths) <= 12
    assert sum(work[-100:]) <= sum(work[:100]) * 1.5 and max(work) <= 24

    counting = CountingTokenizer(smol)
    params = SamplingParams.of(len(ids) + 1, 0.0, 1.0, stops, None)
    choice = TokenChoice(params, counting, set())
    vocab = len(smol)

    def choose(token):
        logits = torch.full((vocab,), -1e9)
        logits[token] = 0.0
        assert choice.choose(logits, 10) == token

    work = per_token_work(counting, choose, ids)
    assert sum(work[-100:]) <= sum(work[:100]) * 1.5 and max(work) <= 24
    assert choice.text() == full(smol, ids)


def test_the_token_choice_and_the_stream_agree(smol):
    """The engine's side (``TokenChoice``: when to stop, the result's text) and the caller's side
    (``TextStream`` fed the emitted tokens) cut at the same token and the same character."""
    ids = smol.encode("Plan: 1. pack 🎒 bags. 2. fly to 東京. 3. rest", add_special_tokens=False)
    for stops in (["東京"], [". 2"], ["🎒 b", "rest"], ["absent"]):
        params = SamplingParams.of(len(ids), 0.0, 1.0, stops, None)
        choice = TokenChoice(params, smol, {smol.eos_token_id})
        emitted = []
        for token in ids:
            logits = torch.full((len(smol),), -1e9)
            logits[token] = 0.0
            emitted.append(choice.choose(logits, 5))
            if choice.done:
                break
        stream = TextStream(smol, stops)
        deltas = [stream.push([t]) for t in emitted] + [stream.finish()]
        want, used, _ = oracle(smol, ids, stops)
        assert choice.text() == "".join(deltas) == want and len(emitted) == used
        assert choice.finish_reason == ("stop" if stops != ["absent"] else "length")
