#!/usr/bin/env bash
# Issue 23's GPU check, within 8 minutes, offline: run THERE (a GPU machine), from the
# repository root, after scripts/gpu_prepare.sh ran here and with .whl and .gpu carried.
#   1. The CUDA test subset: the Triton kernels natively (pytest -k triton) and the
#      HF-parity tests, whose engines run on CUDA (device auto), plus the state-space
#      and MLA families.
#   2. Benchmarks on random-weight models with the default model's tokenizer: its own
#      shape (SmolLM2-135M) and Llama-3.2-1B's: offline ShareGPT (1,000 prompts), decode
#      step times by batch size (against the HBM bound: weights + KV read per step),
#      and a serving run at concurrency 64; the offline run again with overlap
#      scheduling off, to measure what it buys.
# Results: $OUT (the device tool's) or docs/results/gpu/.
# QUICK=1 PYTHON=.venv/bin/python bash scripts/gpu_check.sh: the same stages, tiny, on
# any machine (checks the script itself; the wheels are not installed then).
set -uo pipefail
quick=${QUICK:-0}
prompts=$([ "$quick" = 1 ] && echo 8 || echo 1000)
models=$([ "$quick" = 1 ] && echo smollm2-135m || echo "smollm2-135m llama-1b")
# Everything is written to $work; at the end it goes to $OUT as one archive (the device
# tool brings back at most 8 files) with the log and the test output beside it, or, with
# no $OUT, into docs/results/gpu/.
work=/tmp/gpu-results
rm -rf "$work" && mkdir -p "$work"
out=$work
export PYTHONUNBUFFERED=1 KVLOOM_HOME=/tmp/kvloom-home TOKENIZERS_PARALLELISM=false
if [ -d .whl ] && [ "$quick" != 1 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
py=${PYTHON:-python3}
stage() { echo "== $1 ($(date +%T))" | tee -a "$out/log.txt"; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $py -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
} > "$out/gpu.txt" 2>&1

stage "CUDA tests"
tests=(tests/attention/test_triton_attention.py tests/attention/test_triton_decode_graphs.py
       tests/models/test_triton_ops.py tests/models/test_hf_parity.py
       tests/engine/test_overlap_scheduling.py tests/attention/test_optional_cuda_backends.py
       tests/models/test_ssm_prefix_cache.py tests/models/test_deepseek.py
       tests/attention/test_attention_sinks.py)
[ "$quick" = 1 ] && tests=(tests/models/test_triton_ops.py)
timeout 200 $py -m pytest -q -p no:cacheprovider "${tests[@]}" > "$out/tests.txt" 2>&1
echo "tests rc=$?" | tee -a "$out/log.txt"

stage "random-weight models"
timeout 150 $py - > "$out/models.txt" 2>&1 <<'PY'
import json
import os
from pathlib import Path
from kvloom.bench.families import FAMILIES, _SMOLLM, write_family
from kvloom.tokenizer import Tokenizer
saved = Path(".gpu/tokenizer")
tokenizer = Tokenizer.from_file(saved / "tokenizer.json", json.loads((saved / "tokenizer_config.json").read_text()))
write_family(FAMILIES["llama"], Path("/tmp/models/smollm2-135m"), tokenizer)
llama_1b = {**_SMOLLM, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8, "architectures": ["LlamaForCausalLM"]}
if os.environ.get("QUICK") != "1":
    write_family(("LlamaConfig", llama_1b), Path("/tmp/models/llama-1b"), tokenizer)
print("written")
PY
echo "models rc=$?" | tee -a "$out/log.txt"

for model in $models; do
  stage "offline ShareGPT 1000: $model"
  timeout 120 $py -m kvloom bench offline /tmp/models/$model --dataset sharegpt --num-prompts $prompts --dtype bfloat16 \
    --output-json "$out/offline_$model.json" > "$out/offline_$model.txt" 2>&1; echo "rc=$?" | tee -a "$out/log.txt"
  stage "decode steps: $model"
  timeout 60 $py -m kvloom bench steps --model /tmp/models/$model --dtype bfloat16 --batches $([ "$quick" = 1 ] && echo 1,4 || echo 1,16,64,256) \
    --context $([ "$quick" = 1 ] && echo 64 || echo 512) --prefill $([ "$quick" = 1 ] && echo 1x64 || echo 1x512,8x512) \
    --decode-steps 5 --output-json "$out/steps_$model.json" > "$out/steps_$model.txt" 2>&1
  echo "rc=$?" | tee -a "$out/log.txt"
done
# The same offline run with every step synchronous: what overlap scheduling buys.
stage "offline ShareGPT 1000, overlap scheduling off: smollm2-135m"
timeout 120 $py -m kvloom bench offline /tmp/models/smollm2-135m --dataset sharegpt --num-prompts $prompts \
  --dtype bfloat16 --overlap-scheduling off --output-json "$out/offline_smollm2-135m_sync.json" \
  > "$out/offline_smollm2-135m_sync.txt" 2>&1; echo "rc=$?" | tee -a "$out/log.txt"

stage "serving, concurrency 64: smollm2-135m"
$py -m kvloom serve /tmp/models/smollm2-135m --dtype bfloat16 --port 8123 > "$out/serve_log.txt" 2>&1 &
server=$!
$py - <<'PY'
import time, httpx
for _ in range(120):  # the server loads the model first
    try:
        if httpx.get("http://localhost:8123/health", timeout=2).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    time.sleep(0.5)
PY
timeout 120 $py -m kvloom bench serve --base-url http://localhost:8123 --dataset sharegpt --num-prompts $((prompts / 2)) \
  --max-concurrency 64 --output-json "$out/serve_c64.json" > "$out/serve_c64.txt" 2>&1; echo "rc=$?" | tee -a "$out/log.txt"
kill $server 2>/dev/null
stage "done"
if [ -n "${OUT:-}" ]; then
  tar czf "$OUT/gpu_results.tar.gz" -C "$work" . && cp "$work/log.txt" "$work/tests.txt" "$work/gpu.txt" "$OUT/"
else
  mkdir -p docs/results/gpu && cp -r "$work"/. docs/results/gpu/
fi
