#!/usr/bin/env bash
# FP8 on the H100, in one device call after `bash tests/gpu/device.sh setup`:
#   bash bench/fp8_gpu.sh            (logs and JSON under $OUT)
# Stages, most important first (each has its own timeout, so a short lease still returns the first ones):
# 1. linear kernels at the 8B shapes; 2. one-batch decode, Llama-3.1-8B shapes (dummy weights), bf16 vs
# FP8 weights; 3. the FP8 GPU tests, FP8 KV included (triton; FlashInfer would JIT-compile for minutes on
# a fresh machine); 4. tiny-model logits FP8 vs bf16 (GPU and CPU); 5. offline throughput bf16 vs FP8.
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-/tmp/site}
[ -d /tmp/pkg ] && export PYTHONPATH=/tmp/site:/tmp/pkg
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
stage() { echo "=== $1 ($(date +%T))"; }
quiet() { grep -v "it/s\]\|Warning\|warn(\|\[transformers\]"; }
stage linear
timeout 60 python3 -m treadle.bench.small_batch_linear --rows 1,32 --output "$OUT/small_batch_linear.json" 2>&1 | quiet | tail -70
stage one-batch
timeout 70 python3 -m treadle.bench.one_batch --backends triton --graphs on --batch-sizes 1,32 --decode-steps 64 \
  --no-hf --no-profile --output "$OUT/fp8_one_batch.json" \
  --compare "model.quantization=null,model.quantization=fp8" \
  2>&1 | quiet | tee "$OUT/fp8_one_batch.log" | tail -12
stage tests
timeout 45 python3 -m pytest -q -x -p no:randomly -k "not flashinfer" tests/gpu/test_fp8_gpu.py 2>&1 | tee "$OUT/fp8_tests.log" | tail -12
stage accuracy
timeout 20 python3 -m treadle.bench.fp8_accuracy --device cuda --skip-smollm2 --output "$OUT/fp8_accuracy_gpu.json" \
  2>&1 | quiet | tail -28
stage offline
python3 -c "import json, os; from treadle.bench.shapes import LLAMA_3_1_8B as c; os.makedirs('/tmp/l8b', exist_ok=True); json.dump(c, open('/tmp/l8b/config.json', 'w'))"
timeout 60 python3 -m treadle.bench.offline_throughput --workload random --num-prompts 128 \
  --input-len 64:512 --output-len 32:256 --set model.path=/tmp/l8b --set model.load_format=dummy \
  --set model.context_length=4096 --set attention.backend=triton --dtype bfloat16 --device cuda --no-progress \
  --compare "model.quantization=null,model.quantization=fp8" --output "$OUT/fp8_offline.json" \
  2>&1 | quiet | tail -6
stage done
