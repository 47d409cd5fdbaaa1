"""Experiment 5 — memory per cached token (the paper's Table 2).

Computed: ``2 (key, value) * layers * KV heads * head dim * bytes per element`` from model
configurations written here (no hub access). Measured for the model that runs: bytes of the
blocks the engine's store gained for a new module over its tokens, the assembly buffer's bytes
per row, and the exact prefix cache's stored bytes per prompt token (which include the prompt
end's last-token logits).
"""

from __future__ import annotations

import torch

from dataclasses import asdict, dataclass

from perf.suite.context import Bench
from perf.suite.texts import archive, pml_escape, sized

MEASURED_TOKENS = 512


@dataclass(frozen=True)
class KVShape:
    model: str
    layers: int
    kv_heads: int
    head_dim: int
    note: str = ""

    def bytes_per_token(self, bytes_per_element: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * bytes_per_element


PUBLISHED_SHAPES = (
    KVShape("Llama 2 7B", 32, 32, 128, "multi-head attention"),
    KVShape("Llama 2 13B", 40, 40, 128, "multi-head attention"),
    KVShape("Llama 2 70B", 80, 8, 128, "grouped-query attention, 8 KV heads"),
    KVShape("Falcon 7B", 32, 1, 64, "multi-query attention"),
    KVShape("Falcon 180B", 80, 8, 64, "grouped-query attention, 8 KV heads"),
    KVShape("SmolLM2-135M (embedded)", 30, 3, 64, "grouped-query attention, 3 KV heads"),
)


def steps(bench: Bench) -> int:
    return 2


def computed_rows() -> list[dict]:
    return [{**asdict(s), "fp16_bytes_per_token": s.bytes_per_token(2), "fp32_bytes_per_token": s.bytes_per_token(4)}
            for s in PUBLISHED_SHAPES]


def measured(bench: Bench) -> dict:
    engine, prefix = bench.engine, bench.prefix
    layout = engine.layout
    element = torch.empty(0, dtype=engine.dtype).element_size()
    text = pml_escape(sized(bench.tokenizer, archive(77), MEASURED_TOKENS))
    bytes_before, tokens_before = engine.store.nbytes(), sum(k.tokens for k in engine.store.keys())
    schema = engine.add_schema(f'<schema name="memory"><module name="doc">{text}</module></schema>')
    stored_bytes = engine.store.nbytes() - bytes_before
    stored_tokens = sum(k.tokens for k in engine.store.keys()) - tokens_before
    bench.ticker.advance()
    ids = list(schema.modules["doc"].token_ids)
    prefix.clear()
    prefix.complete(ids, max_new_tokens=1)
    prefix_bytes = prefix.stats()["bytes"]
    bench.ticker.advance()
    return {
        "model": engine.name, "dtype": str(engine.dtype), "layers": layout.num_layers, "kv_heads": layout.num_kv_heads,
        "head_dim": layout.head_dim,
        "computed_bytes_per_token": 2 * layout.num_layers * layout.num_kv_heads * layout.head_dim * element,
        "store_bytes_per_token": stored_bytes / stored_tokens if stored_tokens else None,
        "store_tokens": stored_tokens,
        "buffer_bytes_per_row": engine.scheduler.arena.bytes_per_row,
        "prefix_bytes_per_token": prefix_bytes / len(ids), "prefix_tokens": len(ids),
    }


def run(bench: Bench) -> dict:
    return {"computed": computed_rows(), "measured": measured(bench)}
