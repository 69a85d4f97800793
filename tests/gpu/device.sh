#!/usr/bin/env bash
# Runs the GPU tests and benchmarks on the device machine (Python 3.12, torch + CUDA, triton,
# transformers; no network). Set-up here, once per session:
#
#   echo /.whl/ >> .git/info/exclude        # .gitignore already ignores .whl/
#   ../shared/device/wheels.sh .whl          # FlashInfer, pydantic, fastapi, pyzmq, gguf, ... (~45 MB)
#
# then, through the device tool with carry [".whl"]:
#
#   bash tests/gpu/device.sh setup tests bench         # BENCH_ARGS="--backends triton,flashinfer --graphs on"
#
# The tool carries at most 64 MiB: the tree (~26 MiB) plus .whl (~38 MiB) is just over. WHEELS names another
# folder of wheels to install instead, e.g. one without compressed_tensors and loguru (only
# tests/gpu/test_quantization_gpu.py imports compressed_tensors):
#
#   mkdir .whl_slim && ln .whl/*.whl .whl_slim/ && rm .whl_slim/compressed_tensors* .whl_slim/loguru*
#   echo /.whl_slim/ >> .git/info/exclude     # then carry [".whl_slim"] and run with WHEELS=.whl_slim
#   bash tests/gpu/device.sh setup offline             # OFFLINE_ARGS="--backends triton,flashinfer"
#
# `soak` runs the serving soak (bench/soak.py) on Llama-3.1-8B shapes at 80% of its saturated request rate;
# `soak_bg` starts it in the background and `soak_wait` (a later call) collects it, for soaks past one call.
# `offline` runs `treadle bench offline` on Llama-3.1-8B shapes (dummy weights, bf16, the folder /tmp/l8b
# holding only its config.json; OFFLINE_SHAPE=qwen3-30b-a3b for another of bench/shapes.py's MODEL_SHAPES) with
# the 1000-request `random` workload of docs/benchmarks.md and the default config; OFFLINE_ARGS adds variants
# (--compare / --backends) and options (--profile-steps 20).
# `gputests` runs the pytest files in GPU_TESTS (default: all of tests/gpu).
# `speculative` runs bench/speculative.py (oracle machinery on Llama-3.1-8B shapes, ngram on SmolLM2).
# `spec_cost` runs bench/speculative_cost.py: eagle3's step time with and without overlapped verify (about 3 min).
# `lora` runs `treadle bench lora` (kernels, then end to end; LORA_ARGS="--part kernels" for the kernels only).
# `embed` runs bench/embed.py (embeddings/s against HF); `vl` runs bench/vl.py (images against text-only).
# `quant` runs bench/quant.py: W4A16 against bf16 on Llama-3.1-8B shapes (one-batch bs=1/32, offline).
# `quant_kernels` runs bench/quant_kernels.py --moe: the integer kernels per shape against bf16 (about 1.5 min),
# then every form of the W4A16 MoE experts (bench/quant_moe.py); QUANTK_ARGS="--moe-only" runs only those (~2 min).
# `quant_large` runs bench/quant_kernels.py --large: W4A16 above DOT_MAX_ROWS rows (dequantize, then cuBLAS) against
# bf16 at 128/256/512 rows, the dequantization alone against the copy bandwidth (about a minute; QUANTL_ARGS adds options).
# `quant_sweep` runs bench/quant_kernels.py --sweep: every W4A16 kernel variant and config, kernels/packed_int_mma.py's
# candidates included, at rows 1-64 against bf16 and the roofline (about 3 min; SWEEP_ARGS="--rows 1,32" to narrow;
# SWEEP_ARGS="--narrow --rows 1,32": only what the loader times and round 2's trials, every row bucket's launches
# compiled first so that a `quant` stage after it loads without compiling them one by one; SWEEP_ARGS="--narrow
# --trials natural --rows 16,32,64": the loader's launches and kernels/packed_int_natural.py's trials alone).
# `front_end` runs bench/front_end.py (the HTTP front with a stand-in scheduler, CPU only) at an 8B step's pace.
# `serving_workers` runs `serving` at saturation for several server settings in turn (SERVING_VARIANTS, default
# server.workers auto against 1), for the A/B of the HTTP front's processes.
# `serving` starts `treadle serve` on the same shapes (examples/configs/gpu-llama8b-dummy.yaml, default sizes)
# and runs `treadle bench serving` at 4 req/s and at saturation (600 requests at once; SERVING_SAT_PROMPTS=0
# skips it); SERVING_TAG prefixes its log and result names, for a second server in the same call.
#
# `setup` installs the wheels into /tmp/site and treadle itself (editable, so its entry points
# register the built-in plugins), restoring .whl/fi_cache.tgz (FlashInfer's JIT cache) when present.
# Logs and results go to $OUT.
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
setup() {
  t0=$(date +%s)
  local wheels=${WHEELS:-.whl}
  [ -f $wheels/fi_cache.tgz ] && mkdir -p ~/.cache && tar xzf $wheels/fi_cache.tgz -C ~ && echo "SETUP: restored the FlashInfer JIT cache"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels/*.whl || exit 1
  export PYTHONPATH=/tmp/site
  if python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/pip_editable.log" 2>&1; then
    echo "SETUP: editable install OK"
  else
    echo "SETUP: editable install FAILED (see pip_editable.log); using a hand-made dist-info"
    mkdir -p /tmp/pkg/treadle-0.1.0.dist-info && ln -sfn "$PWD" /tmp/pkg/treadle
    printf 'Metadata-Version: 2.1\nName: treadle\nVersion: 0.1.0\n' > /tmp/pkg/treadle-0.1.0.dist-info/METADATA
    python3 -c "import tomllib;d=tomllib.load(open('pyproject.toml','rb'));print('[treadle]');[print(f'{k} = {v}') for k,v in d['project']['entry-points']['treadle'].items()]" > /tmp/pkg/treadle-0.1.0.dist-info/entry_points.txt
    export PYTHONPATH=/tmp/site:/tmp/pkg
  fi
  cd /tmp && python3 -c "from treadle.core.registry import build_registry; t=build_registry().table(); print('SETUP registry:', {k: sorted(v) for k, v in t.items()})"; cd - >/dev/null
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers, flashinfer; print('versions', torch.__version__, triton.__version__, transformers.__version__, flashinfer.__version__)"
  echo "SETUP took $(( $(date +%s) - t0 )) s"
}
l8b() {
  python3 -m treadle.bench.shapes llama-3.1-8b /tmp/l8b > /dev/null
}
shape_dir() {  # the folder of a bench/shapes.py MODEL_SHAPES entry's config.json (llama-3.1-8b: /tmp/l8b)
  if [ "${1:-llama-3.1-8b}" = llama-3.1-8b ]; then l8b; echo /tmp/l8b; return; fi
  python3 -m treadle.bench.shapes "$1" "/tmp/$1"
}
for stage in "$@"; do
  t0=$(date +%s)
  case $stage in
    setup) setup ;;
    conformance) timeout 200 python3 -m pytest -q -x -p no:randomly tests/gpu/test_attention_conformance_gpu.py 2>&1 | tee "$OUT/conformance.log" | tail -30 ;;
    tests) timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -q -rs tests/gpu/ 2>&1 | tee "$OUT/tests_gpu.log" | tail -40 ;;
    gputests) timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -q -rs -x ${GPU_TESTS:-tests/gpu/} 2>&1 | tee "$OUT/gputests.log" | tail -25 ;;
    offline)
      model_dir=$(shape_dir "${OFFLINE_SHAPE:-llama-3.1-8b}")
      timeout ${OFFLINE_TIMEOUT:-400} python3 -m treadle.bench.offline_throughput --workload random \
        --num-prompts ${OFFLINE_PROMPTS:-1000} --input-len 16:600 --output-len 16:400 \
        --set model.path=$model_dir --set model.load_format=dummy --dtype bfloat16 --device cuda \
        --no-progress --output "$OUT/${OFFLINE_NAME:-offline}.json" ${OFFLINE_ARGS:-} 2>&1 \
        | grep -v "Warning\|warn(" | tee "$OUT/${OFFLINE_NAME:-offline}.log" | tail -20 ;;
    lora)
      # treadle bench lora: the LoRA kernels vs the base projections, then (once the engine serves adapters) the
      # base model vs 32 random rank-16 adapters on Llama-3.1-8B shapes; LORA_ARGS adds options (--part kernels).
      timeout ${LORA_TIMEOUT:-540} python3 -m treadle.bench.lora --output "$OUT/lora.json" ${LORA_ARGS:-} 2>&1 \
        | grep -v "Warning\|warn(" | tee "$OUT/lora.log" | tail -30 ;;
    serving)
      # treadle serve with the example 8B config (default sizes), then `treadle bench serving` at
      # SERVING_RATE req/s (SERVING_PROMPTS requests) and at saturation (SERVING_SAT_PROMPTS at once).
      l8b
      python3 -m treadle.server.launch --config examples/configs/gpu-llama8b-dummy.yaml \
        --set model.path=/tmp/l8b --set server.port=30000 ${SERVING_SET:-} > "$OUT/serve${SERVING_TAG:-}.log" 2>&1 &
      for _ in $(seq 240); do
        grep -q Traceback "$OUT/serve${SERVING_TAG:-}.log" && { tail -30 "$OUT/serve${SERVING_TAG:-}.log"; break; }
        python3 -c "import urllib.request as u; u.urlopen('http://localhost:30000/health', timeout=2)" 2>/dev/null && break; sleep 1
      done
      grep -E "auto|serves" "$OUT/serve${SERVING_TAG:-}.log" | tail -5
      python3 -c "import json, urllib.request as u; c = json.load(u.urlopen('http://localhost:30000/get_server_info'))['config']; \
print('resolved:', c['attention'], {k: c['scheduler'][k] for k in ('max_running_requests', 'chunked_prefill_size', 'latency_chunk_size')}, \
'cuda_graph_max_bs', c['runtime']['cuda_graph_max_bs'])"
      # Saturation streams ~10k events/s: SERVING_WORKERS client processes share them (bench/serving.py --workers).
      for spec in "${SERVING_RATE:-4}:${SERVING_PROMPTS:-240}:rate4:1" "inf:${SERVING_SAT_PROMPTS:-600}:saturation:${SERVING_WORKERS:-4}"; do
        IFS=: read rate n name workers <<< "$spec"
        [ "$n" = 0 ] && continue
        timeout ${SERVING_TIMEOUT:-150} python3 -m treadle.bench.serving --base-url http://localhost:30000 \
          --api native --workload random --num-prompts $n --input-len 16:600 --output-len 16:400 \
          --request-rate $rate --workers $workers --output "$OUT/serving_${SERVING_TAG:-}$name.json" 2>&1 | tail -16
        # The server's own view (TTFT from arrival to the first token reaching the HTTP process, queue time),
        # cumulative over the phases so far: the difference to the client's TTFT is the HTTP path.
        python3 -c "import urllib.request as u; print(u.urlopen('http://localhost:30000/metrics').read().decode())" \
          > "$OUT/metrics_${SERVING_TAG:-}$name.txt" 2>&1
        python3 - "$OUT/metrics_${SERVING_TAG:-}$name.txt" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
for name in ("time_to_first_token", "queue_time", "inter_token_latency"):
    total = re.search(rf"treadle_{name}_seconds_sum (\S+)", text)
    count = re.search(rf"treadle_{name}_seconds_count (\S+)", text)
    if total and count and float(count.group(1)):
        print(f"server-side {name}: mean {1e3 * float(total.group(1)) / float(count.group(1)):.1f} ms over {int(float(count.group(1)))}")
PY
      done
      kill %1 2>/dev/null; wait ;;
    serving_workers)
      # The HTTP front's A/B (issue 48): `serving` at saturation only (SERVING_SAT_PROMPTS at once, SERVING_WORKERS
      # client processes) for each SERVING_VARIANTS entry TAG:KEY=VALUE,KEY=VALUE (config keys; an old-style
      # --set=KEY=VALUE works too), one server after the other on this machine. Default: server.workers auto (one
      # per 4 CPUs) against server.workers=1. SERVING_STEP_TRACE=1: each server's scheduler also writes its step
      # split (GPU busy, host phases) to steps_TAG_.json (TREADLE_STEP_TRACE, docs/server.md).
      for variant in ${SERVING_VARIANTS:-workers_auto: workers_1:server.workers=1}; do
        settings=""
        IFS=, read -ra pairs <<< "${variant#*:}"
        for pair in "${pairs[@]}"; do [ -n "$pair" ] && settings+=" --set ${pair#--set=}"; done
        trace=""; [ -n "${SERVING_STEP_TRACE:-}" ] && trace="$OUT/steps_${variant%%:*}_.json"
        TREADLE_STEP_TRACE="$trace" SERVING_TAG="${variant%%:*}_" SERVING_SET="$settings" \
          SERVING_PROMPTS=0 bash "$0" serving
      done ;;
    front_end)
      # The HTTP front alone on this machine's CPUs (issue 48; no GPU used): bench/front_end.py serves a stand-in
      # scheduler that gives up to 512 streams a token every FRONT_STEP_MS (default 20: ~25k tokens/s offered, an
      # 8B decode step's pace), then as fast as the front end takes them; server.workers auto, 6 client processes.
      for step in ${FRONT_STEP_MS:-20} 0; do
        timeout 200 python3 -m treadle.bench.front_end --streams 600 --step-ms $step --client-processes 6 \
          ${FRONT_ARGS:-} --output "$OUT/front_end_step${step}.json" 2>&1 | tail -9
      done ;;
    soak)
      # The example 8B config (dummy weights): SOAK_SATURATION_S closed-loop at high concurrency measures the
      # saturated request rate of the soak mix, then SOAK_SECONDS at 80% of it with aborts and disconnects.
      # SOAK_MODEL: a model folder to serve instead of /tmp/l8b (e.g. one with a tokenizer, for chat/JSON).
      [ -z "${SOAK_MODEL:-}" ] && l8b
      python3 -m treadle.server.launch --config examples/configs/gpu-llama8b-dummy.yaml \
        --set model.path=${SOAK_MODEL:-/tmp/l8b} --set server.port=30111 --set server.log_level=warning ${SOAK_SET:-} \
        > "$OUT/soak_server.log" 2>&1 &
      server=$!
      for _ in $(seq 240); do
        grep -q Traceback "$OUT/soak_server.log" && { tail -30 "$OUT/soak_server.log"; break; }
        python3 -c "import urllib.request as u; u.urlopen('http://localhost:30111/health', timeout=2)" 2>/dev/null && break; sleep 1
      done
      soak="python3 -m treadle.bench.serving --base-url http://localhost:30111 --max-concurrency 256 \
        --input-len 16:400 --output-len 16:256 --abort-fraction 0.05 --disconnect-fraction 0.05 --structured"
      $soak --duration ${SOAK_SATURATION_S:-45} --warmup 20 --output "$OUT/soak_saturation.json" 2>&1 | tail -14
      rate=$(python3 -c "import json; print(0.8 * json.load(open('$OUT/soak_saturation.json'))['summary']['request_throughput'])")
      $soak --duration ${SOAK_SECONDS:-360} --warmup 60 --request-rate "$rate" --output "$OUT/soak_h100.json" 2>&1 | tail -14
      kill -TERM $server; wait $server; echo "server exit $?" ;;
    soak_bg)
      # A soak longer than one device call: runs `soak` in its own session (it outlives this call while the
      # machine stays warm) with its results in /tmp/soak; a later call's `soak_wait` collects them.
      mkdir -p /tmp/soak
      OUT=/tmp/soak setsid nohup bash "$0" soak > /tmp/soak/soak_run.log 2>&1 < /dev/null &
      echo "soak started in the background (log /tmp/soak/soak_run.log)" ;;
    soak_wait)
      # Waits (at most SOAK_WAIT_S) for a `soak_bg` soak to end, then copies its results into $OUT.
      for _ in $(seq ${SOAK_WAIT_S:-560}); do grep -q "^STAGE soak took" /tmp/soak/soak_run.log 2>/dev/null && break; sleep 1; done
      tail -40 /tmp/soak/soak_run.log; cp /tmp/soak/*.json /tmp/soak/*.log "$OUT"/ 2>/dev/null ;;
    speculative)
      # bench/speculative.py: oracle drafts on Llama-3.1-8B shapes (verify step vs decode step, tok/s at bs 1/8/32)
      # and ngram on SmolLM2 copy-heavy prompts (bs 1 and 256 at once); SPEC_ARGS adds options (--part machinery).
      timeout ${SPEC_TIMEOUT:-540} python3 -m treadle.bench.speculative --output "$OUT/speculative.json" ${SPEC_ARGS:-} 2>&1 \
        | grep -v "it/s\]\|Warning\|warn(" | tee "$OUT/speculative.log" | tail -20 ;;
    spec_cost)
      # bench/speculative_cost.py: step time of eagle3 (random head of the published shape) on Llama-3.1-8B shapes
      # against plain decode, with overlapped verify (eagle3) and without (eagle3-sync); SPEC_COST_ARGS replaces them.
      timeout ${SPEC_TIMEOUT:-540} python3 -m treadle.bench.speculative_cost --output "$OUT/speculative_cost.json" \
        ${SPEC_COST_ARGS:---methods eagle3,eagle3-sync --batch-sizes 1,4 --num-tokens 4} 2>&1 \
        | grep -v "it/s\]\|Warning\|warn(" | tee "$OUT/speculative_cost.log" | tail -20 ;;
    quant)
      # W4A16 (QUANT_ARGS="--format awq": AWQ with zero points) against bf16 on Llama-3.1-8B shapes in one run:
      # one-batch bs=1/32 and the 1000-request offline run (QUANT_ARGS="--runs one-batch" or "--runs offline" for
      # one of them; "--runs one-batch --quick": the GPU's step time alone, 32 steps, no Engine.generate runs;
      # "--precompile 14": the loader's W4A16 launches compiled in 14 processes first, not one by one at load), with
      # the ratios against the targets (bench/quant.py).
      # QUANT_ARGS="... --profile": both models' decode steps profiled side by side (QUANT_TAIL=120 shows them).
      timeout ${QUANT_TIMEOUT:-560} python3 -m treadle.bench.quant --out "$OUT/quant" ${QUANT_ARGS:-} 2>&1 \
        | grep -v "it/s\]\|Warning\|warn(" | tee "$OUT/quant.log" | tail -${QUANT_TAIL:-45} ;;
    embed)
      # Qwen3-Embedding-8B shape (dummy, bf16): 1000 passages of 16-512 tokens, HF transformers then Engine.encode
      # in one run (bench/embed.py; EMBED_ARGS="--passages 500" for a shorter run).
      timeout ${EMBED_TIMEOUT:-300} python3 -m treadle.bench.embed --output "$OUT/embed.json" ${EMBED_ARGS:-} 2>&1 \
        | grep -v "it/s\]\|Warning\|warn(" | tee "$OUT/embed.log" | tail -12 ;;
    vl)
      # Qwen2.5-VL-7B shape (dummy, bf16): 500 requests with one 1024x768 image against the same text-only, and the
      # vision encoder's time per image (bench/vl.py; VL_ARGS="--requests 200" for a shorter run).
      timeout ${VL_TIMEOUT:-300} python3 -m treadle.bench.vl --output "$OUT/vl.json" ${VL_ARGS:-} 2>&1 \
        | grep -v "it/s\]\|Warning\|warn(" | tee "$OUT/vl.log" | tail -12 ;;
    quant_kernels)
      # The integer kernels alone per Llama-3.1-8B projection shape at bs 1/8/32 against bf16 F.linear and the
      # roofline, and one Mixtral-8x7B MoE layer (bench/quant_kernels.py; QUANTK_ARGS="--explore" for a wider grid).
      timeout ${QUANTK_TIMEOUT:-300} python3 -m treadle.bench.quant_kernels --moe --output "$OUT/quant_kernels.json" \
        ${QUANTK_ARGS:-} 2>&1 | grep -v "Warning\|warn(" | tee "$OUT/quant_kernels.log" | tail -60 ;;
    quant_large)
      # W4A16 above DOT_MAX_ROWS rows (bench/quant_large.py): dequantize alone per config against the copy
      # bandwidth, dequantize + cuBLAS and the tl.dot kernels against bf16 at 128/256/512 rows (about a minute).
      timeout ${QUANTK_TIMEOUT:-300} python3 -m treadle.bench.quant_kernels --large \
        --output "$OUT/quant_kernels_large.json" ${QUANTL_ARGS:-} 2>&1 | grep -v "Warning\|warn(" \
        | tee "$OUT/quant_large.log" | tail -${QUANTL_TAIL:-40} ;;
    quant_sweep)
      # Every W4A16 variant x config per Llama-3.1-8B projection shape at rows 1/4/8/16/32/64 (bench/quant_sweep.py):
      # the configs compile in all cores but two first, then each is timed from a CUDA graph; the tables are the
      # tail (the fastest per shape, then each kernel's fastest per shape and its 32-layer sum).
      timeout ${SWEEP_TIMEOUT:-420} python3 -m treadle.bench.quant_kernels --sweep \
        --output "$OUT/quant_kernels_sweep.json" ${SWEEP_ARGS:-} 2>&1 | grep -v "Warning\|warn(" \
        | tee "$OUT/quant_sweep.log" | tail -75 ;;
    bench) timeout ${BENCH_TIMEOUT:-400} python3 -m treadle.bench.one_batch --output "$OUT/one_batch.json" ${BENCH_ARGS:-} 2>&1 | grep -v "it/s\]\|Warning\|warn(" | tee "$OUT/bench.log" | tail -45 ;;
    *) echo "unknown stage $stage" ;;
  esac
  echo "STAGE $stage took $(( $(date +%s) - t0 )) s"
done
du -sh ~/.cache/flashinfer 2>/dev/null
