"""treadle's own ``Engine.generate`` on the one-batch workload, timed the way the HF peers' ``generate`` is.

The runner rows of ``treadle bench one-batch`` time each decode step with a device synchronize, a stricter
clock than the peers get: ``generate`` is timed whole, and a decode step is
``(time for N new tokens - time for 1) / (N - 1)``, the median over ``--generate-repeats`` pairs of calls
(``whole_call_steps``). This row gives treadle the same clock through its public
offline API, with the scheduler as a user runs it (overlap scheduling on unless the variant turns it off: the
host builds step N+1 while the GPU runs step N).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from treadle.bench.one_batch_report import Measurement, measurement, whole_call_steps
from treadle.bench.roofline import free_memory, roofline_seconds, synchronize


def run_engine(model_dir: str, backend: str, variant_overrides: dict[str, Any], label: str,
               prompts_by_bs: dict[int, torch.Tensor], args: argparse.Namespace, device: torch.device,
               bandwidth: float) -> list[Measurement]:
    """One Engine for ``backend`` with the variant's overrides; a row per batch size in ``prompts_by_bs``."""
    from treadle import Engine, SamplingParams
    from treadle.core.config import load_config

    max_bs = max(prompts_by_bs)
    engine = Engine(load_config(overrides={
        "model.path": model_dir, "model.load_format": "dummy", "model.dtype": args.dtype,
        "model.device": device.type, "model.context_length": args.context_length, "attention.backend": backend,
        # Graphs (and requests) only up to the largest batch timed: the same decode graphs, a shorter start.
        "scheduler.max_running_requests": max_bs, "runtime.cuda_graph_max_bs": max_bs,
        **variant_overrides,
    }, use_env=False))
    rows = []
    try:
        for bs, prompts in sorted(prompts_by_bs.items()):
            token_lists = prompts.tolist()

            def generate(new_tokens: int) -> tuple[float, list[int]]:
                params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
                engine.flush_cache()  # every call prefills the whole prompt, as HF's does
                synchronize(device)
                start = time.perf_counter()
                outputs = engine.generate(input_ids=token_lists, sampling_params=params)
                synchronize(device)
                return time.perf_counter() - start, outputs[0].token_ids

            generate(4)  # warm-up
            one, steps, tokens = whole_call_steps(generate, args.decode_steps, args.generate_repeats)
            runner = engine.scheduler.worker.runner
            rows.append(measurement(
                f"treadle Engine.generate {label}", backend, True, bs, one, steps, tokens[:16],
                roofline_seconds(runner.model, runner, bs, prompts.shape[1], args.decode_steps, bandwidth),
                engine=True))
            del runner  # a reference left here would keep the model and KV pool alive past shutdown
    finally:
        engine.shutdown()
        free_memory()
    return rows

