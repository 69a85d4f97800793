#!/usr/bin/env bash
# vLLM 0.26 beside treadle's figures on the GPU machine: the bs=1 / bs=32 decode step of Llama-3.1-8B shapes at
# tp=1 and tp=2, in W4A16 (compressed-tensors, as `treadle bench quant` writes it) and with 32 rank-16 adapters (as
# `treadle bench lora` writes them). vLLM's packages come from ../shared/device/vllm_peer.sh, in parts that fit the
# device tool's 64 MiB a call beside this tree (~26 MiB): here, once,
#
#   echo /.vllm/ >> .git/info/exclude && ../shared/device/vllm_peer.sh pack .vllm
#   (cd .vllm && cat part* > /tmp/v.tgz && rm part* && split -b 32m -d /tmp/v.tgz part && rm /tmp/v.tgz)
#
# then one device call per part while the machine stays warm (each ~10 s; an idle machine goes back after 30 s):
#
#   run(kind="nvidia-h200-x4", carry=[".vllm/part00"], command="mkdir -p /tmp/vc && cp .vllm/part00 /tmp/vc/")
#   ... part01 .. part06
#   run(carry=[".whl"], command="bash tests/gpu/device.sh setup && export PYTHONPATH=/tmp/site:/tmp/pkg &&
#       bash tests/gpu/vllm_peer.sh unpack configs runs")
#
# (checked on 2 x H200, 2026-11-28: seven part calls ~35 s of device time in all; `single` 270 s, `tp2` ~250 s
# with TP2_ARGS=--no-ar-fusion, since vLLM's default all-reduce + RMSNorm fusion faulted there; `marlin` 106 s.)
#
# Stages: unpack (/tmp/vc/part* -> /tmp/vsite); configs (the shapes' config.json and the adapters, by treadle);
# runs (4 GPUs, ~6 min with vLLM's start-ups: GPU 0 bf16 then the adapters, GPU 1 W4A16, GPUs 2-3 tp=2; on 2 GPUs
# the stages `single` (GPU 0 bf16 then the adapters, GPU 1 W4A16) and `tp2`, one device call each; `marlin`: W4A16
# on GPU 0 with vLLM's Marlin kernel instead of Machete; `offline`: the 1000-request offline run of `treadle bench
# quant` in bf16 and W4A16 side by side on 2 GPUs, its requests written by `configs`; `tp4_70b`: Llama-3.1-70B
# shapes at tp=4, bs=1, on 4 GPUs, TP2_ARGS applying here too), each
# writing $OUT/vllm_*.json. treadle's counterparts, timed the same way (Engine.generate): `python -m
# treadle.bench.tp_step_broadcast --skip-latency --backend auto --rounds 1 --modes tp1` (and `--modes auto`; for
# `tp4_70b` `--modes auto --tp 4 --shape llama-3.1-70b`),
# `python -m treadle.bench.quant --runs one-batch --precompile 14` (not `--quick`, which times synchronized graph
# steps instead), `python -m treadle.bench.lora --part engine`.
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
HERE=$(cd "$(dirname "$0")" && pwd)
peer() {  # $1 = GPUs, $2 = tag, rest: vllm_peer.py arguments (vLLM's packages only on the path)
  local gpus=$1 tag=$2; shift 2
  local log="$OUT/vllm_$tag.log"
  CUDA_VISIBLE_DEVICES=$gpus PYTHONPATH=/tmp/vsite timeout "${PEER_TIMEOUT:-420}" python3 "$HERE/vllm_peer.py" "$@" \
    --output "$OUT/vllm_$tag.json" > "$log" 2>&1 &
  local pid=$!
  # A worker that faults leaves the engine waiting until the timeout: stop at the first sign of it.
  while kill -0 $pid 2>/dev/null; do
    if grep -qE "Worker failed|illegal memory access|^Traceback" "$log"; then
      sleep 3; kill $pid 2>/dev/null; pkill -9 -f "$HERE/vllm_peer.py" 2>/dev/null
      nvidia-smi --query-compute-apps=pid --format=csv,noheader | xargs -r kill -9 2>/dev/null; break
    fi
    sleep 2
  done
  wait $pid
  echo "vllm $tag rc $?: $(grep -E '^vllm ' "$log" | tr '\n' ' ')"
}
for stage in "$@"; do
  t0=$(date +%s)
  case $stage in
    unpack) cat /tmp/vc/part* | tar xzf - -C /tmp && PYTHONPATH=/tmp/vsite python3 -c "import vllm; print('vllm', vllm.__version__)" ;;
    configs)
      for shape in llama-3.1-8b llama-3.1-8b-w4a16 llama-3.1-70b; do python3 -m treadle.bench.shapes "$shape" "/tmp/$shape"; done
      python3 - <<'PY'
import json
from pathlib import Path
from treadle.bench.lora_engine import write_adapters
config = json.loads(Path("/tmp/llama-3.1-8b/config.json").read_text())
print(len(write_adapters(Path("/tmp/lora16"), config, 32, 16, device="cuda")), "adapters in /tmp/lora16")
from treadle.bench.workloads import random_workload
work = random_workload(1000, range(config["vocab_size"]), (16, 600), (16, 400), seed=0)  # bench offline's default
Path("/tmp/offline_random.json").write_text(json.dumps([[r.input_ids, r.output_len] for r in work.requests]))
print(work.input_tokens, "in,", work.output_tokens, "out tokens in /tmp/offline_random.json")
PY
      ;;
    runs)  # 4 GPUs: everything side by side; fewer: `single`, then `tp2`
      if [ "$(nvidia-smi -L | wc -l)" -lt 4 ]; then bash "$0" single tp2; continue; fi
      (peer 0 bf16 --model /tmp/llama-3.1-8b; peer 0 lora --model /tmp/llama-3.1-8b --lora-dir /tmp/lora16) &
      peer 1 w4a16 --model /tmp/llama-3.1-8b-w4a16 &
      peer 2,3 tp2 --model /tmp/llama-3.1-8b --tp 2 --batch-sizes 1 &
      wait ;;
    single)  # 2 GPUs: bf16 then the adapters on GPU 0, W4A16 on GPU 1
      (peer 0 bf16 --model /tmp/llama-3.1-8b; peer 0 lora --model /tmp/llama-3.1-8b --lora-dir /tmp/lora16) &
      peer 1 w4a16 --model /tmp/llama-3.1-8b-w4a16 &
      wait ;;
    tp2) peer 0,1 tp2 --model /tmp/llama-3.1-8b --tp 2 --batch-sizes 1 ${TP2_ARGS:-} ;;
    tp4_70b) peer 0,1,2,3 tp4_70b --model /tmp/llama-3.1-70b --tp 4 --batch-sizes 1 ${TP2_ARGS:-} ;;  # 4 GPUs
    offline)  # 2 GPUs: treadle's 1000-request random workload, bf16 on GPU 0, W4A16 (Machete) on GPU 1
      peer 0 offline_bf16 --model /tmp/llama-3.1-8b --offline /tmp/offline_random.json --max-model-len 1088 &
      peer 1 offline_w4a16 --model /tmp/llama-3.1-8b-w4a16 --offline /tmp/offline_random.json --max-model-len 1088 &
      wait ;;
    marlin)  # vLLM's other W4A16 kernel (Machete is its Hopper default)
      VLLM_DISABLED_KERNELS=MacheteLinearKernel peer 0 w4a16_marlin --model /tmp/llama-3.1-8b-w4a16 ;;
    *) echo "unknown stage $stage" ;;
  esac
  echo "STAGE $stage took $(( $(date +%s) - t0 )) s"
done
