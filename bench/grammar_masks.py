"""Host cost of constrained decoding: filling the next-token masks of a batch, per grammar backend.

``python -m treadle.bench.grammar_masks --tokenizer DIR --schemas a.json,b.json [--rows 256] [--threads auto,16]``

For each schema and backend, ``--rows`` matchers advance in lock step by tokens drawn at random from
what each mask allows (a stand-in for a model), for ``--steps`` steps; it times one row at a time
(``fill_bitmask``) and the whole batch (``fill_bitmasks``, the scheduler's call, parallel in both
built-in backends). ``--threads`` sets xgrammar's batch thread counts to compare ("auto" is
xgrammar's default, half the hardware threads). Prints a table; ``--output`` writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from pathlib import Path

import torch

from treadle.core.grammar import Constraint, bitmask_width, unpack_bitmask

SCHEMAS = Path(__file__).resolve().parent / "schemas"
DEFAULT_SCHEMAS = ("people.json", "people_no_max_length.json")  # the same schema with and without maxLength


def _allowed(bitmask_row: torch.Tensor, vocab_size: int) -> list[int]:
    return unpack_bitmask(bitmask_row.unsqueeze(0))[0, :vocab_size].nonzero().flatten().tolist()


def measure(backend, schema: str, rows: int, steps: int, vocab_size: int, seed: int) -> dict[str, float]:
    """Mean microseconds per row for single fills, and milliseconds per batch fill."""
    compiled = backend.compile(Constraint("json_schema", schema))
    matchers = [backend.new_matcher(compiled) for _ in range(rows)]
    bitmask = torch.full((rows, bitmask_width(vocab_size)), -1, dtype=torch.int32)
    rng = random.Random(seed)
    single = batch = 0.0
    for _ in range(steps):
        live = [i for i, matcher in enumerate(matchers) if not matcher.is_terminated()]
        if not live:
            break
        start = time.perf_counter()
        for i in live:
            matchers[i].fill_bitmask(bitmask, i)
        single += (time.perf_counter() - start) / len(live)
        start = time.perf_counter()
        backend.fill_bitmasks([matchers[i] for i in live], bitmask, live)
        batch += time.perf_counter() - start
        for i in live:
            allowed = _allowed(bitmask[i], vocab_size)
            if allowed:
                matchers[i].accept_token(rng.choice(allowed))
    return {"single_us_per_row": single / steps * 1e6, "batch_ms": batch / steps * 1e3}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True, help="folder with a Hugging Face tokenizer")
    parser.add_argument("--schemas", default=",".join(str(SCHEMAS / name) for name in DEFAULT_SCHEMAS),
                        help="JSON schema files, comma-separated (default: the two people schemas in bench/schemas)")
    parser.add_argument("--backends", default="xgrammar,llguidance")
    parser.add_argument("--threads", default="auto", help="xgrammar batch thread counts, comma-separated")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from treadle.plugins.grammar.llguidance_backend import LLGuidanceBackend
    from treadle.plugins.grammar.xgrammar_backend import XGrammarBackend

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab_size = len(tokenizer)
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    rows = []
    for schema_path in args.schemas.split(","):
        schema = Path(schema_path).read_text()
        for name in args.backends.split(","):
            variants = [None] if name != "xgrammar" else args.threads.split(",")
            for threads in variants:
                if name == "xgrammar":
                    backend = XGrammarBackend(tokenizer, vocab_size, stop,
                                              batch_threads="auto" if threads == "auto" else int(threads))
                else:
                    backend = LLGuidanceBackend(tokenizer, vocab_size, stop)
                result = measure(backend, schema, args.rows, args.steps, vocab_size, args.seed)
                label = name if threads is None else f"{name} (threads {threads})"
                rows.append({"schema": Path(schema_path).name, "backend": label, **result})
                print(f"{rows[-1]['schema']:28s} {label:24s} single {result['single_us_per_row']:8.1f} us/row  "
                      f"batch of {args.rows} {result['batch_ms']:8.2f} ms", flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps({
            "command": "python -m treadle.bench.grammar_masks " + " ".join(argv or []),
            "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "rows": args.rows, "steps": args.steps, "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
