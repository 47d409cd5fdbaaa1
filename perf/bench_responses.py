"""Issue 43's measurements of ``/v1/responses`` and completions' ``echo`` + ``logprobs``.

``python -m perf.bench_responses [--pairs 100] [--turns 10] [--tokens 24] [--prefix-block 64] [--out DIR]``

Starts ``promptcache serve`` on the embedded model (fp32, CPU, memory only) and measures, on that
one server:

* ``loglik``: lm-evaluation-harness's ``local-completions`` log-likelihood of ``--pairs``
  (context, continuation) pairs from ``pckernels/data/demo/handbook.txt`` — the prompt as token ids
  (context's + continuation's), ``echo``, ``logprobs=1``, ``max_tokens=0``; the continuation's
  summed token log-probabilities and greediness — against the library's own forward (a plain
  Hugging Face forward of the same weights, ``log_softmax``): max |Δ| per token and per pair.
* ``conversation``: a ``--turns``-turn conversation two ways, interleaved turn by turn: the
  Responses API with ``previous_response_id`` (the server keeps the conversation's tokens), and
  chat completions sending the whole history each turn. Per turn: prompt tokens, cached tokens,
  and TTFT (request sent to the first streamed text delta, client side). The two ways begin with
  different system texts so they share no cached block.

Writes ``bench_responses.json`` under ``--out``; prints a summary. Short: about a minute or two.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import httpx
import torch

from perf.server_load import start_server

HANDBOOK = Path(__file__).resolve().parents[1] / "pckernels" / "data" / "demo" / "handbook.txt"


def pairs(n: int) -> list[tuple[str, str]]:
    """``n`` (context, continuation) pairs: a sentence or two of context, the next sentence's first words."""
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", HANDBOOK.read_text()) if len(s.split()) >= 6]
    out = []
    k = 0
    while len(out) < n:
        i = k % (len(sentences) - 1)
        span = 1 + (k // (len(sentences) - 1)) % 2
        context = " ".join(sentences[max(0, i - span + 1):i + 1])
        words = sentences[i + 1].split()
        cut = 2 + k % max(1, min(8, len(words) - 2))
        out.append((context, " " + " ".join(words[:cut])))
        k += 1
    return out


def loglik(url: str, model: str, tokenizer, hf, n: int) -> dict:
    token_delta, pair_delta, greedy_same, rows = 0.0, 0.0, 0, []
    for context, continuation in pairs(n):
        ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
        cont = tokenizer(continuation, add_special_tokens=False)["input_ids"]
        ids = ctx + cont
        reply = httpx.post(url + "/v1/completions", json={"model": model, "prompt": ids, "echo": True, "logprobs": 1,
                                                          "max_tokens": 0, "temperature": 0}, timeout=120)
        reply.raise_for_status()
        lp = reply.json()["choices"][0]["logprobs"]
        served = lp["token_logprobs"][len(ctx):]
        top = lp["top_logprobs"][len(ctx):]
        greedy = all(max(t, key=t.get) == tok for t, tok in zip(top, lp["tokens"][len(ctx):]))
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
        ref = [logp[p - 1, ids[p]].item() for p in range(len(ctx), len(ids))]
        ref_greedy = all(logp[p - 1].argmax().item() == ids[p] for p in range(len(ctx), len(ids)))
        token_delta = max(token_delta, max(abs(a - b) for a, b in zip(served, ref)))
        pair_delta = max(pair_delta, abs(sum(served) - sum(ref)))
        greedy_same += greedy == ref_greedy
        rows.append({"context_tokens": len(ctx), "continuation_tokens": len(cont), "loglik": sum(served),
                     "reference": sum(ref), "is_greedy": greedy})
    return {"pairs": n, "max_abs_token_delta": token_delta, "max_abs_loglik_delta": pair_delta,
            "is_greedy_agrees": greedy_same, "rows": rows}


QUESTIONS = ["Where is the Old Harbour district?", "How do I get there by metro?", "And at night?",
             "Where do taxis wait?", "Is cycling easy?", "What is there to eat?", "When is the market open?",
             "Any museums?", "Where can I sleep?", "Thank you. Summarise our talk in one line."]


def _sse(reply: httpx.Response):
    for line in reply.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def responses_turn(url, model, system, question, previous, tokens) -> tuple[dict, str]:
    body = {"model": model, "input": question, "instructions": system, "max_output_tokens": tokens,
            "temperature": 0, "stream": True, **({"previous_response_id": previous} if previous else {})}
    sent, first, final = time.perf_counter(), None, None
    with httpx.stream("POST", url + "/v1/responses", json=body, timeout=300) as reply:
        reply.raise_for_status()
        for event in _sse(reply):
            if event["type"] == "response.output_text.delta" and first is None:
                first = time.perf_counter()
            if event["type"] in ("response.completed", "response.incomplete"):
                final = event["response"]
    usage = final["usage"]
    return {"prompt_tokens": usage["input_tokens"], "cached_tokens": usage["input_tokens_details"]["cached_tokens"],
            "ttft_ms": round(((first or time.perf_counter()) - sent) * 1e3, 1)}, final["id"]


def chat_turn(url, model, messages, tokens) -> tuple[dict, str]:
    body = {"model": model, "messages": messages, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    sent, first, text, usage = time.perf_counter(), None, "", None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as reply:
        reply.raise_for_status()
        for chunk in _sse(reply):
            for choice in chunk.get("choices", []):
                piece = choice["delta"].get("content")
                if piece:
                    first = first or time.perf_counter()
                    text += piece
            usage = chunk.get("usage") or usage
    return {"prompt_tokens": usage["prompt_tokens"], "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "ttft_ms": round(((first or time.perf_counter()) - sent) * 1e3, 1)}, text


def conversation(url: str, model: str, turns: int, tokens: int) -> list[dict]:
    handbook = HANDBOOK.read_text()[:1500]
    system_r = "Session R. You answer visitors from this handbook.\n" + handbook
    system_c = "Session C. You answer visitors from this handbook.\n" + handbook
    previous, history, rows = None, [{"role": "system", "content": system_c}], []
    for k in range(turns):
        question = QUESTIONS[k % len(QUESTIONS)]
        r, previous = responses_turn(url, model, system_r, question, previous, tokens)
        history.append({"role": "user", "content": question})
        c, answer = chat_turn(url, model, history, tokens)
        history.append({"role": "assistant", "content": answer})
        rows.append({"turn": k + 1, "responses": r, "chat_history": c})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=100)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--prefix-block", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("perf/results/cpu-2c/responses"))
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM

    from pckernels.integration.embedded import converted_dir, load_tokenizer
    tokenizer = load_tokenizer()
    hf = AutoModelForCausalLM.from_pretrained(str(converted_dir()), torch_dtype=torch.float32).eval()
    proc, url = start_server("smollm2", ["--device", "cpu", "--dtype", "float32", "--prefix-block",
                                         str(args.prefix_block), "--served-model-name", "smollm2"])
    try:
        result = {"loglik": loglik(url, "smollm2", tokenizer, hf, args.pairs),
                  "conversation": conversation(url, "smollm2", args.turns, args.tokens),
                  "settings": {"tokens": args.tokens, "prefix_block": args.prefix_block, "device": "cpu fp32"}}
    finally:
        proc.terminate()
        proc.wait(60)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_responses.json").write_text(json.dumps(result, indent=1))
    ll = result["loglik"]
    print(f"loglik: {ll['pairs']} pairs, max |Δ| per token {ll['max_abs_token_delta']:.2e}, per pair "
          f"{ll['max_abs_loglik_delta']:.2e}, is_greedy agrees {ll['is_greedy_agrees']}/{ll['pairs']}")
    print("turn | responses: prompt cached ttft_ms | chat history: prompt cached ttft_ms")
    for row in result["conversation"]:
        r, c = row["responses"], row["chat_history"]
        print(f"{row['turn']:4d} | {r['prompt_tokens']:6d} {r['cached_tokens']:6d} {r['ttft_ms']:8.1f} | "
              f"{c['prompt_tokens']:6d} {c['cached_tokens']:6d} {c['ttft_ms']:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
