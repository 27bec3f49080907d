#!/usr/bin/env bash
# Installs everything, checks style, and runs the test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
bash scripts/install_peers.sh
python -m ruff check qpage tests benchmarks scripts
python -m pytest -q "$@"
