"""The end-to-end half of ``treadle bench lora``: the base model alone against the same model serving random PEFT
adapters, through ``Engine.generate``, in one run.

Adapters are written first: random rank-``rank`` PEFT folders (``adapter_config.json`` + safetensors) on all seven
projections of the model's shape. Then one Engine of the base model runs the offline workload (the 1000-request
``random`` workload of ``treadle bench offline``) and decode steps at one and at 32 requests; it is shut down and
an Engine with ``lora.paths`` naming the adapters runs the same, the offline requests spread round-robin over the
first ``spread`` adapters, the bs=1 steps with an adapter and the bs=32 steps with 32 different ones. A decode
step is timed as ``treadle bench one-batch``'s Engine rows time it: ``(time for N new tokens - time for 1) / (N -
1)``, the median over repeated pairs of calls.

Needs the LoRA side of the engine (config ``lora.*`` and ``Engine.generate(..., lora_path=...)``):
:func:`lora_api_missing` says what is absent, and the command then runs the kernel half only.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from treadle.bench.workloads import Workload

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DECODE_PROMPT_TOKENS = 128


def lora_api_missing() -> str | None:
    """Why the engine cannot serve adapters yet (None when it can)."""
    from treadle.core.config import ServerConfig
    from treadle.core.engine import Engine

    missing = []
    if "lora" not in ServerConfig.model_fields:
        missing.append("the config has no 'lora' section (lora.paths, lora.max_loras_per_batch, ...)")
    if "lora_path" not in inspect.signature(Engine.generate).parameters:
        missing.append("Engine.generate takes no lora_path")
    if not missing:
        return None
    return ("the end-to-end LoRA benchmark needs treadle's LoRA serving (issue 50's engine side): "
            + "; ".join(missing))


def write_adapters(folder: Path, model_config: dict[str, Any], count: int, rank: int, seed: int = 0,
                   device: str = "cpu") -> dict[str, str]:
    """``count`` random rank-``rank`` PEFT adapters for the HF ``model_config``'s shape, on all seven projections;
    returns ``{name: folder}``. Values are small (std 0.01), bfloat16 on disk, drawn on ``device`` (``cuda``: the
    32 adapters of Llama-3.1-8B's shape, 2.7 GB, in seconds rather than the CPU's minute)."""
    from safetensors.torch import save_file

    hidden, intermediate = model_config["hidden_size"], model_config["intermediate_size"]
    head_dim = model_config.get("head_dim") or hidden // model_config["num_attention_heads"]
    kv = model_config["num_key_value_heads"] * head_dim
    q = model_config["num_attention_heads"] * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate), "down_proj": (intermediate, hidden)}
    gen = torch.Generator(device=device).manual_seed(seed)
    paths = {}
    for index in range(count):
        path = folder / f"adapter{index:02d}"
        path.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for layer in range(model_config["num_hidden_layers"]):
            for name, (in_features, out_features) in shapes.items():
                block = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{prefix}.lora_A.weight"] = _random(rank, in_features, gen, device)
                tensors[f"{prefix}.lora_B.weight"] = _random(out_features, rank, gen, device)
        save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
            "target_modules": list(TARGET_MODULES), "bias": "none", "use_rslora": False,
            "base_model_name_or_path": model_config.get("_name_or_path", "llama-3.1-8b-shape"),
        }, indent=2))
        paths[f"adapter{index:02d}"] = str(path)
    return paths


def _random(rows: int, cols: int, gen: torch.Generator, device: str) -> torch.Tensor:
    return (torch.randn(rows, cols, generator=gen, device=device) * 0.01).bfloat16().cpu()


def run_engine_side(base_overrides: dict[str, Any], lora_overrides: dict[str, Any], adapters: list[str],
                    workload: Workload, spread: int, repeats: int, decode_tokens: int,
                    kernel_variants: tuple[str, ...] = ()) -> dict[str, Any]:
    """Offline throughput and bs=1 / bs=32 decode steps of the base model, then of the model with adapters; then
    once more with adapters per ``kernel_variants`` entry (``TREADLE_LORA_KERNELS`` text, e.g.
    ``dense_above=1048576``: the triton backend's choice for that engine), its ratios against the same base."""
    base = _measure(base_overrides, workload, None, repeats, decode_tokens)
    names = {"offline": [adapters[i % spread] for i in range(workload.num_requests)], "bs1": adapters[:1],
             "bs32": adapters[:32]}
    with_lora = _measure({**base_overrides, **lora_overrides}, workload, names, repeats, decode_tokens)
    result = {"base": base, "lora": with_lora, "spread_over_adapters": spread, **_ratios(with_lora, base)}
    variants = {}
    for variant in kernel_variants:
        with _kernels_env(variant):
            measured = _measure({**base_overrides, **lora_overrides}, workload, names, repeats, decode_tokens)
        variants[variant] = {"lora": measured, **_ratios(measured, base)}
        print(f"kernels {variant}: offline {variants[variant]['offline_ratio']:.3f}x the base", flush=True)
    if variants:
        result["kernel_variants"] = variants
    return result


@contextlib.contextmanager
def _kernels_env(text: str) -> Iterator[None]:
    """``TREADLE_LORA_KERNELS=text`` while an engine is built and run (its triton backend reads it when built)."""
    before = os.environ.get("TREADLE_LORA_KERNELS")
    os.environ["TREADLE_LORA_KERNELS"] = text
    try:
        yield
    finally:
        if before is None:
            del os.environ["TREADLE_LORA_KERNELS"]
        else:
            os.environ["TREADLE_LORA_KERNELS"] = before


def _ratios(with_lora: dict[str, Any], base: dict[str, Any]) -> dict[str, float]:
    return {"offline_ratio": with_lora["offline_output_tok_s"] / base["offline_output_tok_s"],
            "bs1_step_ratio": with_lora["bs1_step_ms"] / base["bs1_step_ms"],
            "bs32_step_ratio": with_lora["bs32_step_ms"] / base["bs32_step_ms"]}


def _measure(overrides: dict[str, Any], workload: Workload, names: dict[str, list[str]] | None, repeats: int,
             decode_tokens: int) -> dict[str, Any]:
    from treadle.bench.roofline import free_memory
    from treadle.core.config import load_config
    from treadle.core.engine import Engine

    started = time.perf_counter()
    engine = Engine(load_config(overrides=overrides, use_env=False))
    start_s = time.perf_counter() - started
    try:
        lora = (lambda key: {"lora_path": names[key]}) if names else (lambda key: {})
        requests = workload.requests
        # Warm-up: enough prompts for several prefill chunks of every size class (the kernels that prefill chunks
        # past the piecewise graphs' sizes run are compiled here, not inside the timed run) and decode up to 64.
        warmup = 64
        _generate(engine, [r.input_ids for r in requests[:warmup]], [16] * warmup,
                  **({"lora_path": names["offline"][:warmup]} if names else {}))
        engine.flush_cache()
        seconds = _generate(engine, [r.input_ids for r in requests], [r.output_len for r in requests],
                            **lora("offline"))
        result = {"engine_start_s": start_s, "offline_s": seconds,
                  "offline_output_tok_s": workload.output_tokens / seconds, "offline_requests": workload.num_requests}
        for bs, key in ((1, "bs1"), (32, "bs32")):
            prompts = [[(7 * i + j) % 1000 + 100 for j in range(DECODE_PROMPT_TOKENS)] for i in range(bs)]
            result[f"{key}_step_ms"] = 1e3 * _decode_step(engine, prompts, decode_tokens, repeats, **lora(key))
        result["total_s"] = time.perf_counter() - started
        print(f"{'with adapters' if names else 'base model'}: engine start {start_s:.1f} s, offline {seconds:.1f} s, "
              f"{result['total_s']:.1f} s in all", flush=True)
        return result
    finally:
        engine.shutdown()
        del engine
        free_memory()


def _generate(engine: Any, prompts: list[list[int]], output_lens: list[int], **extra: Any) -> float:
    """Seconds for ``Engine.generate`` of greedy requests of exactly these output lengths."""
    params = [{"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True} for n in output_lens]
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params=params, **extra)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _decode_step(engine: Any, prompts: list[list[int]], new_tokens: int, repeats: int, **extra: Any) -> float:
    """Median seconds of one decode step: pairs of calls for 1 and for ``new_tokens`` tokens (prefix cache
    flushed before each, so both prefill alike)."""

    def timed(n: int) -> float:
        engine.flush_cache()
        return _generate(engine, prompts, [n] * len(prompts), **extra)

    timed(4)  # warm-up
    steps = []
    for _ in range(repeats):
        one = timed(1)
        steps.append((timed(new_tokens) - one) / (new_tokens - 1))
    return statistics.median(steps)
