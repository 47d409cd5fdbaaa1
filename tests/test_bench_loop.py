"""``perf/bench_loop.py``'s logic on a tiny model in seconds (its numbers come from the real run)."""

from __future__ import annotations

from perf import bench_loop
from test_engine_prefix import BLOCK, engine
from test_families import tokenizer  # noqa: F401  (fixture)


def test_gaps_count_the_intervals_that_overlap_a_window():
    times = [0.0, 1.0, 1.5, 4.0, 4.5]
    assert bench_loop.gaps(times) == [1.0, 0.5, 2.5, 0.5]
    assert bench_loop.gaps(times, 1.2, 3.0) == [0.5, 2.5]  # [1, 1.5] and [1.5, 4] overlap it
    assert bench_loop.gaps(times, 4.6, 5.0) == []


def test_a_small_run_measures_every_number(tokenizer):  # noqa: F811
    pc = engine(tokenizer, step_tokens=2 * BLOCK)
    out = bench_loop.measure(pc, prompt_tokens=6 * BLOCK, streams=2, step_tokens=2 * BLOCK,
                             stream_tokens=100, decode_streams=(1, 2), decode_tokens=8)
    for name in ("median_gap_decoding", "one_step", "longest_gap_while_read", "median_gap_while_read",
                 "ttft_alone", "ttft_with_streams"):
        assert out[name] is not None and out[name] > 0, name
    assert out["ttft_ratio"] == out["ttft_with_streams"] / out["ttft_alone"]
    assert set(out["decode_tokens_per_s"]) == {1, 2} and all(r > 0 for r in out["decode_tokens_per_s"].values())
    assert pc.scheduler.arena.referenced_rows() == 0
    text = bench_loop.table([{**out, "pckernels": "here"}])
    assert "| here |" in text and "step_tokens=32" in text and "decode tokens/s, 2 streams" in text


def test_a_burst_times_each_prompt_and_leaves_the_phases_out(tokenizer):  # noqa: F811
    pc = engine(tokenizer)
    out = bench_loop.measure(pc, prompt_tokens=0, streams=0, step_tokens=2048, burst=3, burst_tokens=3 * BLOCK)
    ttfts = out["burst"]["ttfts"]
    assert len(ttfts) == 3 and all(t > 0 for t in ttfts)
    # the order itself (each first token as soon as its prompt is read) is tests/test_engine_reading.py's
    assert "ttft_alone" not in out and pc.scheduler.arena.referenced_rows() == 0
    text = bench_loop.table([{**out, "pckernels": "here"}])
    assert "burst of 3 cold 48-token prompts" in text and "| here |" in text and "gap / step" not in text
