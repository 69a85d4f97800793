"""The ``treadle`` command: plugins, config, serve, generate, bench."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from treadle.core.config import ConfigError, ServerConfig, load_config, validate_plugin_choices
from treadle.core.registry import build_registry


# Errors that a user's input causes (a config, a model path, a layout): one `error:` line, no traceback. Named by
# module so that none is imported to be caught: an error's module is loaded by the time it is raised.
USER_ERRORS = {
    "treadle.core.config": ["ConfigError"],
    "treadle.core.registry": ["PluginError"],
    "treadle.core.loading.model_loader": ["ModelLoadError"],
    "treadle.core.loading.default_model": ["DefaultModelError"],
    "treadle.core.loading.hub": ["HubError"],
    "treadle.core.loading.quantization": ["QuantizationError"],
    "treadle.core.distributed.tensor_parallel": ["TensorParallelError"],
    "treadle.core.request": ["InvalidRequestError"],
    "treadle.server.launch": ["ServerStartupError"],
}
# The keys most runs set, shown by `serve --help` (and the other commands that read a config), with their defaults.
COMMON_KEYS = {
    "model.path": "HF folder, .gguf file or hub id; null: the embedded SmolLM2-135M-Instruct",
    "model.device": "auto, cpu or cuda",
    "model.dtype": "auto, float32, float16 or bfloat16",
    "server.host": "address to listen on (0.0.0.0: every interface)",
    "server.port": "port to listen on",
    "server.api_key": "require this bearer token",
    "attention.backend": "torch_native, triton, flashinfer, flashinfer_triton or auto",
    "scheduler.policy": "fcfs, lpm, random, dfs-weight, lof, priority or a plugin's",
    "cache.max_total_tokens": "KV cache slots; null: sized from memory",
    "parallel.tp_size": "tensor-parallel ranks sharing the model",
}


def main(argv: Sequence[str] | None = None) -> int:
    # A `plugins:` module in the working directory imports as it would under `python -m`; spawned processes
    # (scheduler, tensor-parallel ranks) inherit this path.
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        if args.command == "bench":
            status = _bench(args, extra)
        else:
            try:
                overrides = _overrides(args, extra)
            except ConfigError as exc:
                parser.error(str(exc))
            status = args.handler(args, overrides)
        sys.stdout.flush()  # here, where a closed pipe can still be told apart from a failure
        return status
    except BrokenPipeError:
        # The reader stopped early (`treadle plugins --json | head`): nothing is wrong, and nothing more to say.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except Exception as exc:
        if not isinstance(exc, _user_error_types()):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _user_error_types() -> tuple[type, ...]:
    loaded = []
    for module_name, names in USER_ERRORS.items():
        module = sys.modules.get(module_name)
        loaded += [getattr(module, name) for name in names if module is not None]
    return tuple(loaded)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="treadle",
        description="treadle: an LLM serving engine with a thin core and plugins.",
        epilog="Any config key can be overridden as --section.key VALUE or --set section.key=VALUE.",
    )
    sub = parser.add_subparsers(dest="command")

    plugins = sub.add_parser("plugins", help="list every registered plugin and its provider")
    plugins.add_argument("--json", action="store_true", help="print {kind: {name: provider}} as JSON")
    _add_config_args(plugins, "also load the modules under plugins: in this YAML file")
    plugins.set_defaults(handler=_cmd_plugins)

    config = _config_command(sub, "config", "show the resolved configuration")
    config.add_argument("--show", action="store_true", help="print the resolved config as YAML (the default)")
    config.set_defaults(handler=_cmd_config)

    serve = _config_command(sub, "serve", "start the OpenAI-compatible HTTP server (on server.host:server.port)")
    serve.set_defaults(handler=_cmd_serve)

    generate = _config_command(sub, "generate", "generate text for one prompt in this process")
    generate.add_argument("--prompt", required=True, help="the text to continue (with --chat: the user's message)")
    generate.add_argument("--max-new-tokens", type=int, default=64, help="most tokens to generate (default: 64)")
    generate.add_argument("--temperature", type=float, default=0.0,
                          help="sampling temperature; 0 is greedy (default: 0)")
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    generate.set_defaults(handler=_cmd_generate)

    bench = sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHMARKS) + " (see --help of each)",
                           add_help=False)
    bench.add_argument("benchmark", nargs="?", choices=list(BENCHMARKS))
    bench.set_defaults(handler=None)
    return parser


def _config_command(sub: argparse._SubParsersAction, name: str, help_text: str) -> argparse.ArgumentParser:
    """A subcommand that reads a ServerConfig: --config, --set, and the common keys in its help."""
    command = sub.add_parser(name, help=help_text, description=help_text, epilog=_common_keys_help(),
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_config_args(command, "YAML config file (examples/configs/server.yaml lists every section)")
    return command


def _add_config_args(parser: argparse.ArgumentParser, config_help: str) -> None:
    parser.add_argument("--config", help=config_help)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set scheduler.policy=lpm (repeatable)")


def _common_keys_help() -> str:
    defaults = ServerConfig().model_dump(mode="json")
    lines = ["Any config key is an option: --section.key VALUE (or --set section.key=VALUE). The common ones:"]
    for key, meaning in COMMON_KEYS.items():
        section, name = key.split(".")
        default = defaults[section][name]
        lines.append(f"  --{key:<24} {meaning} (default: {'null' if default is None else default})")
    lines.append("Every key, the environment (TREADLE_SERVER__PORT=8000) and their precedence: docs/config.md")
    return "\n".join(lines)


def _overrides(args: argparse.Namespace, extra: list[str]) -> list[str]:
    overrides = list(getattr(args, "set", []) or [])
    i = 0
    while i < len(extra):
        item = extra[i]
        if not item.startswith("--") or "." not in item:
            raise ConfigError(f"unrecognized argument {item!r}")
        key = item[2:]
        if "=" in key:
            overrides.append(key)
            i += 1
        elif i + 1 < len(extra):
            overrides.append(f"{key}={extra[i + 1]}")
            i += 2
        else:
            raise ConfigError(f"{item} needs a value")
    return overrides


def _resolve(args: argparse.Namespace, overrides: list[str]) -> ServerConfig:
    config = load_config(getattr(args, "config", None), overrides)
    validate_plugin_choices(config, build_registry(config.plugins))
    return config


def _cmd_plugins(args: argparse.Namespace, overrides: list[str]) -> int:
    modules = load_config(args.config, overrides).plugins if args.config or overrides else []
    registry = build_registry(modules)
    table = registry.table()
    if args.json:
        print(json.dumps(table, indent=2))
        return 0
    for kind, entries in table.items():
        print(f"{kind}:")
        if not entries:
            print("  (none)")
        width = max((len(name) for name in entries), default=0)
        for name, provider in entries.items():
            print(f"  {name:<{width}}  {provider}")
    return 0


def _cmd_config(args: argparse.Namespace, overrides: list[str]) -> int:
    print(_resolve(args, overrides).to_yaml(), end="")
    return 0


def _cmd_serve(args: argparse.Namespace, overrides: list[str]) -> int:
    from treadle.server.launch import ServerStartupError, serve

    try:
        serve(_resolve(args, overrides))
    except ServerStartupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _cmd_generate(args: argparse.Namespace, overrides: list[str]) -> int:
    from treadle.core.engine import Engine
    from treadle.core.request import SamplingParams

    engine = Engine(_resolve(args, overrides))
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    try:
        output = engine.generate(prompt, SamplingParams(max_new_tokens=args.max_new_tokens,
                                                        temperature=args.temperature))
    finally:
        engine.shutdown()  # stops tensor-parallel ranks, if any
    print(output.text)
    return 0


BENCHMARKS = {"offline": "offline_throughput", "one-batch": "one_batch", "serving": "serving",
              "arrival-trace": "arrival_trace", "lora": "lora", "plot": "plot", "tp-decode": "tp_decode",
              "front-end": "front_end", "dp-balance": "dp_balance", "tp-step-broadcast": "tp_step_broadcast"}


def _bench(args: argparse.Namespace, extra: list[str]) -> int:
    import importlib

    if args.benchmark is None:
        print("usage: treadle bench {" + ",".join(BENCHMARKS) + "} [options]  (--help on each)")
        return 2
    module = importlib.import_module(f"treadle.bench.{BENCHMARKS[args.benchmark]}")
    return int(module.main(extra) or 0)
