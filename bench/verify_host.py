"""The host's critical path of a verify step: from the moment a verify step's results are on the host to the moment
the next verify step's forward is queued (the device idles in between at batch size 1), per step, with the torch
operators run in that stretch counted. With overlapped verify (``speculative.overlap``, on where supported: ``--overlap
auto``) the next step is queued before the results are read, so that window is gone; what the device then waits
for is the host's work per step, from one verify launch to the next with the model's forward and the waits for
results left out (it must stay below the device's step time), printed on a second line for either path.

The model forward itself is excluded (on the CPU it computes; on the GPU a graph replay's launch stays in): the
window is timed by a step observer (``results_arrived`` -> ``forward_launched``) and the time spent inside the model
runner's forward is subtracted. The test ``oracle`` speculator proposes the plain run's own continuation, so every
draft is kept (``--keep N``: N drafts a step, the rest's KV given back). ``--method eagle3`` drafts with a random
EAGLE-3 head of the shape's published head instead (nearly no draft kept; the head's steps are host work here, on
the CPU their computing too)::

    python -m treadle.bench.verify_host                       # CPU: a tiny Llama, torch_native
    python -m treadle.bench.verify_host --device cuda --backend auto --shape 8b [--profile 25] [--keep 2]
    python -m treadle.bench.verify_host --device cuda --backend auto --shape 8b --method eagle3 --overlap false

Prints the window's steps, median host microseconds per step and torch operators per step (none where every step
overlapped), then the host microseconds of work per step from launch to launch.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from treadle.bench.shapes import LLAMA_3_1_8B, write_config
from treadle.core.execution.forward_batch import ForwardMode
from treadle.core.scheduling.observers import StepObserver
from treadle.testing.eagle3_heads import make_eagle3_head

TINY = {**LLAMA_3_1_8B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512,
        "max_position_embeddings": 4096, "rope_scaling": None, "bos_token_id": 1, "eos_token_id": 2}


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops += 1
        return func(*args, **(kwargs or {}))


class CriticalPath(StepObserver):
    """Times ``results_arrived`` (of a verify step, read before the next batch is built) -> ``forward_launched``."""

    def __init__(self, count_ops: bool, profile: cProfile.Profile | None = None) -> None:
        self.profile = profile  # a cProfile of the window (host functions by own time), where given
        self.start: float | None = None
        self.armed = False
        self.excluded = 0.0
        self.samples: list[float] = []
        self.ops: list[int] = []
        self.counter = _OpCounter() if count_ops else None

    def step_started(self) -> None:
        self.armed = True  # the verify results read before the batch is built, not those read by settle()

    def batch_built(self, batch: Any) -> None:
        self.armed = False
        if batch is None and self.start is not None:  # nothing left to launch: no window
            self._close()

    def _close(self) -> float:
        if self.profile is not None:
            self.profile.disable()
        elapsed = time.perf_counter() - self.start - self.excluded
        self.start = None
        if self.counter is not None:
            self.counter.__exit__(None, None, None)
        return elapsed

    def results_arrived(self, step: Any) -> None:
        if self.armed and step.batch.forward_mode is ForwardMode.TARGET_VERIFY:
            self.excluded = 0.0
            if self.counter is not None:
                self.counter.ops = 0
                self.counter.__enter__()
            self.start = time.perf_counter()
            if self.profile is not None:
                self.profile.enable()

    def forward_launched(self, batch: Any, step: Any) -> None:
        if self.start is None:
            return
        elapsed = self._close()
        if batch.forward_mode is ForwardMode.TARGET_VERIFY:
            self.samples.append(elapsed)
            if self.counter is not None:
                self.ops.append(self.counter.ops)

    def wrap_forward(self, runner: Any) -> None:
        """Time the model runner's forward (subtracted from the window) and leave its operators uncounted."""
        forward = runner.forward

        def timed(forward_batch):
            if self.counter is not None:
                self.counter.paused = True
            profiling = self.profile is not None and self.start is not None
            if profiling:
                self.profile.disable()
            start = time.perf_counter()
            try:
                return forward(forward_batch)
            finally:
                self.excluded += time.perf_counter() - start
                if self.counter is not None:
                    self.counter.paused = False
                if profiling:
                    self.profile.enable()

        runner.forward = timed


class LaunchToLaunch(StepObserver):
    """Host time from one verify step's launch to the next one's, less the model's forward and the waits for
    results: the work an overlapped verify step must hide under the device's (``overlapped`` counts the steps queued
    before the one they follow was read, ``ScheduleBatch.follows``)."""

    def __init__(self) -> None:
        self.last: float | None = None
        self.excluded = 0.0
        self.waiting_since = 0.0
        self.samples: list[float] = []
        self.overlapped = 0

    def batch_built(self, batch: Any) -> None:
        if batch is None:
            self.last = None  # the run ended: no step follows

    def results_waiting(self, step: Any) -> None:
        self.waiting_since = time.perf_counter()

    def results_arrived(self, step: Any) -> None:
        self.excluded += time.perf_counter() - self.waiting_since

    def forward_launched(self, batch: Any, step: Any) -> None:
        if batch.forward_mode is not ForwardMode.TARGET_VERIFY:
            self.last = None
            return
        now = time.perf_counter()
        if self.last is not None:
            self.samples.append(now - self.last - self.excluded)
            self.overlapped += batch.follows is not None
        self.last, self.excluded = now, 0.0

    def wrap_forward(self, runner: Any) -> None:
        forward = runner.forward

        def timed(forward_batch):
            start = time.perf_counter()
            try:
                return forward(forward_batch)
            finally:
                self.excluded += time.perf_counter() - start

        runner.forward = timed


def main(argv: Sequence[str] | None = None) -> int:
    from treadle import Engine, SamplingParams
    from treadle.core.config import load_config

    args = _parser().parse_args(argv)
    shape = LLAMA_3_1_8B if args.shape == "8b" else TINY
    if args.method == "eagle3" and args.shape == "tiny":  # the head reads three distinct layers' inputs
        shape = {**TINY, "num_hidden_layers": 2}
    model_dir = write_config(Path(tempfile.mkdtemp(prefix="treadle-vh-")), shape)
    config = {"model.path": model_dir, "model.load_format": "dummy",
              "model.dtype": "bfloat16" if args.device == "cuda" else "float32",
              "model.context_length": args.prompt_len + args.new_tokens + 64, "attention.backend": args.backend,
              "scheduler.max_running_requests": args.batch_size, "runtime.cuda_graph_max_bs": args.batch_size,
              "plugins": ["treadle.testing.speculator_plugins"], "speculative.method": "oracle",
              "speculative.num_tokens": args.num_tokens, "speculative.max_batch_size": args.batch_size,
              "speculative.overlap": {"auto": "auto", "true": True, "false": False}[args.overlap]}
    if args.method == "eagle3":
        head = make_eagle3_head(Path(model_dir) / "eagle3", shape, 32000 if args.shape == "8b" else 128,
                                None if args.shape == "8b" else [-1, 0, 1], scale=0.02,
                                dtype=torch.bfloat16 if args.device == "cuda" else torch.float32)
        config.update({"speculative.method": "eagle3", "speculative.draft_model_path": head,
                       "plugins": ["treadle.plugins.speculators.eagle3"]})
    if args.device == "cpu":
        config["model.device"] = "cpu"
    engine = Engine(load_config(overrides=config, use_env=False))
    try:
        prompts = torch.randint(3, shape["vocab_size"] - 1, (args.batch_size, args.prompt_len),
                                generator=torch.Generator().manual_seed(0)).tolist()
        params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
        if args.method == "oracle":
            oracle = engine.scheduler.worker.speculator
            own = engine.generate(input_ids=prompts, sampling_params=params)
            oracle.references = {tuple(p): o.token_ids for p, o in zip(prompts, own)}
            oracle.wrong_at = args.keep  # None: every draft kept
        engine.generate(input_ids=prompts, sampling_params=params)  # warm-up
        meter = CriticalPath(count_ops=True)
        meter.wrap_forward(engine.scheduler.worker.runner)
        engine.scheduler.add_observer(meter)
        engine.flush_cache()
        engine.generate(input_ids=prompts, sampling_params=params)
        ops = sorted(meter.ops)[len(meter.ops) // 2] if meter.ops else 0
        profile = cProfile.Profile() if args.profile else None
        timer = CriticalPath(count_ops=False, profile=profile)
        timer.wrap_forward(engine.scheduler.worker.runner)
        overlapped = LaunchToLaunch()
        overlapped.wrap_forward(engine.scheduler.worker.runner)
        engine.scheduler.remove_observer(meter)
        engine.scheduler.add_observer(timer)
        engine.scheduler.add_observer(overlapped)
        for _ in range(args.repeats):
            engine.flush_cache()
            engine.generate(input_ids=prompts, sampling_params=params)
        samples = sorted(timer.samples)
        median = samples[len(samples) // 2] if samples else float("nan")
        kept = ("all" if args.keep is None else args.keep) if args.method == "oracle" else "few (random eagle3 head)"
        print(f"verify host critical path: {len(samples)} steps, median {1e6 * median:.0f} us/step, "
              f"{ops} torch ops/step (bs={args.batch_size}, k={args.num_tokens}, kept {kept}, {args.device}, "
              f"{args.backend})")
        steps = sorted(overlapped.samples)
        median = steps[len(steps) // 2] if steps else float("nan")
        print(f"verify host work per step: {len(steps)} steps ({overlapped.overlapped} overlapped), median "
              f"{1e6 * median:.0f} us/step (launch to launch, forwards and waits left out; speculative.overlap "
              f"{args.overlap})")
        if profile is not None:
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(args.profile)
            print(out.getvalue())
    finally:
        engine.shutdown()
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--backend", default="torch_native")
    parser.add_argument("--shape", choices=["tiny", "8b"], default="tiny")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--num-tokens", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=129)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep", type=int, default=None, help="drafts kept a step (the oracle's next one is wrong, "
                        "so the KV of the rest goes back each step); default: every draft")
    parser.add_argument("--method", choices=["oracle", "eagle3"], default="oracle",
                        help="the speculator: the test oracle, or eagle3 with a random head")
    parser.add_argument("--overlap", choices=["auto", "true", "false"], default="auto",
                        help="speculative.overlap: overlapped verify steps (auto: where supported)")
    parser.add_argument("--profile", type=int, default=0, help="print the N host functions of most own time "
                        "in the window (cProfile; inflates the times above)")
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
