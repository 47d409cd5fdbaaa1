"""The ``promptcache`` command line."""

from __future__ import annotations

import json
import logging
from importlib import resources
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from pckernels.cli_common import (MODEL_HELP, PLACEMENT_HELP, console, engine_settings, fail, load_engine,
                                  sampling_settings)
from pckernels.cli_store import cache_app, encode
from pckernels.cli_bench import CONTEXT as BENCH_CONTEXT, bench
from pckernels.cli_compile import compile_programs
from pckernels.cli_eval import register as register_eval
from pckernels.cli_fetch import fetch
from pckernels.cli_dynamo import dynamo_worker
from pckernels.cli_serve import serve
from pckernels.engine.plan import RECOMPUTE_POLICIES

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="promptcache: reuse attention states of prompt modules declared in PML.")


def _text_or_file(value: str) -> str:
    path = Path(value)
    if "<" not in value and path.is_file():
        return path.read_text(encoding="utf-8")
    return value


@app.callback()
def _main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log progress details.")) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")


@app.command()
def demo(model: str = typer.Option("smollm2", help=MODEL_HELP),
         max_new_tokens: int = typer.Option(32, help="Tokens to generate per answer."),
         device: Optional[str] = typer.Option(None, help="cpu, cuda, … (default: best available)."),
         dtype: Optional[str] = typer.Option(None, help="float32, bfloat16, float16."),
         placement: str = typer.Option("compact", help=PLACEMENT_HELP)) -> None:
    """Answer the shipped city-guide prompts (three about a 1,400-token handbook) with no reuse and
    with promptcache's default mode, side by side: answers, time to first token, speed-up. Then
    checks the paper's exact path: exits 1 if an answer at schema placement differs from the
    reference forward (the exactness oracle)."""
    config = engine_settings(model, device=device, dtype=dtype, placement=placement)
    params = sampling_settings(max_new_tokens=max_new_tokens)
    demo_dir = resources.files("pckernels") / "data" / "demo"
    cache = load_engine(model, config)
    with resources.as_file(demo_dir) as folder:
        schema = cache.add_schema(Path(folder) / "city_guide.xml", progress=True)
    prompts = json.loads((demo_dir / "prompts.json").read_text(encoding="utf-8"))
    cache.generate(prompts[0]["prompt"], max_new_tokens=1)
    cache.generate(prompts[0]["prompt"], max_new_tokens=1, mode="baseline")
    mode = ("compact placement, the first 8 stale tokens of each module recomputed" if schema.placement == "compact"
            else "schema placement")
    table = Table(title=escape(f"promptcache demo — schema {schema.name!r} on {cache.name} ({cache.device}, "
                               f"{cache.dtype}); promptcache: {mode}"))
    for col in ("prompt", "tokens", "cached", "TTFT no reuse", "TTFT promptcache", "speed-up", "same answer"):
        table.add_column(col, justify="left" if col == "prompt" else "right")
    answers, same = [], 0
    for item in prompts:
        base = cache.generate(item["prompt"], params, mode="baseline")
        got = cache.generate(item["prompt"], params)
        same += got.token_ids == base.token_ids
        table.add_row(escape(item["name"]), str(got.cached_tokens + got.computed_tokens), str(got.cached_tokens),
                      f"{base.ttft_s * 1e3:.0f} ms", f"{got.ttft_s * 1e3:.0f} ms", f"{base.ttft_s / got.ttft_s:.1f}x",
                      "yes" if got.token_ids == base.token_ids else "differs")
        answers.append((item["name"], got.text, base.text))
    console.print(table)
    for name, got_text, base_text in answers:
        console.print(f"[bold]{escape(name)}[/bold]\n  promptcache: {escape(got_text.strip())}\n"
                      f"  no reuse:    {escape(base_text.strip())}")
    console.print(f"{same} of {len(prompts)} answers are token for token those of no reuse (modules are encoded "
                  "without seeing each other, so some may be worded differently: docs/fidelity.md).")
    mismatched = []
    for item in prompts:
        exact = item["prompt"].replace("<prompt ", '<prompt placement="schema" ', 1)
        ref = cache.generate(exact, params, mode="reference")
        got = cache.generate(exact, params)
        if got.token_ids != ref.token_ids:
            mismatched.append(item["name"])
    if mismatched:
        fail(f"at schema placement, cached answers differ from the reference forward for: {', '.join(mismatched)}",
             code=1)
    console.print(f"schema placement (the paper's semantics): all {len(prompts)} cached answers equal the reference "
                  "forward's.")


@app.command()
def run(schema: str = typer.Argument(..., help="Schema file (or PML text)."),
        prompt: str = typer.Argument(..., help="Prompt PML text (or a file holding it)."),
        model: str = typer.Option("smollm2", help=MODEL_HELP),
        mode: str = typer.Option("cached", help="cached | baseline | reference | compare"),
        max_new_tokens: int = typer.Option(64, help="Tokens to generate."),
        temperature: float = typer.Option(0.0, help="0 is greedy."),
        seed: Optional[int] = typer.Option(None, help="Sampling seed."),
        as_json: bool = typer.Option(False, "--json", help="Print the result fields as JSON."),
        device: Optional[str] = typer.Option(None), dtype: Optional[str] = typer.Option(None),
        matmul: str = typer.Option("fp32", help="CPU matmul precision: fp32 or bf16 (docs/perf.md)."),
        lookahead: int = typer.Option(0, help="Draft tokens a greedy decode step verifies besides its own "
                                                     "(prompt lookup, docs/engine.md; 0: none)."),
        placement: str = typer.Option("compact", help=PLACEMENT_HELP),
        recompute: Optional[float] = typer.Option(None, min=0.0, help="Stale tokens recomputed: a share (0 to 1), or "
                                                                     "with --recompute-policy epic a count per module "
                                                                     "(default: 8, epic, for compact placement; "
                                                                     "none at schema placement)."),
        recompute_policy: Optional[str] = typer.Option(None, help="first | deviation | epic (docs/fidelity.md).")
        ) -> None:
    """Answer one PML prompt against a schema."""
    modes = ["cached", "baseline", "reference"] if mode == "compare" else [mode]
    if mode not in ("cached", "baseline", "reference", "compare"):
        fail(f"unknown mode {mode!r}: expected cached, baseline, reference or compare")
    if recompute_policy is not None and recompute_policy not in RECOMPUTE_POLICIES:
        fail(f"unknown --recompute-policy {recompute_policy!r}: expected {', '.join(RECOMPUTE_POLICIES)}")
    config = engine_settings(model, device=device, dtype=dtype, matmul=matmul, lookahead=lookahead,
                             placement=placement)
    params = sampling_settings(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    if "<" not in schema and not Path(schema).is_file():
        fail(f"no such schema file: {schema!r}")
    cache = load_engine(model, config)
    try:
        cache.add_schema(schema if "<" in schema else Path(schema))
        text = _text_or_file(prompt)
        results = {m: cache.generate(text, params, mode=m, **({} if m == "baseline" else {
                       "recompute": recompute, "recompute_policy": recompute_policy}))
                   for m in modes}
    except (OSError, ValueError) as exc:
        fail(exc)
    if as_json:
        payload = {m: r.to_dict() for m, r in results.items()}
        console.print_json(json.dumps(payload if mode == "compare" else payload[mode]))
        return
    for m, r in results.items():
        console.print(f"[bold]{m}[/bold] ttft {r.ttft_s * 1e3:.1f} ms, cached {r.cached_tokens}, "
                      f"computed {r.computed_tokens}: {escape(r.text)}")


app.command()(encode)
app.command()(serve)
app.command(name="dynamo-worker")(dynamo_worker)
app.command()(fetch)
app.command(name="compile")(compile_programs)
app.command(context_settings=BENCH_CONTEXT)(bench)
app.add_typer(cache_app, name="cache")
register_eval(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
