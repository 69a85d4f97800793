#!/usr/bin/env bash
# FP8 on the H100, in one device call after `bash tests/gpu/device.sh setup`:
#   bash bench/fp8_gpu.sh            (logs and JSON under $OUT)
# 1. the FP8 GPU tests; 2. one-batch decode, Llama-3.1-8B shapes (dummy weights), bf16 vs FP8 weights
# (kernel chosen per shape) vs FP8 with _scaled_mm forced, and FP8 weights + FP8 KV; 3. offline
# throughput bf16 vs FP8; 4. tiny-model logits FP8 vs bf16 (GPU and CPU).
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-/tmp/site}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
stage() { echo "=== $1 ($(date +%T))"; }
stage tests
timeout ${FP8_TESTS_TIMEOUT:-100} python3 -m pytest -q -x -p no:randomly tests/gpu/test_fp8_gpu.py 2>&1 | tee "$OUT/fp8_tests.log" | tail -15
stage one-batch
timeout ${FP8_ONE_BATCH_TIMEOUT:-150} python3 -m treadle.bench.one_batch --backends triton --graphs on \
  --batch-sizes 1,32 --decode-steps 64 --no-hf --no-profile --output "$OUT/fp8_one_batch.json" \
  --compare "model.quantization=null,model.quantization=fp8,model.quantization=fp8;fp8_small_batch_kernel=scaled_mm,model.quantization=fp8;cache.kv_dtype=fp8_e4m3" \
  2>&1 | grep -v "it/s\]\|Warning\|warn(" | tee "$OUT/fp8_one_batch.log" | tail -14
stage offline
python3 -c "import json; from treadle.bench.one_batch import LLAMA_3_1_8B as c; import os; os.makedirs('/tmp/l8b', exist_ok=True); json.dump(c, open('/tmp/l8b/config.json', 'w'))"
timeout ${FP8_OFFLINE_TIMEOUT:-120} python3 -m treadle.bench.offline_throughput --workload random --num-prompts 128 \
  --input-len 64:512 --output-len 32:256 --set model.path=/tmp/l8b --set model.load_format=dummy \
  --set model.context_length=4096 --set attention.backend=triton --dtype bfloat16 --device cuda --no-progress \
  --compare "model.quantization=null,model.quantization=fp8" --output "$OUT/fp8_offline.json" \
  2>&1 | grep -v "it/s\]\|Warning\|warn(" | tee "$OUT/fp8_offline.log" | tail -8
stage accuracy
timeout ${FP8_ACCURACY_TIMEOUT:-60} python3 -m treadle.bench.fp8_accuracy --device cuda --skip-smollm2 \
  --output "$OUT/fp8_accuracy_gpu.json" 2>&1 | grep -v "it/s\]" | tail -30
stage done
