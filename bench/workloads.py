"""Synthetic benchmark workloads: seeded lists of (prompt token ids, output length).

Every benchmark that needs requests builds them here, so two runs (or two
benchmarks) given the same arguments see exactly the same prompts. Prompts are
random token ids drawn from the usable part of a vocabulary; outputs have fixed
lengths, to be enforced with ``ignore_eos`` so every system generates the same
number of tokens.

- ``random``: independent prompts of varied input and output lengths.
- ``shared-prefix``: one long system prompt (or a few) followed by a short
  unique question per request; what a radix cache is for.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

WORKLOAD_NAMES = ("random", "shared-prefix")


@dataclass(frozen=True)
class BenchRequest:
    """One synthetic request: its prompt and exactly how many tokens it must generate."""

    input_ids: list[int]
    output_len: int


@dataclass
class Workload:
    """A named, reproducible list of requests plus the parameters that produced it."""

    name: str
    requests: list[BenchRequest]
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def input_tokens(self) -> int:
        return sum(len(r.input_ids) for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    def summary(self) -> dict[str, Any]:
        """Sizes and parameters, JSON-ready."""
        inputs = [len(r.input_ids) for r in self.requests]
        outputs = [r.output_len for r in self.requests]
        return {
            "name": self.name,
            "num_requests": self.num_requests,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "input_len_range": [min(inputs), max(inputs)] if inputs else [0, 0],
            "output_len_range": [min(outputs), max(outputs)] if outputs else [0, 0],
            "params": dict(self.params),
        }


def usable_token_ids(vocab_size: int, tokenizer: Any = None) -> list[int]:
    """Ids a synthetic prompt may use: ``[0, vocab_size)`` minus the tokenizer's special tokens.

    Ids past the tokenizer's length (padding rows of the embedding) are left out too,
    so the prompts decode to text.
    """
    limit = vocab_size
    special: set[int] = set()
    if tokenizer is not None:
        limit = min(vocab_size, len(tokenizer))
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids = [i for i in range(limit) if i not in special]
    if not ids:
        raise ValueError(f"no usable token ids in a vocabulary of {vocab_size} (all are special tokens)")
    return ids


def random_workload(
    num_requests: int,
    token_ids: Sequence[int],
    input_len: tuple[int, int] = (32, 512),
    output_len: tuple[int, int] = (16, 128),
    seed: int = 0,
) -> Workload:
    """Independent prompts; input and output lengths uniform in the inclusive ranges given."""
    _check_range("input_len", input_len)
    _check_range("output_len", output_len)
    rng = random.Random(seed)
    requests = [
        BenchRequest(_sample_ids(rng, token_ids, rng.randint(*input_len)), rng.randint(*output_len))
        for _ in range(num_requests)
    ]
    params = {"input_len": list(input_len), "output_len": list(output_len), "seed": seed}
    return Workload("random", requests, params)


def shared_prefix_workload(
    num_requests: int,
    token_ids: Sequence[int],
    prefix_len: int = 400,
    question_len: tuple[int, int] = (16, 48),
    output_len: tuple[int, int] = (16, 64),
    num_prefixes: int = 1,
    seed: int = 0,
) -> Workload:
    """``num_prefixes`` system prompts of ``prefix_len`` tokens, each request one of them + a unique question.

    Requests cycle through the prefixes (request ``i`` uses prefix ``i % num_prefixes``).
    """
    if prefix_len < 1 or num_prefixes < 1:
        raise ValueError(f"prefix_len and num_prefixes must be >= 1, got {prefix_len} and {num_prefixes}")
    _check_range("question_len", question_len)
    _check_range("output_len", output_len)
    rng = random.Random(seed)
    prefixes = [_sample_ids(rng, token_ids, prefix_len) for _ in range(num_prefixes)]
    requests = [
        BenchRequest(
            prefixes[i % num_prefixes] + _sample_ids(rng, token_ids, rng.randint(*question_len)),
            rng.randint(*output_len),
        )
        for i in range(num_requests)
    ]
    params = {
        "prefix_len": prefix_len,
        "num_prefixes": num_prefixes,
        "question_len": list(question_len),
        "output_len": list(output_len),
        "seed": seed,
    }
    return Workload("shared-prefix", requests, params)


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "random": random_workload,
    "shared-prefix": shared_prefix_workload,
}


def build_workload(name: str, num_requests: int, token_ids: Sequence[int], **params: Any) -> Workload:
    """The workload called ``name`` (see :data:`WORKLOAD_NAMES`) with its own keyword parameters."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload '{name}'; available: {', '.join(WORKLOAD_NAMES)}")
    return WORKLOADS[name](num_requests, token_ids, **params)


def serving_workload(args: Any, token_ids: Sequence[int]) -> Workload:
    """The workload ``treadle bench serving``'s arguments name (``workload``, ``num_prompts``, ``seed``,
    ``output_len``, and ``input_len`` or ``prefix_len``/``num_prefixes``/``question_len``): other benchmarks that
    take the same arguments replay exactly its requests."""
    params: dict[str, Any] = {"output_len": parse_len_range(args.output_len), "seed": args.seed}
    if args.workload == "random":
        params["input_len"] = parse_len_range(args.input_len)
    else:
        params.update(prefix_len=args.prefix_len, num_prefixes=args.num_prefixes,
                      question_len=parse_len_range(args.question_len))
    return build_workload(args.workload, args.num_prompts, token_ids, **params)


def parse_len_range(text: str) -> tuple[int, int]:
    """``"32:512"`` → (32, 512); ``"64"`` → (64, 64)."""
    parts = text.split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (None, None)
    except ValueError:
        low = high = None
    if low is None or high is None:
        raise ValueError(f"length range '{text}' must look like MIN:MAX (e.g. 32:512) or a single number")
    _check_range(text, (low, high))
    return low, high


def _sample_ids(rng: random.Random, token_ids: Sequence[int], length: int) -> list[int]:
    return [token_ids[rng.randrange(len(token_ids))] for _ in range(length)]


def _check_range(name: str, bounds: tuple[int, int]) -> None:
    low, high = bounds
    if low < 1 or high < low:
        raise ValueError(f"{name} range ({low}, {high}) must satisfy 1 <= MIN <= MAX")
