"""Speculation by a draft model or an EAGLE-3 head, with against without, on real weights: tokens/s, acceptance
length, parity.

Runs one Engine without speculation and one with ``speculative.method`` (``draft`` or ``eagle3``) on the same
prompts (greedy), at each batch size asked for, and prints a table: output tokens/s, the ratio, acceptance length
(completion tokens per verify step) and whether the outputs are token-identical. Defaults: the embedded
SmolLM2-135M as the target (its float32 conversion) and its quantized GGUF file as the draft, on the CPU:

    python -m treadle.bench.speculative_models
    python -m treadle.bench.speculative_models --target /models/Llama-3.1-8B-Instruct \\
        --draft /models/Llama-3.2-1B-Instruct --num-tokens 4 --batch-sizes 1,8,32 --set cache.mem_fraction=0.75
    python -m treadle.bench.speculative_models --method eagle3 --target /models/Llama-3.1-8B-Instruct \\
        --draft /models/EAGLE3-LLaMA3.1-Instruct-8B --num-tokens 4 --batch-sizes 1,8,32

Writes JSON to ``--output`` (default: the results folder outside the tree, bench/results_folder.py).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path
from typing import Any

from treadle import Engine, SamplingParams
from treadle.bench.offline_results import git_commit, machine_info
from treadle.bench.results_folder import default_output

TEXT = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
        "All that glitters is not gold. Actions speak louder than words. ")
PROMPTS = [
    "Repeat the following text exactly, then stop.\n\n" + TEXT,
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in three sentences how a bicycle stays upright.",
    "List ten fruits and one fact about each.",
]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=("draft", "eagle3"), default="draft")
    parser.add_argument("--target", default=None, help="target model folder or .gguf (default: embedded SmolLM2)")
    parser.add_argument("--draft", default=None, help="draft model folder or .gguf, or the EAGLE-3 head's folder "
                                                          "(default: SmolLM2's GGUF file)")
    parser.add_argument("--num-tokens", type=int, default=4)
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--set", action="append", default=[], help="section.key=value for both engines")
    parser.add_argument("--output", default=None)
    parser.add_argument("--note", default=None, help="a note stored in the JSON (where and how it ran)")
    args = parser.parse_args(argv)
    from treadle.core.config import load_config
    from treadle.core.loading.default_model import default_model, find_default_gguf

    target = args.target or default_model()
    draft = args.draft or str(find_default_gguf())
    base = {"model": {"path": target}, "plugins": [f"treadle.plugins.speculators.{args.method}"]}
    overrides = dict(item.split("=", 1) for item in args.set)
    plain_config = load_config(base=base, overrides=overrides, use_env=False)
    spec_overrides = {**overrides, "speculative.method": args.method, "speculative.draft_model_path": draft,
                      "speculative.num_tokens": args.num_tokens, "speculative.max_batch_size": 1024}
    spec_config = load_config(base=base, overrides=spec_overrides, use_env=False)
    rows = []
    with Engine(plain_config) as plain, Engine(spec_config) as spec:
        for bs in [int(b) for b in args.batch_sizes.split(",")]:
            prompts = [PROMPTS[i % len(PROMPTS)] for i in range(bs)]
            params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
            plain_out, plain_s = _timed(plain, prompts, params)
            spec_out, spec_s = _timed(spec, prompts, params)
            tokens = sum(len(o.token_ids) for o in spec_out)
            steps = sum(o.spec_verify_steps for o in spec_out)
            rows.append({
                "batch_size": bs, "plain_tok_s": sum(len(o.token_ids) for o in plain_out) / plain_s,
                "spec_tok_s": tokens / spec_s, "acceptance_length": tokens / steps if steps else None,
                "identical": [o.token_ids for o in plain_out] == [o.token_ids for o in spec_out],
            })
    print(f"target {target}\n{args.method}  {draft}  (num_tokens {args.num_tokens})")
    print(f"{'bs':>4} {'plain tok/s':>12} {'spec tok/s':>12} {'ratio':>6} {'accept len':>10} identical")
    for row in rows:
        accept = f"{row['acceptance_length']:.2f}" if row["acceptance_length"] else "-"
        print(f"{row['batch_size']:>4} {row['plain_tok_s']:>12.1f} {row['spec_tok_s']:>12.1f} "
              f"{row['spec_tok_s'] / row['plain_tok_s']:>6.2f} {accept:>10} {row['identical']}")
    result = {"benchmark": "speculative_models", "method": args.method, "target": target, "draft": draft,
              "num_tokens": args.num_tokens, "max_new_tokens": args.max_new_tokens, "rows": rows,
              "command": "python -m treadle.bench.speculative_models " + " ".join(sys.argv[1:] if argv is None else argv),
              "date": dt.datetime.now().isoformat(timespec="seconds"), "machine": machine_info(),
              "treadle_commit": git_commit(), **({"note": args.note} if args.note else {})}
    output = args.output or default_output(f"speculative_{args.method}_{int(time.time())}.json")
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    with open(output, "w") as file:
        json.dump(result, file, indent=2)
    print(f"wrote {output}")
    return result


def _timed(engine: Engine, prompts: list[str], params: SamplingParams) -> tuple[list[Any], float]:
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=4, temperature=0.0))  # warm-up
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    return outputs, time.perf_counter() - start


if __name__ == "__main__":
    main()
