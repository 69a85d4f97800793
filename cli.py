"""The ``treadle`` command: plugins, config, serve, generate, bench."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from treadle.core.config import ConfigError, ServerConfig, load_config, validate_plugin_choices
from treadle.core.registry import PluginError, build_registry


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "bench":
        return _bench(args, extra)
    try:
        overrides = _overrides(args, extra)
    except ConfigError as exc:
        parser.error(str(exc))
    try:
        return args.handler(args, overrides)
    except (ConfigError, PluginError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="treadle",
        description="treadle: an LLM serving engine with a thin core and plugins.",
        epilog="Any config key can be overridden as --section.key VALUE or --set section.key=VALUE.",
    )
    sub = parser.add_subparsers(dest="command")

    plugins = sub.add_parser("plugins", help="list every registered plugin and its provider")
    plugins.add_argument("--json", action="store_true", help="print {kind: {name: provider}} as JSON")
    plugins.add_argument("--config", help="also load the modules under plugins: in this YAML file")
    plugins.set_defaults(handler=_cmd_plugins)

    config = sub.add_parser("config", help="show the resolved configuration")
    config.add_argument("--show", action="store_true", help="print the resolved config as YAML (the default)")
    _add_config_args(config)
    config.set_defaults(handler=_cmd_config)

    serve = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    _add_config_args(serve)
    serve.set_defaults(handler=_cmd_serve)

    generate = sub.add_parser("generate", help="generate text for one prompt in this process")
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--max-new-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _add_config_args(generate)
    generate.set_defaults(handler=_cmd_generate)

    bench = sub.add_parser("bench", help="benchmarks: offline, one-batch, serving, arrival-trace (see --help of each)",
                           add_help=False)
    bench.add_argument("benchmark", nargs="?", choices=["offline", "one-batch", "serving", "arrival-trace"])
    bench.set_defaults(handler=None)
    return parser


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config file")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set scheduler.policy=lpm (repeatable)")


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
    output = engine.generate(prompt, SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature))
    print(output.text)
    return 0


def _bench(args: argparse.Namespace, extra: list[str]) -> int:
    import importlib

    modules = {"offline": "offline_throughput", "one-batch": "one_batch", "serving": "serving",
               "arrival-trace": "arrival_trace"}
    if args.benchmark is None:
        print("usage: treadle bench {offline,one-batch,serving,arrival-trace} [options]  (--help on each)")
        return 2
    module = importlib.import_module(f"treadle.bench.{modules[args.benchmark]}")
    return int(module.main(extra) or 0)
