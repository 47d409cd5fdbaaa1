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

from pckernels.cli_common import MODEL_HELP, check_model_options, console, fail, load_engine
from pckernels.cli_store import cache_app, encode
from pckernels.cli_bench import CONTEXT as BENCH_CONTEXT, bench
from pckernels.cli_compile import compile_programs
from pckernels.cli_eval import register as register_eval
from pckernels.cli_fetch import fetch
from pckernels.cli_serve import serve

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
         dtype: Optional[str] = typer.Option(None, help="float32, bfloat16, float16.")) -> None:
    """Run the shipped city-guide schema in baseline and cached mode and compare; exits 1 if a
    cached answer differs from the reference forward (the exactness oracle)."""
    check_model_options(model, device, dtype)
    demo_dir = resources.files("pckernels") / "data" / "demo"
    cache = load_engine(model, device, dtype)
    with resources.as_file(demo_dir / "city_guide.xml") as schema_path:
        schema = cache.add_schema(schema_path, progress=True)
    prompts = json.loads((demo_dir / "prompts.json").read_text(encoding="utf-8"))
    cache.generate(prompts[0]["prompt"], max_new_tokens=1)
    cache.generate(prompts[0]["prompt"], max_new_tokens=1, mode="baseline")
    table = Table(title=escape(f"promptcache demo — schema {schema.name!r} on {cache.name} ({cache.device}, "
                               f"{cache.dtype})"))
    for col in ("prompt", "cached", "computed", "TTFT baseline", "TTFT cached", "speedup", "= reference", "= baseline"):
        table.add_column(col, justify="left" if col == "prompt" else "right")
    answers, mismatched = [], []
    for item in prompts:
        base = cache.generate(item["prompt"], mode="baseline", max_new_tokens=max_new_tokens)
        ref = cache.generate(item["prompt"], mode="reference", max_new_tokens=max_new_tokens)
        cached = cache.generate(item["prompt"], mode="cached", max_new_tokens=max_new_tokens)
        table.add_row(escape(item["name"]), str(cached.cached_tokens), str(cached.computed_tokens),
                      f"{base.ttft_s * 1e3:.0f} ms", f"{cached.ttft_s * 1e3:.0f} ms",
                      f"{base.ttft_s / cached.ttft_s:.1f}x",
                      "yes" if cached.token_ids == ref.token_ids else "NO",
                      "yes" if cached.token_ids == base.token_ids else "differs")
        answers.append((item["name"], cached.text, base.text))
        if cached.token_ids != ref.token_ids:
            mismatched.append(item["name"])
    console.print(table)
    for name, cached_text, base_text in answers:
        console.print(f"[bold]{escape(name)}[/bold]\n  cached:   {escape(cached_text.strip())}\n"
                      f"  baseline: {escape(base_text.strip())}")
    if mismatched:
        fail(f"cached answers differ from the reference forward for: {', '.join(mismatched)}", code=1)


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
        lookahead: int = typer.Option(0, min=0, help="Draft tokens a greedy decode step verifies besides its own "
                                                     "(prompt lookup, docs/engine.md; 0: none).")) -> None:
    """Answer one PML prompt against a schema."""
    modes = ["cached", "baseline", "reference"] if mode == "compare" else [mode]
    if mode not in ("cached", "baseline", "reference", "compare"):
        fail(f"unknown mode {mode!r}: expected cached, baseline, reference or compare")
    if matmul not in ("fp32", "bf16"):
        fail(f"unknown --matmul {matmul!r}: expected fp32 or bf16")
    check_model_options(model, device, dtype)
    if "<" not in schema and not Path(schema).is_file():
        fail(f"no such schema file: {schema!r}")
    cache = load_engine(model, device, dtype, matmul=matmul, lookahead=lookahead)
    try:
        cache.add_schema(schema if "<" in schema else Path(schema))
        text = _text_or_file(prompt)
        results = {m: cache.generate(text, mode=m, max_new_tokens=max_new_tokens, temperature=temperature,
                                     seed=seed) for m in modes}
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
app.command()(fetch)
app.command(name="compile")(compile_programs)
app.command(context_settings=BENCH_CONTEXT)(bench)
app.add_typer(cache_app, name="cache")
register_eval(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
