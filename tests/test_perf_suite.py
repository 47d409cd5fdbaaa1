"""Smoke test of the performance suite's machinery (perf/suite, perf/gpu_suite.py) end to end on a
tiny random Llama with the word tokenizer: every experiment runs, results, plots and the summary
are written, each method equals its own oracle. No timing assertions: speed lives in benchmarks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pckernels.cli import app  # noqa: E402
from pckernels.cli_bench import suite_root  # noqa: E402
from pckernels.engine import PromptCache  # noqa: E402
from perf import gpu_suite  # noqa: E402
from perf.suite.config import EXPERIMENTS, SuiteConfig  # noqa: E402
from perf.suite.context import natural_order_ids  # noqa: E402
from perf.suite import runner  # noqa: E402
from perf.suite.runner import read_checkpoint, run_suite, write_results  # noqa: E402
from perf.suite.tokenizer import WordTokenizer  # noqa: E402

VOCAB = 512
TINY_SHAPE = dict(gpu_suite.DRY_RUN_SHAPE, vocab_size=VOCAB, hidden_size=48, num_attention_heads=6,
                  num_key_value_heads=2, intermediate_size=96, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def engine():
    torch.manual_seed(0)
    return PromptCache(gpu_suite.random_llama(TINY_SHAPE, "cpu", torch.float32), WordTokenizer(VOCAB),
                       prefix_block_size=SuiteConfig.tiny().prefix_block_size, placement="schema")


def test_every_experiment_runs_and_is_reported(engine, tmp_path):
    results = run_suite(engine, SuiteConfig.tiny(), show_progress=False)
    summary = write_results(results, tmp_path)

    assert list(results["experiments"]) == list(EXPERIMENTS)
    saved = json.loads((tmp_path / "suite.json").read_text())
    assert saved["config"]["name"] == "tiny"
    for name in ("overview", *EXPERIMENTS):
        if name == "llamacpp":
            assert results["experiments"][name]["skipped"], "the peer runs only a model with a GGUF of its own"
            assert not (tmp_path / f"{name}.png").exists()
            continue
        assert (tmp_path / f"{name}.png").stat().st_size > 0
    text = summary.read_text()
    assert "## Targets" in text and "## 6. Decode rate" in text and "Peak resident memory of the process" in text
    ttft = results["experiments"]["ttft"]["rows"]
    assert [r["cached_tokens"] > 0 and r["computed_tokens"] > 0 for r in ttft] == [True, True]
    assert all(r["baseline"]["n"] == 2 for r in ttft)
    for row in results["experiments"]["workloads"]["rows"]:
        assert row["outputs"]["prefix_equals_oracle"], row["name"]
        assert row["outputs"]["prompt_cache_equals_oracle"], row["name"]
    rag = next(r for r in results["experiments"]["workloads"]["rows"] if r["name"] == "rag")
    assert rag["prefix_cached_fraction"] < rag["prompt_cache_cached_fraction"]
    fractions = [r["cached_tokens"] / r["prompt_tokens"] for r in results["experiments"]["hit_ratio"]["rows"]]
    assert fractions == sorted(fractions)
    measured = results["experiments"]["memory"]["measured"]
    assert measured["store_bytes_per_token"] == measured["computed_bytes_per_token"]
    concurrency = results["experiments"]["concurrency"]
    assert [r["streams"] for r in concurrency["rows"]] == [1, 2] and concurrency["answers_equal_alone"]
    two = concurrency["rows"][1]
    assert two["kv"]["rows"] > 0 and two["kv"]["private_module_rows"] >= two["kv"]["module_rows"] > 0
    assert "## 7. Concurrent streams" in text


def test_interrupted_run_keeps_its_finished_experiments_and_resume_runs_only_the_rest(engine, tmp_path,
                                                                                     monkeypatch):
    checkpoint = tmp_path / "suite.partial.json"
    config = SuiteConfig.tiny().with_overrides(experiments=["memory", "amortisation"])

    class Interrupted:
        steps = staticmethod(lambda bench: 1)

        @staticmethod
        def run(bench):
            raise KeyboardInterrupt

    class MustNotRun(Interrupted):
        @staticmethod
        def run(bench):
            raise AssertionError("a finished experiment ran again")

    with monkeypatch.context() as patch:
        patch.setitem(runner.EXPERIMENT_MODULES, "amortisation", Interrupted)
        with pytest.raises(KeyboardInterrupt):
            run_suite(engine, config, show_progress=False, checkpoint=checkpoint)
    partial = read_checkpoint(checkpoint)
    assert list(partial["experiments"]) == ["memory"] and partial["complete"] is False

    with monkeypatch.context() as patch:
        patch.setitem(runner.EXPERIMENT_MODULES, "memory", MustNotRun)
        resumed = run_suite(engine, config, show_progress=False, checkpoint=checkpoint, resume=partial)
    assert resumed["complete"] and resumed["resumed"]["experiments"] == ["memory"]
    assert resumed["experiments"]["memory"] == partial["experiments"]["memory"]
    assert list(read_checkpoint(checkpoint)["experiments"]) == ["memory", "amortisation"]
    assert "Resumed: memory" in write_results(resumed, tmp_path / "out").read_text()

    with pytest.raises(ValueError, match="repeats"):
        run_suite(engine, config.with_overrides(repeats=7), show_progress=False, resume=partial)


def test_natural_order_moves_only_the_named_modules(engine):
    engine.add_schema('<schema name="order"><system>intro words <module name="a">alpha one</module>'
                      '<module name="b">beta two three</module></system></schema>')
    resolved = engine.resolve('<prompt schema="order"><a/><b/><user>why</user></prompt>')
    ids = list(resolved.token_ids)
    swapped = natural_order_ids(resolved, ["b", "a"])
    tok = engine.tokenizer
    a, b = tok.encode("alpha one"), tok.encode("beta two three")
    start = ids.index(a[0])
    assert ids[start:start + 5] == a + b
    assert swapped == ids[:start] + b + a + ids[start + 5:]


def test_word_tokenizer_is_one_token_per_word():
    tok = WordTokenizer(100)
    ids = tok("the cat sat on the mat")["input_ids"]
    assert len(ids) == 6 and ids[0] == ids[4] and all(3 <= i < 100 for i in ids)
    assert tok.decode(ids) == "the cat sat on the mat"


def test_gpu_suite_dry_run_writes_its_report(tmp_path):
    assert gpu_suite.main(["--dry-run", "--no-kernels", "--repeats", "1", "--lengths", "16", "--out",
                           str(tmp_path)]) == 0
    results = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert results["exactness"]["cached_equals_reference"] and results["exactness"]["host_equals_device"]
    assert {"cached", "cached_host", "cached_resident", "floor"} <= set(results["ttft"]["rows"][0])
    assert (tmp_path / "gpu_ttft.png").is_file() and "## TTFT" in (tmp_path / "gpu_summary.md").read_text()


def shrunken_bench_hybrid(monkeypatch):
    """perf.bench_hybrid with its LFM2-style model cut to three small layers."""
    from perf import bench_hybrid

    monkeypatch.setattr(bench_hybrid, "COMMON", dict(bench_hybrid.COMMON, hidden_size=64, intermediate_size=96,
                                                     num_hidden_layers=3, num_attention_heads=4, head_dim=16))
    monkeypatch.setitem(bench_hybrid.FAMILIES, "lfm2", dict(layer_types=["conv", "conv", "full_attention"],
                                                            block_ff_dim=96))
    return bench_hybrid


def test_bench_hybrid_reports_every_case_exact(tmp_path, monkeypatch):
    """perf.bench_hybrid end to end on a shrunken LFM2-style model (engine rows, decode, chunk
    sizes; no server): every case exact, and the report is written as it goes."""
    bench_hybrid = shrunken_bench_hybrid(monkeypatch)
    assert bench_hybrid.main(["--families", "lfm2", "--lengths", "300", "--block", "64", "--chunks", "32", "64",
                              "--clients", "0", "--decode-tokens", "3", "--decode-rounds", "1", "--threads", "1",
                              "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "hybrid.json").read_text())
    row = results["families"]["lfm2"]["lengths"]["300"]
    assert set(row["cases"]) == {"first pass", "repeat", "new question", "middle edit", "edit repeated", "second turn"}
    assert all(case["exact"] for case in row["cases"].values()) and row["decode"]["exact"]
    assert row["cases"]["repeat"]["cached"] == row["prompt_tokens"]
    assert set(results["families"]["lfm2"]["chunks"]) == {"32", "64"} and "partial" not in results
    assert "| first pass |" in (tmp_path / "summary.md").read_text()


def test_bench_hybrid_runs_the_table_on_a_named_model(tmp_path):
    """``--model``: the same rows on a model by name (the embedded SmolLM2 here), documents sized in
    its tokens; an attention-only model's repeat and edits are exact too."""
    from perf import bench_hybrid

    assert bench_hybrid.main(["--model", "smollm2", "--lengths", "200", "--block", "64", "--chunks", "--clients", "0",
                              "--decode-tokens", "2", "--decode-rounds", "1", "--threads", "1",
                              "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "hybrid.json").read_text())
    [(name, data)] = results["families"].items()
    row = data["lengths"]["200"]
    assert name == "SmolLM2-135M-Instruct" and data["layers"] == "30 full_attention"
    assert 200 < row["prompt_tokens"] < 260 and all(case["exact"] for case in row["cases"].values())


def test_bench_hybrid_times_only_the_cases_asked_for(tmp_path, monkeypatch):
    """``--cases``: only those cases are timed, yet each still reads what the full table would have
    stored before it (the edit repeated finds the edited document, not just its first half);
    ``--decode-rounds 0`` leaves the decode rows out."""
    bench_hybrid = shrunken_bench_hybrid(monkeypatch)
    assert bench_hybrid.main(["--families", "lfm2", "--lengths", "300", "--block", "32", "--chunks", "--clients",
                              "0", "--decode-rounds", "0", "--cases", "repeat", "edit repeated", "--threads", "1",
                              "--out", str(tmp_path)]) == 0
    row = json.loads((tmp_path / "hybrid.json").read_text())["families"]["lfm2"]["lengths"]["300"]
    assert set(row["cases"]) == {"repeat", "edit repeated"} and "decode" not in row
    assert all(case["exact"] for case in row["cases"].values())
    assert row["cases"]["repeat"]["cached"] == row["prompt_tokens"]
    assert row["cases"]["edit repeated"]["cached"] > row["prompt_tokens"] * 3 // 4
    summary = (tmp_path / "summary.md").read_text()
    assert "| edit repeated |" in summary and "decode off" not in summary


def test_bench_command_hands_its_arguments_to_the_suite():
    assert suite_root() == ROOT
    result = CliRunner().invoke(app, ["bench", "--help"])
    assert result.exit_code == 0 and "--quick" in result.output


def test_decode_budget_takes_the_native_step_apart():
    """perf.bench_decode on the tiny Llama: the step and its parts are measured, the parts are the
    decoder's own (weights = its projections, attention = its ``_attend``), the kernels' rates are
    positive; no timing assertions."""
    from pckernels.integration.native import NativeDecoder
    from perf import bench_decode

    torch.manual_seed(0)
    model = gpu_suite.random_llama(TINY_SHAPE, "cpu", torch.float32)
    decoder = NativeDecoder.build(model, [None] * model.config.num_hidden_layers)
    assert decoder is not None
    calls = {"attend": 0}
    original = decoder._attend

    def counted(*args):
        calls["attend"] += 1
        return original(*args)

    decoder._attend = counted
    parts = bench_decode.budget(decoder, 37, repeats=2)
    layers = len(decoder.layers)
    assert calls["attend"] == 2 * (1 + 2) * layers  # the step and the attention part: a warm-up and 2 repeats
    assert set(parts) == {"step", "weights", "attention", "rest"}
    assert all(parts[name] > 0 for name in ("step", "weights", "attention"))
    assert parts["rest"] == pytest.approx(parts["step"] - parts["weights"] - parts["attention"])
    rates = bench_decode.kernels(decoder, 37, repeats=1, pool_bytes=1 << 20)
    assert len(rates) == 5 and all(r > 0 for r in rates.values())
    assert bench_decode.weight_bytes(decoder) == sum(p.weight.numel() * 4 for p in decoder.projections())


def test_peer_weights_name_the_model_an_engine_runs():
    """llama.cpp gets the GGUF of the model promptcache runs: the embedded SmolLM2's quantization
    is read from its file; a model with no GGUF of its own has no peer weights."""
    from pckernels.integration.embedded import gguf_path
    from perf.peers import gguf_f32

    assert gguf_f32.file_type(gguf_path()) == "q4_1"
    assert gguf_f32.peer_weights("llama-2-7b-shaped") is None


@pytest.mark.parametrize("source, made", [("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct.F32.gguf"),
                                          ("qwen2.5-coder-0.5b-instruct-v1.gguf",
                                           "qwen2.5-coder-0.5b-instruct-v1.F32.gguf"),
                                          ("model.BF16.gguf", "model.F32.gguf")])
def test_f32_copies_are_named_after_their_source(tmp_path, monkeypatch, source, made):
    """The F32 copy drops a quantization tag and nothing else (a dotted version stays)."""
    from perf.peers import gguf_f32

    monkeypatch.setattr(gguf_f32, "write_f32", lambda src, target: Path(target).touch() or Path(target))
    assert gguf_f32.f32_of(tmp_path / source, tmp_path).name == made


def test_a_peer_whose_repacked_kernels_die_of_sigill_runs_without_repacking(monkeypatch):
    """llama.cpp's AMX kernels raise SIGILL on this VM's first read of a quantized model: the
    set-up is started again with repacking off (and says so); a worker that dies otherwise, or
    again without repacking, is left out; a healthy one keeps llama.cpp's default."""
    from perf.suite import peer as peer_mod

    started = []

    class FakePeer:
        def __init__(self, python):
            self.killed_by_sigill = False

        def load(self, model, *, repack, **kw):
            self.model, self.repack = model, repack
            started.append((model, repack))

        def prefill(self, ids):
            assert ids == peer_mod.PROBE
            if self.model == "amx" and self.repack or self.model == "broken":
                self.killed_by_sigill = self.model == "amx"
                raise RuntimeError("the llama.cpp worker exited (code -4)")

        def died_of_sigill(self):
            return self.killed_by_sigill

        def close(self):
            pass

    monkeypatch.setattr(peer_mod, "Peer", FakePeer)
    models = {"f32": "fine", "q4_k_m": "amx", "q4_1": "broken"}
    setups = {"llama.cpp f32": ("f32", False, "f16"), "llama.cpp q4_k_m": ("q4_k_m", False, "f16"),
              "llama.cpp q4_1": ("q4_1", False, "f16")}
    failed, no_repack = {}, []
    peers = peer_mod._Setups("python", models, setups, 4096, 2, failed, no_repack)
    assert sorted(peers.peers) == ["llama.cpp f32", "llama.cpp q4_k_m"]
    assert not peers.peers["llama.cpp q4_k_m"].repack and peers.peers["llama.cpp f32"].repack
    assert no_repack == ["llama.cpp q4_k_m"] and list(failed) == ["llama.cpp q4_1"]
    assert started == [("fine", True), ("amx", True), ("amx", False), ("broken", True)]
    started.clear()
    peer_mod._Setups("python", models, setups, 4096, 2, failed, no_repack)  # the next context
    assert started == [("fine", True), ("amx", False)]  # no second SIGILL, the left-out one not retried
