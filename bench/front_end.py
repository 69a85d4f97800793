"""The server's front end on the CPU: how many streamed tokens per second it carries, and what each process pays.

``python -m treadle.bench.front_end [--streams 600] [--output-len 16:400] [--step-ms 0] [--set server.workers=4]``
``python -m treadle.bench.front_end --part wire``

A real server (``treadle.server.launch.serve``: HTTP workers, detokenizers, the scheduler process's loop and its
ZMQ sockets) runs with a stand-in in place of the model: :class:`StandInScheduler` gives every running request one
token id per step (``--step-ms`` apart, 0: as fast as the front end takes them), up to
``scheduler.max_running_requests`` at once, without computing anything. ``bench/serving.py``'s client streams the
``--streams`` requests from ``--client-processes`` processes. It prints the streamed tokens per second and, for
every server process, its CPU time (``/proc``) over the run's streamed tokens (every worker's, so with several HTTP
workers each one's line is its share); the scheduler process's line leaves out the
stand-in's own work (its ``step()``), so it is the cost of the real loop's output path (ZMQ's I/O thread included).

``--part wire`` times only what a step's outputs cost each process to pass on (pickling, the detokenizer's routing
without a tokenizer, unpickling into StrOutputs), per output, as one pickled object per output beside the messages
by field the server sends: figures that a machine busy with other work disturbs less.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import sys
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Sequence

import httpx

from treadle.bench.serving import run_workers, summarize
from treadle.bench.workloads import BenchRequest, parse_len_range
from treadle.core import validation
from treadle.core.config import ServerConfig, load_config
from treadle.core.request import FinishReason, Req, ReqOutput

_VOCAB_SIZE = 32000
_CONTEXT_LEN = 8192


@dataclass
class _Stream:
    req: Req
    generated: int = 0


class StandInScheduler:
    """What ``server/scheduler_process.py``'s loop needs of a ``Scheduler``, with token ids made up instead of
    computed: each step, every running request gets one id (``FinishReason.LENGTH`` at its ``max_new_tokens``)."""

    def __init__(self, config: ServerConfig, step_s: float, tokenizer: Any = None) -> None:
        self.config = config
        self.step_s = step_s
        self.tokenizer = tokenizer
        self.max_running = int(config.scheduler.max_running_requests)
        self.waiting: deque[Req] = deque()
        self.running: dict[str, _Stream] = {}
        self.live_by_rid: dict[str, Req] = {}
        self.lora = None
        self.allocator = _Slots(total_slots=1 << 20)
        self.request_limits = validation.RequestLimits(context_len=_CONTEXT_LEN, vocab_size=_VOCAB_SIZE,
                                                       kv_slots=1 << 20)
        self.model_info = {"model_path": "stand-in", "served_model_name": "stand-in", "architecture": "StandIn",
                           "context_len": _CONTEXT_LEN, "vocab_size": _VOCAB_SIZE, "eos_token_ids": [],
                           "dtype": "bfloat16", "device": "cpu", "has_tokenizer": tokenizer is not None,
                           "task": "generate"}
        self.ids = random.Random(0)
        self.next_step_at = 0.0
        self.step_cpu_s = 0.0  # inside step(): the stand-in's own work, left out of the loop's cost
        self.steps = 0
        self.finished = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, req: Req) -> None:
        self.waiting.append(req)
        self.live_by_rid[req.rid] = req

    def step(self) -> list[ReqOutput]:
        now = time.monotonic()
        if self.next_step_at > now:
            time.sleep(self.next_step_at - now)
        self.next_step_at = max(now, self.next_step_at) + self.step_s
        cpu = time.process_time()
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting.popleft()
            self.running[req.rid] = _Stream(req)
        token = self.ids.randrange(1000, _VOCAB_SIZE)
        outputs = [self._advance(stream, token) for stream in self.running.values()]
        for output in outputs:
            if output.finished_reason is not None:
                self._forget(output.rid)
        self.steps += 1
        self.step_cpu_s += time.process_time() - cpu
        return outputs

    def _advance(self, stream: _Stream, token: int) -> ReqOutput:
        stream.generated += 1
        req = stream.req
        done = stream.generated >= req.sampling_params.max_new_tokens
        return ReqOutput(req.rid, [token], FinishReason.LENGTH if done else None, None,
                         len(req.origin_input_ids), stream.generated, 0)

    def _forget(self, rid: str) -> None:
        self.running.pop(rid, None)
        self.live_by_rid.pop(rid, None)
        self.finished += 1

    def abort_request(self, rid: str) -> ReqOutput | None:
        stream = self.running.get(rid)
        req = stream.req if stream else self.live_by_rid.get(rid)
        if req is None:
            return None
        self.waiting = deque(r for r in self.waiting if r.rid != rid)
        self._forget(rid)
        return ReqOutput(rid, [], FinishReason.ABORT, None, len(req.origin_input_ids),
                         stream.generated if stream else 0, 0)

    def flush_cache(self) -> bool:
        return True

    def kv_stats(self) -> dict[str, Any]:
        return {"total_slots": self.allocator.total_slots, "free_slots": self.allocator.total_slots,
                "running": len(self.running), "waiting": len(self.waiting), "live_requests": len(self.live_by_rid),
                "finished": self.finished, "cached_tokens_total": 0, "stand_in_steps": self.steps,
                "stand_in_step_cpu_s": self.step_cpu_s}


@dataclass
class _Slots:
    total_slots: int


def run_stand_in_scheduler(config: ServerConfig, addresses: Any, ready: Connection,
                           report_finished: bool = False) -> None:
    """The scheduler process's entry point with a :class:`StandInScheduler` (``TREADLE_STAND_IN_STEP_MS`` apart)."""
    from treadle.server.front_profile import start_profile
    from treadle.server.ipc import DetokenizerInit
    from treadle.server.process_utils import before_exit_on_sigterm, configure_child_process
    from treadle.server.scheduler_process import SchedulerLoop, server_model_info

    parent_pid = configure_child_process(config.server.log_level)
    write_profile = start_profile("scheduler")  # TREADLE_FRONT_PROFILE: the stand-in's process too
    if write_profile is not None:
        before_exit_on_sigterm(write_profile)
    tokenizer = _load_tokenizer(os.environ.get("TREADLE_STAND_IN_TOKENIZER"))
    scheduler = StandInScheduler(config, float(os.environ.get("TREADLE_STAND_IN_STEP_MS", "0")) / 1e3, tokenizer)
    loop = SchedulerLoop(scheduler, addresses, parent_pid, report_finished)
    loop.detokenizers.send_to_all(DetokenizerInit(tokenizer))
    ready.send(("ready", server_model_info(scheduler), tokenizer))
    ready.close()
    try:
        loop.run()
    finally:
        loop.close()


def _load_tokenizer(path: str | None) -> Any:
    if not path:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _serve(config_json: str) -> None:
    from treadle.server.launch import serve

    serve(ServerConfig(**json.loads(config_json)), scheduler_target=run_stand_in_scheduler)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def workload(streams: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(1000, _VOCAB_SIZE) for _ in range(rng.randint(*input_len))],
                         rng.randint(*output_len)) for _ in range(streams)]


def run(config: ServerConfig, streams: int, input_len: tuple[int, int], output_len: tuple[int, int],
        step_ms: float, client_processes: int, api: str, tokenizer: str | None) -> dict[str, Any]:
    """Serve the stand-in, stream the workload through it, and measure; returns the JSON record."""
    env = {"TREADLE_STAND_IN_STEP_MS": str(step_ms), "TREADLE_STAND_IN_TOKENIZER": tokenizer or ""}
    os.environ.update(env)
    server = mp.get_context("spawn").Process(target=_serve, args=(json.dumps(config.model_dump(mode="json")),))
    server.start()
    base_url = f"http://{config.server.host}:{config.server.port}"
    try:
        _wait_healthy(base_url, server)
        before, steps_before = _process_cpu(base_url)
        results, wall = run_workers(base_url, workload(streams, input_len, output_len, 0), float("inf"), None, api,
                                    None, None, 0, client_processes)
        after, steps_after = _process_cpu(base_url)
    finally:
        server.terminate()
        server.join(30)
    summary = summarize(results, wall)
    tokens = max(1, summary["total_output_tokens"])
    per_token = {name: 1e6 * (after[name] - before[name]) / tokens for name in after if name in before}
    return {"benchmark": "front_end", "streams": streams, "step_ms": step_ms, "api": api,
            "server": {"workers": config.server.workers, "detokenizers": config.server.detokenizers},
            "client_processes": client_processes, "tokenizer": tokenizer, "summary": summary,
            "stand_in_steps": steps_after - steps_before, "cpu_us_per_token": per_token}


def _wait_healthy(base_url: str, server: Any, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not server.is_alive():
            raise RuntimeError(f"the server exited during startup (exit code {server.exitcode})")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server did not answer /health within {timeout:.0f} s")


def _process_cpu(base_url: str) -> tuple[dict[str, float], int]:
    """CPU seconds of every server process (the scheduler's without the stand-in's own steps), and the stand-in's
    steps so far."""
    info = httpx.get(f"{base_url}/get_server_info", timeout=30).json()
    cpu = {name: cpu_seconds(pid) for name, pid in info["pids"].items() if pid}
    cpu["scheduler"] -= float(info["kv"]["stand_in_step_cpu_s"])
    return cpu, int(info["kv"]["stand_in_steps"])


def format_table(record: dict[str, Any]) -> str:
    summary = record["summary"]
    lines = [f"streamed {summary['total_output_tokens']} tokens of {summary['completed']} requests "
             f"({summary['failed']} failed) in {summary['duration_s']:.2f} s: "
             f"{summary['output_token_throughput']:,.0f} tok/s; ITL p50 {summary['itl_ms']['p50']:.1f} ms",
             f"the stand-in made {record['stand_in_steps']} steps: "
             f"{record['stand_in_steps'] * record['step_ms'] / 1e3:.2f} s at {record['step_ms']:g} ms a step is the "
             "engine's span; the client's time beyond it is the front end's",
             f"{'process':<16} {'CPU us/token':>12}"]
    for name, value in sorted(record["cpu_us_per_token"].items()):
        lines.append(f"{name:<16} {value:>12.1f}")
    lines.append(f"{'all':<16} {sum(record['cpu_us_per_token'].values()):>12.1f}")
    return "\n".join(lines)


def wire_costs(outputs_per_step: int = 512, repeats: int = 50) -> dict[str, dict[str, float]]:
    """Microseconds per output that each hop spends on a decode step's outputs: ``objects`` (one pickled object per
    output) against ``columns`` (:class:`~treadle.server.output_columns.OutputColumns`, what the server sends)."""
    import pickle
    import uuid

    from treadle.server.detokenizer import Detokenizer
    from treadle.server.ipc import BatchStrOut, BatchTokenIDOut, StrOutput

    outputs = [ReqOutput(uuid.uuid4().hex, [1234], None, None, 300, i, 0) for i in range(outputs_per_step)]
    detokenizer = Detokenizer()
    detokenizer.worker_of.update((output.rid, 0) for output in outputs)

    def objects_detokenizer(data: bytes) -> bytes:
        return pickle.dumps([StrOutput(**{**vars(output), "text_delta": ""}) for output in pickle.loads(data)])

    def columns_detokenizer(data: bytes) -> bytes:
        return pickle.dumps(detokenizer.handle_routed(pickle.loads(data))[0])

    hops = {
        "objects": (lambda: pickle.dumps(outputs), objects_detokenizer, pickle.loads),
        "columns": (lambda: pickle.dumps(BatchTokenIDOut(outputs)), columns_detokenizer,
                    lambda data: pickle.loads(data).outputs),
    }
    costs: dict[str, dict[str, float]] = {}
    for form, (scheduler, detokenize, worker) in hops.items():
        to_detokenizer = scheduler()
        to_worker = detokenize(to_detokenizer)
        assert len(worker(to_worker)) == outputs_per_step and isinstance(pickle.loads(to_worker), (list, BatchStrOut))
        costs[form] = {name: _best_us(lambda: step(data), repeats) / outputs_per_step for name, step, data in (
            ("scheduler", lambda _: scheduler(), None), ("detokenizer", detokenize, to_detokenizer),
            ("http worker", worker, to_worker))}
    return costs


def _best_us(call: Any, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return best * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="treadle bench front-end", description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["serve", "wire"], default="serve",
                        help="serve: the whole front end; wire: what passing a step's outputs on costs per hop")
    parser.add_argument("--streams", type=int, default=600, help="requests, all sent at once")
    parser.add_argument("--input-len", default="16:600", help="MIN:MAX prompt tokens")
    parser.add_argument("--output-len", default="16:400", help="MIN:MAX output tokens")
    parser.add_argument("--step-ms", type=float, default=0.0, help="stand-in step interval (0: as fast as it can)")
    parser.add_argument("--client-processes", type=int, default=2)
    parser.add_argument("--api", choices=["native", "openai"], default="native")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer folder: the detokenizer decodes for real")
    parser.add_argument("--max-running", type=int, default=512, help="scheduler.max_running_requests")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a server config key")
    parser.add_argument("--output", default=None, help="JSON path")
    args = parser.parse_args(argv)
    if args.part == "wire":
        costs = wire_costs()
        print(f"{'us per output':<14} " + " ".join(f"{hop:>12}" for hop in costs["columns"]))
        for form, hops in costs.items():
            print(f"{form:<14} " + " ".join(f"{value:>12.2f}" for value in hops.values()))
        return 0
    port = _free_port()
    config = load_config(None, overrides=[f"server.port={port}", "server.log_level=warning",
                                          f"scheduler.max_running_requests={args.max_running}",
                                          "server.max_queued_requests=100000", *args.set])
    record = run(config, args.streams, parse_len_range(args.input_len), parse_len_range(args.output_len),
                 args.step_ms, args.client_processes, args.api, args.tokenizer)
    record["command"] = "python -m treadle.bench.front_end " + " ".join(argv if argv is not None else sys.argv[1:])
    print(format_table(record))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(record, indent=2))
        print(f"wrote {args.output}")
    return 0 if record["summary"]["failed"] == 0 else 1


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    raise SystemExit(main())
