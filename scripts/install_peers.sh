#!/usr/bin/env bash
# Peer tools the interop tests and benchmarks/quality.py compare against:
# GPTQModel 7.7 (sdist; --no-deps because it asks for a newer torch than the pinned CPU
# build, which it runs fine with) and what it imports; optimum for transformers' GPTQ path;
# bitsandbytes (NF4 through transformers, on CPU) for the quality table.
# A failure here does not stop the suite: the interop tests then skip, and say why.
set -uo pipefail
cd "$(dirname "$0")/.."
if ! python -m pip install -q --no-deps gptqmodel==7.7.0 || ! python -m pip install -q \
    device-smi==0.5.7 pypcre==0.6.4 tokenicer==0.0.14 logbar==0.4.15 defuser==0.0.28 datasets==5.2.0 \
    threadpoolctl==3.8.0 protobuf==7.36.2 pillow==13.0.0 torchao==0.18.0 dill==0.4.1 pyarrow==26.0.1 \
    ninja==1.13.2 optimum==2.3.0 torch==2.13.0; then
  echo "WARNING: GPTQModel could not be installed; the GPTQ interop tests will be skipped" >&2
fi
if ! python -m pip install -q --no-deps bitsandbytes==0.50.2; then
  echo "WARNING: bitsandbytes could not be installed; benchmarks/quality.py skips its NF4 row" >&2
fi
exit 0
