"""What drafting costs per step: plain decode against a verify step with an EAGLE-3 head or a draft model drafting,
on model shapes with dummy weights (no real weights needed), and the speed-up that cost implies at a given
acceptance length.

The target has Llama-3.1-8B's shape, the EAGLE-3 head its published head's shape (random weights, 32k draft
vocabulary) and the draft model Llama-3.2-1B's shape. With random weights almost no draft is kept, so every step
pays the whole drafting and verifying cost and keeps about one token: the step time measured is the cost side of a
real run. Per method and batch size, the step time is ``(time for N new tokens - time for N0) / (steps - steps0)``
over the decode (or verify) steps counted by a step observer. The table gives the step time, its ratio to plain
decode, and the speed-up a real run would get at acceptance lengths 2, 3 and 4 (``length * plain / step``)::

    python -m treadle.bench.speculative_cost                       # GPU: 8B shapes, batch sizes 1, 8, 32
    python -m treadle.bench.speculative_cost --shape tiny --batch-sizes 1 --new-tokens 8   # a CPU smoke run
    python -m treadle.bench.speculative_cost --methods eagle3,eagle3-sync --batch-sizes 1,4   # overlapped verify

``eagle3`` runs with ``speculative.overlap: true`` (on CUDA ``auto`` leaves it off for eagle3 until its GPU tests
pass): its verify steps overlapped where they can be (chains of at most 20 tokens a step on triton/flashinfer_triton,
so bs <= 4 at k = 4); ``eagle3-sync`` with it off.

Writes JSON to ``--output`` (default: the results folder outside the tree).
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from treadle import Engine, SamplingParams
from treadle.bench.results_folder import default_output
from treadle.bench.shapes import LLAMA_3_1_8B, write_config
from treadle.core.scheduling.observers import StepObserver
from treadle.testing.eagle3_heads import make_eagle3_head

LLAMA_3_2_1B = {**LLAMA_3_1_8B, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True}
TINY = {**LLAMA_3_1_8B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512,
        "max_position_embeddings": 4096, "rope_scaling": None, "bos_token_id": 1, "eos_token_id": 2}
PLUGINS = ["treadle.plugins.speculators.draft", "treadle.plugins.speculators.eagle3"]


class StepCounter(StepObserver):
    """Counts the decode and verify steps."""

    def __init__(self) -> None:
        self.steps = 0

    def batch_built(self, batch: Any) -> None:
        if batch is not None and not (batch.forward_mode.is_extend() and not batch.forward_mode.is_verify()):
            self.steps += 1


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = _parser().parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="treadle-spec-cost-"))
    target_shape = TINY if args.shape == "tiny" else LLAMA_3_1_8B
    draft_shape = TINY if args.shape == "tiny" else LLAMA_3_2_1B
    target = write_config(_mkdir(folder / "target"), target_shape)
    draft = write_config(_mkdir(folder / "draft"), draft_shape)
    head = make_eagle3_head(folder / "eagle3", target_shape, 32000 if args.shape != "tiny" else 128,
                            scale=0.02, dtype=torch.bfloat16)
    base = {"model": {"path": target, "load_format": "dummy", "context_length": 4096}, "plugins": PLUGINS,
            "cache": {"mem_fraction": args.mem_fraction}}
    methods = {"plain": None, "eagle3": head, "eagle3-sync": head, "draft": draft}
    rows = []
    for method in ["plain", *args.methods.split(",")]:
        config = json.loads(json.dumps(base))
        if methods[method] is not None:
            config["speculative"] = {"method": method.removesuffix("-sync"), "draft_model_path": methods[method],
                                     "num_tokens": args.num_tokens, "max_batch_size": max(args.batch_sizes),
                                     "overlap": not method.endswith("-sync")}
        rows.extend(_measure(method, config, args))
    plain = {row["batch_size"]: row["step_ms"] for row in rows if row["method"] == "plain"}
    print(f"target {args.shape}, num_tokens {args.num_tokens}; random drafts: the step costs a real run pays")
    print(f"{'method':>11} {'bs':>4} {'step ms':>9} {'x plain':>8} {'@L=2':>6} {'@L=3':>6} {'@L=4':>6}")
    for row in rows:
        ratio = row["step_ms"] / plain[row["batch_size"]]
        row["speedup_at"] = {length: length / ratio for length in (2, 3, 4)}
        gains = "".join(f" {row['speedup_at'][length]:>6.2f}" for length in (2, 3, 4))
        print(f"{row['method']:>11} {row['batch_size']:>4} {row['step_ms']:>9.3f} {ratio:>8.2f}{gains}")
    result = {"shape": args.shape, "num_tokens": args.num_tokens, "rows": rows}
    output = Path(args.output or default_output(f"speculative_cost_{int(time.time())}.json"))
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2))
    print(f"wrote {output}")
    return result


def _measure(method: str, config: dict, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    with Engine(config) as engine:
        counter = StepCounter()
        engine.scheduler.add_observer(counter)
        generator = torch.Generator().manual_seed(0)
        for bs in args.batch_sizes:
            prompts = torch.randint(10, 500, (bs, args.prompt_len), generator=generator).tolist()
            timings = []
            for new_tokens in (args.base_tokens, args.base_tokens + args.new_tokens):
                params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
                engine.generate(input_ids=prompts, sampling_params=params)  # warm-up of this shape
                counter.steps = 0
                start = time.perf_counter()
                engine.generate(input_ids=prompts, sampling_params=params)
                timings.append((time.perf_counter() - start, counter.steps))
            (short_s, short_steps), (long_s, long_steps) = timings
            rows.append({"method": method, "batch_size": bs,
                         "step_ms": 1000 * (long_s - short_s) / max(long_steps - short_steps, 1)})
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("8b", "tiny"), default="8b")
    parser.add_argument("--methods", default="eagle3,draft")
    parser.add_argument("--batch-sizes", type=lambda text: [int(b) for b in text.split(",")], default=[1, 8, 32])
    parser.add_argument("--num-tokens", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--base-tokens", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--mem-fraction", type=float, default=0.75)
    parser.add_argument("--output", default=None)
    return parser


if __name__ == "__main__":
    main()
