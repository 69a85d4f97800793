"""vLLM's decode step on the shapes treadle's benchmarks use, for side-by-side figures (run by tests/gpu/vllm_peer.sh).

Runs under vLLM's own packages only (``PYTHONPATH=/tmp/vsite``, see ../shared/device/vllm_peer.sh): it imports
nothing of treadle. One ``LLM`` per call (dummy weights, no tokenizer, no prefix cache), then per batch size the
median over ``--repeats`` pairs of ``generate`` calls of 1 and ``--new-tokens`` greedy tokens from random
``--input-len``-token prompts: a decode step is ``(t(new) - t(1)) / (new - 1)``, as ``treadle bench lora``'s engine
part and ``bench/one_batch.py``'s Engine rows measure treadle's. ``--lora-dir`` (PEFT folders ``adapterNN``, as
``bench/lora_engine.py``'s ``write_adapters`` makes them) gives request i adapter i (bs=32: 32 adapters, bs=1: one).
``--offline FILE`` instead runs a whole workload at once, as ``treadle bench offline`` does: FILE is JSON
``[[prompt token ids, output length], ...]`` (``vllm_peer.sh``'s ``configs`` stage writes treadle's 1000-request
``random`` workload, 16-600 tokens in, 16-400 out, seed 0), every request greedy to exactly its length; out tok/s
after a warm-up of 64 of its requests.

    PYTHONPATH=/tmp/vsite python3 tests/gpu/vllm_peer.py --model /tmp/llama-3.1-8b --tp 2 --output /tmp/out/v.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path


def main() -> int:
    args = _parser().parse_args()
    from vllm import LLM, SamplingParams

    extra = {}
    if args.lora_dir:
        extra = {"enable_lora": True, "max_loras": args.lora_count, "max_lora_rank": args.lora_rank}
    if args.no_ar_fusion:  # vLLM's all-reduce + RMSNorm fusion (FlashInfer's) faults on machines without multicast
        extra["compilation_config"] = {"pass_config": {"fuse_allreduce_rms": False}}
    llm = LLM(model=args.model, load_format="dummy", tensor_parallel_size=args.tp, dtype="bfloat16",
              skip_tokenizer_init=True, enable_prefix_caching=False, max_model_len=args.max_model_len or args.input_len + args.new_tokens + 64,
              gpu_memory_utilization=args.gpu_memory_utilization, seed=0, **extra)
    if args.offline:
        return _offline(llm, args)
    rng = random.Random(0)
    result = {"model": args.model, "tp": args.tp, "no_ar_fusion": args.no_ar_fusion, "lora_dir": args.lora_dir, "input_len": args.input_len,
              "new_tokens": args.new_tokens, "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "steps_ms": {}}
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        prompts = [{"prompt_token_ids": [rng.randrange(1000, 30000) for _ in range(args.input_len)]} for _ in range(bs)]
        loras = _lora_requests(args, bs) if args.lora_dir else None

        def timed(tokens: int) -> float:
            params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0, detokenize=False)
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
            return time.perf_counter() - start

        timed(4)  # warm-up
        steps = []
        for _ in range(args.repeats):
            one = timed(1)
            steps.append((timed(args.new_tokens) - one) / (args.new_tokens - 1))
        result["steps_ms"][str(bs)] = statistics.median(steps) * 1e3
        print(f"vllm {Path(args.model).name} tp={args.tp}{' lora' if args.lora_dir else ''} bs={bs}: "
              f"decode {result['steps_ms'][str(bs)]:.3f} ms/step", flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))
    return 0


def _offline(llm, args: argparse.Namespace) -> int:
    from vllm import SamplingParams

    work = json.loads(Path(args.offline).read_text())
    prompts = [{"prompt_token_ids": ids} for ids, _ in work]
    params = [SamplingParams(max_tokens=out, ignore_eos=True, temperature=0.0, detokenize=False) for _, out in work]
    llm.generate(prompts[:64], params[:64], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {"model": args.model, "tp": args.tp, "offline": args.offline, "requests": len(work),
              "input_tokens": sum(len(ids) for ids, _ in work), "output_tokens": out_tokens, "seconds": seconds,
              "out_tok_per_s": out_tokens / seconds, "date": time.strftime("%Y-%m-%dT%H:%M:%S")}
    print(f"vllm {Path(args.model).name} offline: {len(work)} requests, {out_tokens} out tokens in {seconds:.2f} s: "
          f"{out_tokens / seconds:.1f} out tok/s", flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))
    return 0


def _lora_requests(args: argparse.Namespace, bs: int) -> list:
    from vllm.lora.request import LoRARequest

    folders = sorted(p for p in Path(args.lora_dir).iterdir() if p.is_dir())[: args.lora_count]
    return [LoRARequest(folders[i % len(folders)].name, i % len(folders) + 1, str(folders[i % len(folders)]))
            for i in range(bs)]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a folder with an HF config.json (dummy weights)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=65)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lora-dir", help="PEFT adapter folders; request i gets adapter i")
    parser.add_argument("--lora-count", type=int, default=32)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--no-ar-fusion", action="store_true", help="vLLM's all-reduce + RMSNorm fusion off")
    parser.add_argument("--offline", help="JSON [[prompt ids, output length], ...]: the whole workload at once")
    parser.add_argument("--max-model-len", type=int, help="default: the prompt plus --new-tokens plus 64")
    parser.add_argument("--output")
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
