"""Store bytes of several schemas that share documents: schema placement vs compact placement.

``python -m perf.bench_sharing`` builds ``--schemas`` RAG schemas over the shipped fidelity
documents (the same system prompt; schema ``i`` holds ``--per-schema`` documents starting at
``i * --step`` of the library, so neighbouring schemas overlap) and installs them twice, in fresh
engines: with ``placement="schema"`` every module is encoded at its schema offset, so a document
at two offsets is two blocks; with ``placement="compact"`` modules are stored packed (right after
the system prompt, no schema offset in the key), so each distinct document is one block. Reports
blocks, bytes and encoding time (``tests/test_compact.py`` checks that shared blocks answer
exactly).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from xml.sax.saxutils import escape

import torch

from perf.fidelity import dataset as ds


def schemas(data: ds.Dataset, count: int, per: int, step: int, placement: str) -> list[str]:
    out = []
    n = len(data.library)
    for i in range(count):
        docs = [data.library[(i * step + j) % n] for j in range(per)]
        parts = "".join(f'<module name="{d}" xml:space="preserve">\n\n{escape(data.documents[d].text)}</module>'
                        for d in docs)
        out.append(f'<schema name="rag-{i}" placement="{placement}"><system>{escape(ds.SYSTEM)}{parts}'
                   '</system></schema>')
    return out


def measure(texts: list[str], threads: int) -> dict:
    from pckernels import PromptCache

    torch.set_num_threads(threads)
    cache = PromptCache.from_pretrained(store_dir=False, device_budget="8GiB")
    t0 = time.perf_counter()
    installed = [cache.add_schema(t) for t in texts]
    seconds = time.perf_counter() - t0
    stats = cache.stats()
    keys = list(cache.store.keys())
    instances = sum(1 for s in installed for name, m in s.modules.items() if m.cached)
    nbytes = sum(cache.store.get(k).numel() * cache.store.get(k).element_size() for k in keys)
    out = {"schemas": len(texts), "module instances": instances, "blocks": len(keys), "bytes": nbytes,
           "encode_s": seconds, "encodes": stats.get("encodes")}
    cache.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.bench_sharing", description=__doc__.splitlines()[0])
    ap.add_argument("--schemas", type=int, default=6)
    ap.add_argument("--per-schema", type=int, default=8)
    ap.add_argument("--step", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    data = ds.load("shipped")
    results = {placement: measure(schemas(data, args.schemas, args.per_schema, args.step, placement), args.threads)
               for placement in ("schema", "compact")}
    a, b = results["schema"], results["compact"]
    results["saved_bytes"] = a["bytes"] - b["bytes"]
    results["ratio"] = a["bytes"] / b["bytes"]
    print(json.dumps(results, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()}, **results},
                                       indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
