"""Run the selected experiments on one engine with a progress bar; write JSON, plots, markdown."""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import platform
import re
import sys
import time
from pathlib import Path

import torch

from pckernels.engine import PromptCache

from perf.suite import amortisation, concurrency, decode, hit_ratio, memory, peer, ttft, workloads
from perf.suite.config import SuiteConfig
from perf.suite.context import Bench, Ticker

log = logging.getLogger(__name__)

EXPERIMENT_MODULES = {"ttft": ttft, "workloads": workloads, "hit_ratio": hit_ratio, "amortisation": amortisation,
                      "memory": memory, "decode": decode, "concurrency": concurrency, "llamacpp": peer}
RESULTS_ROOT = Path(__file__).resolve().parents[1] / "results"
PARTIAL_NAME = "suite.partial.json"


def machine_name(device: torch.device | str = "cpu") -> str:
    """``cpu-<cores>c`` on CPU, the GPU's name (``nvidia-h200``) on CUDA."""
    device = torch.device(device)
    if device.type == "cuda":
        return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")
    return f"cpu-{os.cpu_count()}c"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


def cpu_isa() -> dict:
    """What the CPU offers the fp32/bf16 kernels, recorded beside every CPU figure: torch's
    dispatch level (``torch.backends.cpu.get_cpu_capability()``), the relevant /proc/cpuinfo
    flags, whether oneDNN bf16 matmuls run natively, and a one-line ``summary``
    ("AVX2+FMA, no AVX-512, no AMX, bf16 no")."""
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    from pckernels.integration.native import bf16_matmul_supported, default_cpu_path

    present = [f for f in ISA_FLAGS if f in flags]
    avx512, amx = "avx512f" in flags, "amx_tile" in flags
    bf16 = bf16_matmul_supported()
    base = "AVX2+FMA" if {"avx2", "fma"} <= flags else ("AVX2" if "avx2" in flags else "no AVX2")
    summary = (f"{base}, {'AVX-512' if avx512 else 'no AVX-512'}, {'AMX' if amx else 'no AMX'}, "
               f"bf16 {'yes' if bf16 else 'no'}; torch {torch.backends.cpu.get_cpu_capability()}")
    try:
        path = default_cpu_path()
    except ValueError as exc:
        path = str(exc)
    return {"capability": torch.backends.cpu.get_cpu_capability(), "flags": present, "avx512": avx512,
            "amx": amx, "bf16_matmul": bf16, "native_cpu_path": path, "summary": summary}


def environment(engine: PromptCache) -> dict:
    import transformers

    native = getattr(engine.adapter, "native", None)
    return {"machine": machine_name(engine.device), "cpu": cpu_model(), "cores": os.cpu_count(),
            "isa": cpu_isa(), "native_cpu_path": None if native is None else native.cpu_path,
            "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "device": str(engine.device), "dtype": str(engine.dtype),
            "matmul": engine.matmul, "numerics": engine.numerics, "prefix_resume": engine.prefix_resume,
            "model": engine.name, "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "started": datetime.datetime.now().isoformat(timespec="seconds")}


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def run_suite(engine: PromptCache, config: SuiteConfig, *, show_progress: bool = True,
              checkpoint: Path | None = None, resume: dict | None = None) -> dict:
    """Run ``config.experiments`` in order; returns the ``environment``, the ``config``, the
    ``experiments``' results, their ``seconds`` and ``elapsed_s``.

    The engine's store and the prefix cache are emptied between experiments so that each one
    starts from the same state and memory stays bounded. With ``checkpoint`` the results so far are
    written there (JSON, ``"complete": false``) after every experiment; ``resume`` is such a partial
    result of the same config: its finished experiments are kept and not run again."""
    env = environment(engine)
    load_start = _load_average()
    started = time.perf_counter()
    results: dict = {"environment": env, "config": config.to_dict(), "experiments": {}, "seconds": {},
                     "complete": False}
    if resume is not None:
        _check_resumable(resume, config)
        kept = [name for name in config.experiments if name in resume["experiments"]]
        results["experiments"] = {name: resume["experiments"][name] for name in kept}
        results["seconds"] = {name: resume["seconds"][name] for name in kept}
        results["resumed"] = {"experiments": kept, "environment": resume["environment"]}
        log.info("resuming: keeping %s from %s", ", ".join(kept) or "nothing", resume["environment"]["started"])
    progress = _progress() if show_progress else None
    bench = Bench(engine, config, Ticker(progress))
    with progress if progress is not None else contextlib.nullcontext():
        for name in config.experiments:
            if name in results["experiments"]:
                continue
            module = EXPERIMENT_MODULES[name]
            log.info("%s: %d measurements", name, module.steps(bench))
            bench.ticker.start(name, module.steps(bench))
            t0 = time.perf_counter()
            results["experiments"][name] = module.run(bench)
            bench.ticker.finish()
            results["seconds"][name] = time.perf_counter() - t0
            log.info("%s done in %.1f s", name, results["seconds"][name])
            bench.clear_caches()
            if checkpoint is not None:
                write_checkpoint(results, checkpoint)
    results["elapsed_s"] = time.perf_counter() - started
    env["peak_rss_gib"] = peak_rss_gib()
    load_end = _load_average()
    if load_start is not None and load_end is not None:
        cores = os.cpu_count() or 1
        env["load_average"] = {"start": load_start, "end": load_end,
                               "busy": max(load_start, load_end) > cores + 0.5}
    results["complete"] = True
    return results


def peak_rss_gib() -> float:
    """The process's peak resident memory so far, in GiB (``ru_maxrss`` is KiB on Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _check_resumable(previous: dict, config: SuiteConfig) -> None:
    """Refuse to mix results measured with different settings."""
    old = dict(previous.get("config") or {})
    new = config.to_dict()
    old.pop("experiments", None)
    new.pop("experiments", None)
    if old != new:
        changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        raise ValueError(f"cannot resume: the earlier run's settings differ in {', '.join(changed)}")


def write_checkpoint(results: dict, path: Path) -> None:
    """The results so far as JSON at ``path``, replaced atomically (a killed run leaves the last one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".part")
    partial.write_text(json.dumps(results, indent=1, default=str))
    os.replace(partial, path)


def read_checkpoint(path: Path) -> dict | None:
    """A previous run's results at ``path``, or ``None`` when there is none."""
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def _progress():
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)

    return Progress(SpinnerColumn(), TextColumn("{task.description:<13}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TimeRemainingColumn())


def write_results(results: dict, out_dir: Path) -> Path:
    """JSON, plots and the markdown summary in ``out_dir``; returns the summary's path."""
    from perf.suite import plots, report

    out_dir.mkdir(parents=True, exist_ok=True)
    env = results["environment"]
    title = f"promptcache on {env['machine']} — {env['model']} ({env['dtype']}), {env['threads']} threads"
    written = plots.write_plots(results, out_dir, title)
    return report.write(results, out_dir, written)


def default_out_dir(engine: PromptCache, config: SuiteConfig) -> Path:
    return RESULTS_ROOT / machine_name(engine.device) / config.name
