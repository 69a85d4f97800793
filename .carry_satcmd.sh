bash tests/gpu/device.sh setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site
mkdir -p /tmp/l8b && python3 -c "import json; from treadle.bench.shapes import LLAMA_3_1_8B as c; json.dump(c, open('/tmp/l8b/config.json', 'w'))"
for tag in plain prof; do
  pre=""; [ $tag = prof ] && pre="-m cProfile -o $OUT/http_$tag.prof"
  TREADLE_STEP_TRACE=$OUT/sched_steps_$tag.json python3 $pre -m treadle.server.launch --config examples/configs/gpu-llama8b-dummy.yaml --set model.path=/tmp/l8b --set server.port=30000 > $OUT/serve_$tag.log 2>&1 &
  for _ in $(seq 200); do grep -q Traceback $OUT/serve_$tag.log && { tail -20 $OUT/serve_$tag.log; break; }; python3 -c "import urllib.request as u; u.urlopen('http://localhost:30000/health', timeout=2)" 2>/dev/null && break; sleep 1; done
  echo "=== $tag"; timeout 120 python3 -m treadle.bench.serving --base-url http://localhost:30000 --api native --workload random --num-prompts 600 --input-len 16:600 --output-len 16:400 --request-rate inf --workers 4 --output $OUT/sat_$tag.json 2>&1 | tail -9
  kill -TERM %1; wait
  python3 -c "import json; d=json.load(open('$OUT/sched_steps_$tag.json')); print({k: d[k] for k in ('steps','gpu_s','gpu_idle_between_steps_s','gpu_busy_share')}); [print(m, {k: round(v,2) for k, v in x.items()}) for m, x in d['per_step_kind'].items()]"
done
python3 -c "import pstats; pstats.Stats('$OUT/http_prof.prof').sort_stats('tottime').print_stats(30)" | tail -42
cd $OUT && tar czf all.tgz *.json *.log *.prof && rm -f *.json *.log *.prof
