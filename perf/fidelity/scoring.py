"""Answer scoring: exact match and token F1 after SQuAD-style normalisation, answer recall
("contains"), and the first-token KL divergence between two runs."""

from __future__ import annotations

import re
from collections import Counter
from typing import Iterable

import torch

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")
_PUNCTUATION = re.compile(r"(?!(?<=\d)\.(?=\d))[^\w\s]|_")


def normalize(text: str) -> str:
    """Lowercase; drop thousands separators (1,350 -> 1350), punctuation (a decimal point
    stays: 1.2), articles and extra whitespace."""
    text = _THOUSANDS.sub("", text.lower())
    text = _PUNCTUATION.sub(" ", text)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, answers: Iterable[str]) -> float:
    """1.0 when the normalised prediction equals a normalised accepted answer."""
    pred = normalize(prediction)
    return float(any(pred == normalize(a) for a in answers))


def token_f1(prediction: str, answers: Iterable[str]) -> float:
    """Best token-overlap F1 over the accepted answers (normalised bags of words)."""
    pred = normalize(prediction).split()
    best = 0.0
    for answer in answers:
        gold = normalize(answer).split()
        common = sum((Counter(pred) & Counter(gold)).values())
        if not pred or not gold or not common:
            score = float(pred == gold)
        else:
            precision, recall = common / len(pred), common / len(gold)
            score = 2 * precision * recall / (precision + recall)
        best = max(best, score)
    return best


def contains_answer(prediction: str, answers: Iterable[str]) -> float:
    """1.0 when a normalised accepted answer occurs in the normalised prediction as whole words
    (small instruction models answer in sentences; this is their accuracy)."""
    pred = f" {normalize(prediction)} "
    return float(any(f" {normalize(a)} " in pred for a in answers if normalize(a)))


def first_token_kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(reference || other) in nats between the softmax distributions of two logit vectors."""
    log_p = torch.log_softmax(reference_logits.double(), dim=-1)
    log_q = torch.log_softmax(logits.double(), dim=-1)
    return float((log_p.exp() * (log_p - log_q)).sum())
