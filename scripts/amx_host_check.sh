#!/usr/bin/env bash
# Issue 17's AMX timings, on a GPU machine's host CPU where it has AMX (Intel Xeon,
# Sapphire Rapids on). No session since 2026-12-02 has had an AMX machine of its own,
# and the device tool's GPU machines often sit on one; their 15 minutes are best spent
# here while issue 17 is open. Run THERE, from the repository root, after
# scripts/gpu_prepare.sh ran here (it also saves the GEMM sources compared below into
# .gpu/), with .whl and .gpu carried, in two calls of ~5 minutes (PART=1, then PART=2 on
# the same warm machine, if the first found AMX):
#   run(command="PART=1 bash scripts/amx_host_check.sh", carry=[".whl", ".gpu"], timeout_s=420)
#   run(command="PART=2 bash scripts/amx_host_check.sh", carry=[".whl", ".gpu"], timeout_s=420)
# The kernels are built first on every core; everything timed runs on two physical cores
# (taskset), as on the issue's 2-core machines.
# PART=1:
#   1. the AMX paths' tests natively (the GEMM's and attention's AMX cases, the decoder
#      stack), which elsewhere run only on emulated tiles;
#   2. the GEMM in one process, alternating builds (genoa14/gemm_ab.py): the AMX store
#      before 8addefc against after it, the AMX tiles under the shared driver (2afa006)
#      against their static split, and HEAD's AMX path against its AVX512-BF16 path;
#   3. `kvloom bench roofline` on a random-weight model of the default model's shape
#      (the GGUF does not travel), with AMX and with it capped off.
# PART=2:
#   4. decode steps at batch 32 / 64 / 128 as one walk, two, and two fetching KV
#      (genoa15/amx_walks.py): both rules were measured on AMD EPYC only;
#   5. the offline ShareGPT run (200 requests) on that model, with AMX and capped off.
# Without AMX (or without Linux's permission for it) it records the CPU and stops.
# Results: $OUT (the device tool's; one archive plus the log) or docs/results/amx_host/.
# FORCE=1 PYTHON=.venv/bin/python bash scripts/amx_host_check.sh: the same stages, tiny,
# with AVX512-BF16 standing in for AMX, on any AVX512-BF16 machine (checks the script).
set -uo pipefail
force=${FORCE:-0}
part=${PART:-1}
work=/tmp/amx-results-$part
rm -rf "$work" && mkdir -p "$work"
out=$work
export PYTHONUNBUFFERED=1 KVLOOM_HOME=/tmp/kvloom-home TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=2
if [ -d .whl ] && [ "$force" != 1 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
py=${PYTHON:-python3}
stage() { echo "== $1 ($(date +%T))" | tee -a "$out/log.txt"; }
finish() {
  stage "done"
  if [ -n "${OUT:-}" ]; then
    tar czf "$OUT/amx_results_$part.tar.gz" -C "$work" . && cp "$work/log.txt" "$OUT/log_$part.txt"
  else
    mkdir -p docs/results/amx_host/part$part && cp -r "$work"/. docs/results/amx_host/part$part/
  fi
  exit 0
}

# Two logical CPUs on different physical cores (a VM's siblings would share one core's units).
cpus=$(lscpu -p=CPU,CORE,SOCKET | grep -v '^#' | awk -F, '!seen[$2 "," $3]++ {print $1}' | head -2 | paste -sd,)
pin=(taskset -c "$cpus")
command -v taskset > /dev/null || { pin=(); cpus="none (no taskset here: 2 OpenMP threads, unpinned)"; }
{ lscpu; echo "pinned to CPUs $cpus"; command -v g++ && g++ --version | head -1
  "${pin[@]}" $py -c "import torch; from kvloom.kernels import gemm; print('torch', torch.__version__, 'threads', torch.get_num_threads(), 'GEMM paths', gemm.supported_isas())"
} > "$out/cpu.txt" 2>&1
cat "$out/cpu.txt" >> "$out/log.txt"
amx=amx
if [ "$force" = 1 ]; then
  amx=avx512_bf16
elif ! grep -q "GEMM paths.*'amx'" "$out/cpu.txt"; then
  echo "no AMX path here (the CPU lacks it, or Linux refused its tile state): nothing to time" | tee -a "$out/log.txt"
  finish
fi
isa=$([ "$amx" = amx ] && echo 4 || echo 3)

stage "kernels built (every core)"
timeout 240 $py -c "from kvloom import native
for name in ('gemm', 'paged_attention', 'cpu_ops', 'decoder_stack', 'sampling', 'shm_collectives'): native.load(name)" \
  >> "$out/log.txt" 2>&1; echo "rc=$?" | tee -a "$out/log.txt"

stage "random-weight model"
timeout 120 $py - > "$out/model.txt" 2>&1 <<'PY'
import json
from pathlib import Path
from kvloom.bench.families import FAMILIES, write_family
from kvloom.tokenizer import Tokenizer
saved = Path(".gpu/tokenizer")
tokenizer = Tokenizer.from_file(saved / "tokenizer.json", json.loads((saved / "tokenizer_config.json").read_text()))
write_family(FAMILIES["llama"], Path("/tmp/models/smollm2-135m"), tokenizer)
print("written")
PY
echo "model rc=$?" | tee -a "$out/log.txt"

if [ "$part" = 2 ]; then
  # Whether decode steps should split into two walks, and fetch KV as they do, on AMX too.
  for batch in $([ "$force" = 1 ] && echo 32 || echo 32 64 128); do
    stage "one walk or two, batch $batch"
    MODEL=/tmp/models/smollm2-135m timeout 100 "${pin[@]}" $py docs/results/issue17/genoa15/amx_walks.py $batch \
      $([ "$force" = 1 ] && echo 1 || echo 4) 300 > "$out/walks_$batch.txt" 2>&1
    echo "rc=$?" | tee -a "$out/log.txt"; cat "$out/walks_$batch.txt" >> "$out/log.txt"
  done
  for cap in $amx avx512_bf16; do
    stage "offline ShareGPT, paths capped at $cap"
    KVLOOM_CPU_ISA=$cap timeout 140 "${pin[@]}" $py -m kvloom bench offline /tmp/models/smollm2-135m --dtype bfloat16 \
      --dataset sharegpt --num-prompts $([ "$force" = 1 ] && echo 8 || echo 200) --max-num-seqs 256 \
      --output-json "$out/offline_$cap.json" > "$out/offline_$cap.txt" 2>&1
    echo "rc=$?" | tee -a "$out/log.txt"; tail -4 "$out/offline_$cap.txt" >> "$out/log.txt"
    [ "$force" = 1 ] && break
  done
  finish
fi

stage "AMX tests natively"
tests=(tests/kernels/test_gemm.py tests/kernels/test_paired_attention_path.py tests/attention)
[ "$force" = 1 ] && tests=(tests/kernels/test_gemm.py)
timeout 180 "${pin[@]}" $py -m pytest -q -p no:cacheprovider "${tests[@]}" -k "$amx" > "$out/tests.txt" 2>&1
echo "tests rc=$? $(tail -1 "$out/tests.txt")" | tee -a "$out/log.txt"
[ "$force" != 1 ] && { timeout 120 "${pin[@]}" $py -m pytest -q -p no:cacheprovider tests/models/test_decoder_stack.py \
  > "$out/tests_decoder_stack.txt" 2>&1; echo "decoder stack rc=$? $(tail -1 "$out/tests_decoder_stack.txt")" | tee -a "$out/log.txt"; }

ab=docs/results/issue17/genoa14/gemm_ab.py
rounds=$([ "$force" = 1 ] && echo 2 || echo 6)
shapes=$([ "$force" = 1 ] && echo 3072x576x16 || echo 3072x576x1,3072x576x16,3072x576x64,576x1536x64,960x576x32,3072x576x2048)
ab() {  # label A_DIR B_DIR [ISA_B]
  stage "GEMM A/B: $1"
  ISA=$isa ISA_B=${4:-$isa} SHAPES=$shapes timeout 150 "${pin[@]}" $py $ab "$2" "$3" $rounds > "$out/gemm_$1.txt" 2>&1
  echo "rc=$?" | tee -a "$out/log.txt"; cat "$out/gemm_$1.txt" >> "$out/log.txt"
}
ab store_8addefc .gpu/csrc_before_store .gpu/csrc_before_driver  # A: scalar store, B: the vector store
ab driver_2afa006 .gpu/csrc_before_driver kvloom/csrc            # A: static split, B: run_vector (+ side stream)
[ "$force" != 1 ] && ab amx_vs_avx512_bf16 kvloom/csrc kvloom/csrc 3  # A: AMX, B: AVX512-BF16, one build

batches=$([ "$force" = 1 ] && echo 1,16 || echo 1,16,64)
steps=$([ "$force" = 1 ] && echo 3 || echo 20)
for cap in $amx avx512_bf16; do
  stage "roofline, paths capped at $cap"
  KVLOOM_CPU_ISA=$cap timeout 150 "${pin[@]}" $py -m kvloom bench roofline /tmp/models/smollm2-135m --batches $batches \
    --context 300 --steps $steps > "$out/roofline_$cap.txt" 2>&1
  echo "rc=$?" | tee -a "$out/log.txt"; cat "$out/roofline_$cap.txt" >> "$out/log.txt"
  [ "$force" = 1 ] && break
done
finish
