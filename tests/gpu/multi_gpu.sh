#!/usr/bin/env bash
# Multi-GPU runs on GPUS cards of one host (default 2: an nvidia-h100-x2; GPUS=4 on an -x4, GPUS=8 on an -x8).
# Through the device tool, with carry [".whl"]:
#
#   bash tests/gpu/multi_gpu.sh setup nccl_smoke tp_tests tp_8b tp_70b tp_70b_offline dp
#   GPUS=8 bash tests/gpu/multi_gpu.sh setup tp_70b tp_70b_offline mixtral_offline dp    # issue 47's runs
#
# Each stage writes its log (and JSON) under $OUT; copy the JSON into bench/results/ and the
# figures into docs/benchmarks.md and docs/parallel.md.
#   nccl_smoke      one-rank NCCL all-reduce + all-gather captured in a CUDA graph (also runs on one GPU)
#   tp_tests        tp=2 vs tp=1 greedy parity, triton + flashinfer, CUDA graphs on (NCCL all-reduce captured)
#   tp_8b           Llama-3.1-8B shapes, bs=1 decode step: tp=1 vs tp=2 (target tp=2 <= 0.6x tp=1), and first tokens equal
#   tp_70b          Llama-3.1-70B shapes (141 GB bf16: no single GPU holds it), tp=GPUS, bs=1 and bs=32 vs the roofline
#   tp_70b_profile  the same shapes, tp=GPUS, bs=1: rank 0's torch.profiler table of a graph decode step (where the
#                   time beyond the weights' read goes; the PDL launches make kernels look longer than they run)
#   tp_70b_offline  Llama-3.1-70B shapes, tp=GPUS, offline throughput on the 1000-request random workload (default config)
#   mixtral_offline Mixtral-8x7B shapes, tp=GPUS, offline throughput on the same workload
#   dp              Llama-3.1-8B shapes, dp=GPUS vs dp=1 through the server (default config; DP_SET="--set K=V ..." adds
#                   launch overrides for A/B runs, e.g. DP_SET="--set scheduler.enable_mixed_chunk=true"): DP_PROMPTS (1000;
#                   issue 47 asks 2000 at dp=8) requests at once, then DP_RATE_PROMPTS (600; 0: none) at 40 req/s;
#                   dp_one and dp_all run its two halves apart (dp=1, dp=GPUS)
#   dp_prefix       dp=2 on 8B shapes, a shared-prefix workload (DP_PREFIXES=97 system prompts of DP_PREFIX_LEN=4000
#                   tokens, 301 on a GPU of over 100 GB: more than one replica's KV cache holds, fewer than two; an odd count so that round robin
#                   spreads each prompt over both replicas): parallel.dp_policy prefix_aware vs round_robin, cache hit
#                   rate and throughput (target prefix_aware >= 1.3x)
#   dp_nodes        dp=2 as two "nodes" on this host (node 1: GPU 1, its own `treadle serve` joining node 0's controller
#                   over TCP at 127.0.0.1:29555; node 0: GPU 0 + HTTP), 8B shapes, DP_PROMPTS requests at once (compare
#                   with the dp stage's dp=2), then SIGTERM to node 0: both must exit 0
#   ar_tests        the peer-to-peer all-reduce (issue 48): conformance against NCCL (1 KiB..8 MiB, bf16/fp16/fp32,
#                   eager and CUDA graphs) and a tp=2 Engine using it
#   tp_decode       all-reduce latency by size (NCCL, one-shot, two-shot) and the bs=1/32 decode step of 8B shapes:
#                   tp=1, tp=2 over NCCL, tp=2 over the peer all-reduce (target tp=2 <= 0.6x tp=1)
#   tp_step_broadcast rank 0's per-step commands: one-way latency through shared memory vs gloo (CPU processes), then
#                   Engine.generate at tp=2, bs=1, 8B shapes, triton, graphs: parallel.step_broadcast auto vs gloo
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
HERE=$(cd "$(dirname "$0")" && pwd)
BACKENDS=${BACKENDS:-triton,flashinfer}
GPUS=${GPUS:-2}
shape_dir() {  # write an HF config.json of a bench shape into /tmp/<shape> and print the folder
  python3 -m treadle.bench.shapes "$1" "/tmp/$1"
}
serve_and_bench() {  # $1 = dp_size; 8B shapes, dummy weights; offline (all at once) then saturation
  local dir; dir=$(shape_dir llama-3.1-8b); local port=$((31000 + $1))
  python3 -m treadle.server.launch --set model.path="$dir" --set model.load_format=dummy --set server.port=$port \
    --set parallel.dp_size="$1" ${DP_SET:-} > "$OUT/dp$1_server.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 300); do
    grep -q Traceback "$OUT/dp$1_server.log" && break
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1
  done
  # All at once streams 10-25k events/s: eight client processes share them (one caps near 13k out tok/s).
  python3 -m treadle.bench.serving --base-url "http://127.0.0.1:$port" --num-prompts ${DP_PROMPTS:-1000} --input-len 16:600 \
    --output-len 16:400 --workers 8 --output "$OUT/serving_dp$1_offline.json" 2>&1 | tail -20
  replica_balance "$port" "$OUT/dp$1_server_info_offline.json"
  [ "${DP_RATE_PROMPTS:-600}" != 0 ] && python3 -m treadle.bench.serving --base-url "http://127.0.0.1:$port" \
    --num-prompts "${DP_RATE_PROMPTS:-600}" --input-len 16:600 --output-len 16:400 --request-rate 40 \
    --output "$OUT/serving_dp$1_rate40.json" 2>&1 | tail -20
  kill "$pid"; wait "$pid"
}
replica_balance() {  # $1 = port, $2 = JSON path: /get_server_info after a run; each replica's routed work and idle tail
  curl -sf "http://127.0.0.1:$1/get_server_info" > "$2" || return 0
  python3 - "$2" <<'EOF'
import json, sys
replicas = [r.get("routing") for r in json.load(open(sys.argv[1])).get("replicas", [])]
if replicas and all(replicas):
    work = [r["routed_work_tokens"] for r in replicas]
    tail = [r["last_finish_s_ago"] or 0.0 for r in replicas]
    print("replica  routed requests  routed work (tokens)  done before the last (s)")
    for i, r in enumerate(replicas):
        print(f"{i:>7}  {r['routed_requests']:>15}  {r['routed_work_tokens']:>20}  {tail[i] - min(tail):>24.2f}")
    print(f"routed work max/mean {max(work) / (sum(work) / len(work)):.4f}")
EOF
}
prefix_policy() {  # $1 = dp_policy; dp=2 server, the shared-prefix workload all at once
  local dir; dir=$(shape_dir llama-3.1-8b); local port=31010
  # Prefixes that overflow one replica's KV pool but not two: ~420k tokens a replica on an 80 GB GPU (97 x 4000),
  # ~837k on a 141 GB H200 (301 x 4000); about four requests a prefix.
  local prefixes=97 prompts=1200
  if [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0)" -gt 100000 ]; then
    prefixes=301; prompts=1204
  fi
  python3 -m treadle.server.launch --set model.path="$dir" --set model.load_format=dummy --set server.port=$port \
    --set parallel.dp_size=2 --set parallel.dp_policy="$1" > "$OUT/dp_prefix_$1_server.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 300); do
    grep -q Traceback "$OUT/dp_prefix_$1_server.log" && break
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1
  done
  timeout 300 python3 -m treadle.bench.serving --base-url "http://127.0.0.1:$port" --workload shared-prefix \
    --num-prompts "${DP_PROMPTS:-$prompts}" --num-prefixes "${DP_PREFIXES:-$prefixes}" --prefix-len "${DP_PREFIX_LEN:-4000}" \
    --question-len 16:48 --output-len 16:64 --workers 4 --no-progress \
    --output "$OUT/serving_dp2_prefix_$1.json" 2>&1 | tail -16
  replica_balance "$port" "$OUT/dp2_prefix_$1_server_info.json"
  kill "$pid"; wait "$pid"
}
two_nodes() {  # dp=2 over two "nodes" of this host, one GPU each
  local dir; dir=$(shape_dir llama-3.1-8b); local port=31020
  local common=(--set model.path="$dir" --set model.load_format=dummy --set parallel.dp_size=2
    --set parallel.nnodes=2 --set parallel.dist_init_addr=127.0.0.1:29555)
  CUDA_VISIBLE_DEVICES=1 python3 -m treadle.server.launch "${common[@]}" --set parallel.node_rank=1 \
    > "$OUT/dp_nodes_node1.log" 2>&1 &
  local node1=$!
  CUDA_VISIBLE_DEVICES=0 python3 -m treadle.server.launch "${common[@]}" --set server.port=$port \
    > "$OUT/dp_nodes_node0.log" 2>&1 &
  local node0=$!
  for _ in $(seq 1 300); do
    grep -q "Traceback\|ERROR" "$OUT/dp_nodes_node0.log" && break
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1
  done
  curl -s "http://127.0.0.1:$port/get_server_info" | python3 -c \
    'import json,sys; m=json.load(sys.stdin)["model_info"]; print("replica_nodes", m["replica_nodes"])'
  timeout 300 python3 -m treadle.bench.serving --base-url "http://127.0.0.1:$port" --num-prompts ${DP_PROMPTS:-1000} \
    --input-len 16:600 --output-len 16:400 --workers 8 --output "$OUT/serving_dp2_two_nodes.json" 2>&1 | tail -20
  curl -s "http://127.0.0.1:$port/get_server_info" | python3 -c \
    'import json,sys; print("finished per replica", [r["kv"]["finished"] for r in json.load(sys.stdin)["replicas"]])'
  kill "$node0"; wait "$node0"; echo "node 0 exit $?"; wait "$node1"; echo "node 1 exit $? (both must be 0)"
}
for stage in "$@"; do
  t0=$(date +%s)
  case $stage in
    setup) bash "$HERE/device.sh" setup
      export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}; [ -d /tmp/pkg ] && export PYTHONPATH=$PYTHONPATH:/tmp/pkg
      nvidia-smi -L ;;
    nccl_smoke) timeout 60 python3 tests/gpu/nccl_graph_smoke.py 2>&1 | grep -v Warn | tail -3 ;;
    dp_prefix) for policy in prefix_aware round_robin; do prefix_policy $policy; done
      python3 - "$OUT" <<'PY'
import json, sys
runs = {p: json.load(open(f"{sys.argv[1]}/serving_dp2_prefix_{p}.json"))["summary"] for p in ("prefix_aware", "round_robin")}
for p, s in runs.items():
    print(f"{p}: {s['output_token_throughput']:.0f} out tok/s, {s['input_token_throughput']:.0f} in tok/s, "
          f"cache hit rate {s['cache_hit_rate']:.1%}, {s['completed']} done / {s['failed']} failed")
ratio = runs["prefix_aware"]["output_token_throughput"] / max(runs["round_robin"]["output_token_throughput"], 1e-9)
print(f"prefix_aware / round_robin throughput: {ratio:.2f}x (target >= 1.3x)")
PY
      ;;
    ar_tests) timeout 560 python3 -m pytest -q -s -rs tests/gpu/test_custom_all_reduce_gpu.py 2>&1 | tee "$OUT/ar_tests.log" | tail -30 ;;
    tp_decode) timeout 590 python3 -m treadle.bench.tp_decode --timeout-s 180 --output "$OUT/tp_decode_2gpu.json" 2>&1 \
        | grep -v "it/s\]\|Warning\|warn(" | tee "$OUT/tp_decode.log" | tail -40 ;;
    tp_step_broadcast) timeout 590 python3 -m treadle.bench.tp_step_broadcast --output "$OUT/tp_step_broadcast_2gpu.json" \
        2>&1 | grep -v "it/s\]\|Warning\|warn(" | tee "$OUT/tp_step_broadcast.log" | tail -30 ;;
    tp_tests) timeout 500 python3 -m pytest -q -s -rs tests/gpu/test_tensor_parallel_gpu.py 2>&1 | tee "$OUT/tp_tests.log" | tail -30 ;;
    tp_8b)
      for tp in 1 2; do
        timeout 400 python3 -m treadle.bench.one_batch --tp $tp --batch-sizes 1,32 --backends "$BACKENDS" --graphs on \
          --no-hf --no-profile --output "$OUT/one_batch_8b_tp$tp.json" 2>&1 | grep -v "it/s\]\|Warning\|warn(" | tail -8
      done
      python3 - "$OUT" <<'PY'
import json, sys
one, two = (json.load(open(f"{sys.argv[1]}/one_batch_8b_tp{t}.json"))["results"] for t in (1, 2))
for a in one:
    b = next((r for r in two if r["system"] == a["system"] and r["batch_size"] == a["batch_size"]), None)
    if b is None:  # Engine.generate rows run at tp=1 only
        continue
    print(f'{a["system"]} bs={a["batch_size"]}: tp1 {a["decode_step_ms"]:.2f} ms, tp2 {b["decode_step_ms"]:.2f} ms '
          f'({b["decode_step_ms"] / a["decode_step_ms"]:.2f}x; target <= 0.6x at bs=1), first tokens equal: '
          f'{a["first_tokens"] == b["first_tokens"]}')
PY
      ;;
    tp_70b) timeout 580 python3 -m treadle.bench.one_batch --tp "$GPUS" --shape llama-3.1-70b --batch-sizes 1,32 \
        --input-len 512 --decode-steps 64 --backends "$BACKENDS" --graphs on --no-hf --no-profile \
        --output "$OUT/one_batch_70b_tp$GPUS.json" 2>&1 | grep -v "it/s\]\|Warning\|warn(" | tail -12 ;;
    tp_70b_profile) timeout 580 python3 -m treadle.bench.one_batch --tp "$GPUS" --shape llama-3.1-70b --batch-sizes 1 \
        --input-len 512 --decode-steps 64 --backends "${BACKENDS%%,*}" --graphs on --no-hf --no-engine \
        --profile-batch-sizes 1 --prefill-profile none --output "$OUT/one_batch_70b_tp${GPUS}_profile.json" 2>&1 \
        | grep -v "it/s\]\|Warning\|warn(" | tee "$OUT/tp_70b_profile.log" | tail -60 ;;
    tp_70b_offline)
      dir=$(shape_dir llama-3.1-70b)
      timeout 580 python3 -m treadle.bench.offline_throughput --workload random --num-prompts 1000 \
        --input-len 16:600 --output-len 16:400 --set model.path="$dir" --set model.load_format=dummy \
        --set parallel.tp_size="$GPUS" --device cuda --dtype bfloat16 --no-progress \
        --output "$OUT/offline_70b_tp$GPUS.json" 2>&1 | tail -15 ;;
    mixtral_offline)
      dir=$(shape_dir mixtral-8x7b)
      timeout 580 python3 -m treadle.bench.offline_throughput --workload random --num-prompts 1000 \
        --input-len 16:600 --output-len 16:400 --set model.path="$dir" --set model.load_format=dummy \
        --set parallel.tp_size="$GPUS" --device cuda --dtype bfloat16 --no-progress \
        --output "$OUT/offline_mixtral_tp$GPUS.json" 2>&1 | tail -15 ;;
    dp) serve_and_bench 1; serve_and_bench "$GPUS" ;;
    dp_one) serve_and_bench 1 ;;
    dp_all) serve_and_bench "$GPUS" ;;
    dp_nodes) two_nodes ;;
    *) echo "unknown stage $stage" ;;
  esac
  echo "STAGE $stage took $(( $(date +%s) - t0 )) s"
done
