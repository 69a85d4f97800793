"""Rank 0's per-step commands reaching the other ranks: the shared-memory channel against gloo.

    python -m treadle.bench.tp_step_broadcast            # both parts on a 2-GPU machine (treadle bench tp-step-broadcast)
    python -m treadle.bench.tp_step_broadcast --skip-engine   # the latency part alone (runs on the CPU)

Part 1 (``--skip-latency`` leaves it out): two processes on the CPU; rank 0 sends ``--messages`` messages through
each transport (``tp_broadcast_object`` over the gloo group, as before; the shared-memory channel of
``core/distributed/shm_channel.py``), each stamped with the clock when sent, pausing ``--gap-us`` before each so
that rank 1 already waits, as it does between steps; rank 1 notes when it has unpickled each. Prints the one-way
latency (p50 / p90 / p99 µs) per transport, message size (a decode step's commands; a step that adds requests) and
gap (within the reader's spin; long enough that it naps).

Part 2 (``--skip-engine``; needs 2 GPUs): ``Engine.generate`` at tp=2 with one request, Llama-3.1-8B shapes, dummy
weights, triton, CUDA graphs, timed whole as ``treadle bench one-batch``'s Engine rows are (decode ms a step
= (time for N tokens - time for 1) / (N - 1)), at tp=1 (the reference) and at tp=2 with ``parallel.step_broadcast``
auto (shared memory) and gloo, alternating ``--rounds`` times, each in a process of its own (``--modes
tp1,auto,gloo``: in this one). Prints both tables, each tp=2 median over tp=1's; writes one JSON. ``--tp 4
--shape llama-3.1-70b --modes auto`` times a 4-GPU engine of a model one GPU does not hold the same way (beside
``tests/gpu/vllm_peer.sh tp4_70b``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from treadle.bench.results_folder import write_result
from treadle.testing.all_reduce import run_ranks

SIZES = {"step (64 B)": 64, "new requests (64 KiB)": 64 * 1024}
TRANSPORTS = ("gloo", "shared_memory")
TP1 = "tp1"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    result: dict[str, Any] = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                              "command": " ".join(["python -m treadle.bench.tp_step_broadcast",
                                                   *(argv if argv is not None else sys.argv[1:])])}
    if not args.skip_latency:
        gaps = [int(g) for g in args.gap_us.split(",")]
        result["latency_us"] = run_ranks(2, _latency_rank, (args.messages, gaps), args.timeout_s)[1]["latency_us"]
        print(latency_table(result["latency_us"]), flush=True)
    if not args.skip_engine:
        result["engine"] = engine_steps(args) if args.modes else engine_steps_apart(args, argv)
        print(engine_table(result["engine"]), flush=True)
    write_result(result, args.output, f"tp_step_broadcast_{dt.date.today():%Y%m%d}.json")
    return 0


def _latency_rank(rank: int, world_size: int, init_method: str, messages: int, gaps_us: list[int]) -> dict[str, Any]:
    import torch

    from treadle.core.distributed.parallel import destroy_tensor_parallel, init_tensor_parallel, tp_broadcast_object
    from treadle.core.distributed.shm_channel import ShmChannelReader, ShmChannelWriter

    init_tensor_parallel(rank, world_size, init_method, torch.device("cpu"), timeout_s=120.0)
    channel: Any = ShmChannelWriter.create(num_readers=1) if rank == 0 else None
    name = tp_broadcast_object(channel.name if rank == 0 else None)
    if rank == 1:
        channel = ShmChannelReader(name, 0)
    latency: dict[str, dict[str, dict[str, float]]] = {}
    try:
        for label, size in SIZES.items():
            for gap in gaps_us:
                row = latency.setdefault(f"{label}, gap {gap} µs", {})
                for transport in TRANSPORTS:
                    row[transport] = _one_way(rank, channel if transport == "shared_memory" else None, size, gap,
                                              messages)
    finally:
        channel.close()
        destroy_tensor_parallel()
    return {"latency_us": latency}


def _one_way(rank: int, channel: Any, size: int, gap_us: int, messages: int) -> dict[str, float]:
    """Rank 1's p50 / p90 / p99 of (received and unpickled - sent) in µs; rank 0 sends."""
    from treadle.core.distributed.parallel import tp_broadcast_object

    padding = bytes(size)
    seen = []
    for _ in range(messages):
        if rank == 0:
            time.sleep(gap_us / 1e6)
            commands = [("step",), padding, time.perf_counter_ns()]
            if channel is None:
                tp_broadcast_object(commands)
            else:
                channel.send(pickle.dumps(commands, protocol=pickle.HIGHEST_PROTOCOL))
        else:
            commands = tp_broadcast_object(None) if channel is None else pickle.loads(channel.receive())
            seen.append((time.perf_counter_ns() - commands[-1]) / 1e3)
    if rank == 0:
        return {}
    cuts = statistics.quantiles(seen, n=100)
    return {"p50": cuts[49], "p90": cuts[89], "p99": cuts[98]}


def latency_table(latency: dict[str, dict[str, dict[str, float]]]) -> str:
    lines = ["| message, rank 0's pause before it | gloo p50 / p90 / p99 µs | shared memory p50 / p90 / p99 µs |",
             "| --- | ---: | ---: |"]
    for label, row in latency.items():
        cells = [" / ".join(f"{row[t][q]:.0f}" for q in ("p50", "p90", "p99")) for t in TRANSPORTS]
        lines.append(f"| {label} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def engine_steps(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Engine.generate's decode ms a step at ``--tp`` (2), bs=1, per ``parallel.step_broadcast``, ``--rounds``
    times each."""
    import torch

    from treadle.bench.one_batch_engine import run_engine
    from treadle.bench.roofline import measure_copy_bandwidth
    from treadle.bench.shapes import SHAPES, TINY, write_config

    device = torch.device("cuda", 0) if torch.cuda.is_available() and args.device != "cpu" else torch.device("cpu")
    bandwidth = measure_copy_bandwidth(device)
    torch.manual_seed(0)
    prompts = {1: torch.randint(100, 1000, (1, args.input_len))}
    engine_args = argparse.Namespace(dtype="bfloat16", context_length=8192, decode_steps=args.decode_steps,
                                     generate_repeats=args.generate_repeats)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = write_config(Path(scratch), TINY if args.tiny else SHAPES[args.shape])
        for round_index in range(args.rounds):
            for mode in args.modes.split(","):
                # "tp1": the same engine on one GPU, the reference the tp=2 steps are divided by.
                overrides = ({"parallel.tp_size": 1} if mode == TP1 else
                             {"parallel.tp_size": args.tp, "parallel.step_broadcast": mode})
                (row,) = run_engine(model_dir, args.backend, overrides, f"{mode} step_broadcast", prompts,
                                    engine_args, device, bandwidth)
                rows.append({"step_broadcast": mode, "tp": overrides["parallel.tp_size"], "round": round_index,
                             "decode_step_ms": row.decode_step_ms,
                             "prefill_ms": row.prefill_ms, "first_tokens": row.first_tokens})
                print(f"step_broadcast={mode} round {round_index}: decode {row.decode_step_ms:.3f} ms/step", flush=True)
    return rows


def engine_steps_apart(args: argparse.Namespace, argv: Sequence[str] | None) -> list[dict[str, Any]]:
    """``engine_steps`` for one setting and round at a time, each in a process of its own: a second tp=2 Engine in
    one process stalls on the GPU in the peer all-reduce's set-up (its symmetric-memory rendezvous), seen on
    2 x H200 (2026-11-28)."""
    import subprocess

    given = list(argv if argv is not None else sys.argv[1:])
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.rounds):
            for mode in (TP1, "auto", "gloo"):
                out = Path(scratch) / f"{mode}{round_index}.json"
                command = [sys.executable, "-m", "treadle.bench.tp_step_broadcast", *_without(given, "--output"),
                           "--skip-latency", "--rounds", "1", "--modes", mode, "--output", str(out)]
                subprocess.run(command, check=True, timeout=args.timeout_s)
                for row in json.loads(out.read_text())["engine"]:
                    rows.append({**row, "round": round_index})
    return rows


def _without(argv: list[str], flag: str) -> list[str]:
    """``argv`` less ``flag`` and its value."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            kept.append(arg)
    return kept


def engine_table(rows: list[dict[str, Any]]) -> str:
    medians = {mode: statistics.median(r["decode_step_ms"] for r in rows if r["step_broadcast"] == mode)
               for mode in sorted({r["step_broadcast"] for r in rows})}
    lines = ["| parallel.step_broadcast | decode ms/step (each round) | median | / tp=1 |", "| --- | --- | ---: | ---: |"]
    for mode, median in medians.items():
        steps = [r["decode_step_ms"] for r in rows if r["step_broadcast"] == mode]
        ratio = f"{median / medians[TP1]:.3f}x" if TP1 in medians else "-"
        lines.append(f"| {mode} | {', '.join(f'{s:.3f}' for s in steps)} | {median:.3f} | {ratio} |")
    same = len({tuple(r["first_tokens"]) for r in rows}) == 1
    return "\n".join(lines + [f"first tokens identical in every run: {same}"])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m treadle.bench.tp_step_broadcast",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=1000, help="messages per latency cell (default 1000)")
    parser.add_argument("--gap-us", default="200,5000", help="rank 0's pauses before each message (default 200,5000)")
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--tp", type=int, default=2, help="ranks of the engines other than tp1 (default 2)")
    parser.add_argument("--backend", default="triton", help="attention backend of the engine part (default triton)")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model of the shape (a smoke test)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu"], help="cpu: the engine part on gloo")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--decode-steps", type=int, default=128)
    parser.add_argument("--generate-repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="engine runs per setting, alternating (default 2)")
    parser.add_argument("--modes", default="",
                        help="auto,gloo: those settings' engines in this process, one after another (default: each "
                             "setting and round in a process of its own)")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--output", default=None)
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
