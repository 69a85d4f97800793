"""The config tree ``ServerConfig``: YAML file < environment (``TREADLE_…``) < CLI overrides.

Unknown keys are errors naming the key's path. Plugin choices are checked
against the registries once plugins are loaded (:func:`validate_plugin_choices`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping

import yaml
from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict

# Every section is imported from here; the feature sections live in config_sections.
from treadle.core.config_sections import (  # noqa: F401
    DRAFT_MODEL_METHODS,
    LoraConfig,
    MultimodalConfig,
    Section,
    SpeculativeConfig,
    at_least_or_auto,
    positive_or_auto,
)

ENV_PREFIX = "TREADLE_"


class ConfigError(ValueError):
    """The configuration is invalid; the message names the offending key."""


class ModelConfig(Section):
    path: str | None = Field(None, description="HF folder or .gguf file; empty means the embedded SmolLM2-135M-Instruct")
    tokenizer_path: str | None = Field(None, description="defaults to the model folder")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    load_format: Literal["auto", "safetensors", "gguf", "dummy"] = "auto"
    context_length: int | None = Field(None, gt=0, description="defaults to the model's max_position_embeddings")
    served_model_name: str | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = Field(0, description="seed for dummy weights")
    quantization: str | None = Field(
        None, description="a quantization method by name (treadle plugins lists them: fp8, gptq, awq, "
                          "compressed-tensors); auto or empty: the one the checkpoint's quantization_config names. "
                          "fp8 on a 16-bit checkpoint quantizes its linear weights at load")
    quantize_lm_head: bool | Literal["auto"] = Field(
        "auto", description="the output projection (lm_head) in FP8 too. auto: whenever the model's weights are FP8 "
                            "on a device that multiplies FP8, or integer (GPTQ, AWQ, compressed-tensors W4A16/W8A16) "
                            "on a GPU that does, and the head's shape allows it; true: the same, an error without "
                            "quantized weights; false: a 16-bit head")
    lm_head_exact_top: int = Field(
        8, ge=0, le=64, description="with an FP8 lm_head, how many of each row's best FP8 logits are recomputed "
                                    "from the 16-bit weight (kept for it), so greedy tokens and each row's best "
                                    "logits stay the 16-bit head's; 0: none, and an untied 16-bit weight is freed")
    task: Literal["auto", "generate", "embed"] = Field(
        "auto", description="generate: sample tokens; embed: return pooled final hidden states (/v1/embeddings, "
                            "Engine.encode); auto: embed when the checkpoint says so (sentence-transformers' "
                            "modules.json, an architecture such as Qwen3Model), else generate")
    pooling: str = Field(
        "auto", description="embed: how a prompt's hidden states become one vector, a registered pooling (last, "
                            "mean, cls, or a plugin's); auto: the checkpoint's (1_Pooling/config.json), else last")
    normalize_embeddings: bool | Literal["auto"] = Field(
        "auto", description="embed: scale each vector to unit length; auto: as the checkpoint says (a "
                            "sentence-transformers Normalize module), else true")
    matryoshka: bool | Literal["auto"] = Field(
        "auto", description="embed: whether a request may ask for fewer `dimensions` (the vector's head, "
                            "renormalized); auto: when config.json says is_matryoshka or matryoshka_dimensions")


class CacheConfig(Section):
    kv_allocator: str = "token"
    page_size: int = Field(1, ge=1)
    disable_radix_cache: bool = False
    max_total_tokens: int | None = Field(None, gt=0, description="KV slots; default sized from memory")
    mem_fraction: float = Field(0.85, gt=0, le=1)
    kv_dtype: Literal["auto", "fp8_e4m3"] = Field("auto", description="KV cache storage; auto = the model dtype")

    @model_validator(mode="after")
    def _page_size_matches_allocator(self) -> "CacheConfig":
        if self.kv_allocator == "token" and self.page_size != 1:
            raise ValueError("kv_allocator 'token' has page size 1; use kv_allocator: paged for page_size > 1")
        return self


class SchedulerConfig(Section):
    policy: str = "fcfs"
    max_running_requests: int | Literal["auto"] = Field(
        "auto", description="most requests running at once; auto: 64 on the CPU, sized from the KV pool on CUDA")
    chunked_prefill_size: int | Literal["auto"] | None = Field(
        "auto", description="most prompt tokens per prefill step (longer prompts are cut into chunks); null disables; "
                            "auto: 4096 for Engine batches on CUDA, 2048 through the server and on the CPU")
    max_prefill_tokens: int = Field(8192, gt=0)
    enable_mixed_chunk: bool | Literal["auto"] = Field(
        "auto", description="run prefill chunks in the same batch as decodes; auto: per device (core/auto_size.py)")
    prefill_hold_steps: int | Literal["auto"] = Field(
        "auto", description="while half the running limit or more is decoding, a prefill of fewer waiting prompt "
                            "tokens than one chunk waits up to this many decode steps for more requests to join "
                            "it (unless every waiting request fits already); 0: never; auto: 8 on CUDA, 0 on the CPU")
    latency_chunk_size: int | Literal["auto"] = Field(
        "auto", description="while fewer requests decode than this and at most one chunk of prompt tokens "
                            "waits, each step carries at most this many prompt tokens mixed into the decode "
                            "batch, so a new prompt delays the streams by about one decode step; 0: off; "
                            "auto: 512 on CUDA, 0 on the CPU and for the offline Engine")
    seed: int = 0
    new_token_ratio: float = Field(0.4, ge=0, le=1, description="share of max_new_tokens reserved at admission")
    disable_overlap: bool = Field(False, description="build and finish each step only after the device ran it")
    batch_order: Literal["longest_output_first", "submission"] = Field(
        "longest_output_first",
        description="how Engine.generate queues the prompts of one call: the largest max_new_tokens first (a "
                    "stable sort, so equal budgets keep their order; the call ends sooner when budgets differ), "
                    "or as given; the server queues requests as they arrive")

    @field_validator("max_running_requests")
    @classmethod
    def _positive_running(cls, value: int | str) -> int | str:
        return positive_or_auto(value, "max_running_requests")

    @field_validator("chunked_prefill_size")
    @classmethod
    def _chunk_size(cls, value: int | str | None) -> int | str | None:
        return None if value is None else positive_or_auto(value, "chunked_prefill_size")

    @field_validator("prefill_hold_steps")
    @classmethod
    def _hold_steps(cls, value: int | str) -> int | str:
        return at_least_or_auto(value, 0, "prefill_hold_steps")

    @field_validator("latency_chunk_size")
    @classmethod
    def _latency_chunk(cls, value: int | str) -> int | str:
        return at_least_or_auto(value, 0, "latency_chunk_size")


class AttentionConfig(Section):
    backend: str = Field(
        "auto", description="attention plugin; auto: on CUDA flashinfer_triton where FlashInfer is installed, "
                            "else flashinfer, else triton, and torch_native on the CPU (the first that accepts "
                            "the model; the choice is logged)")


class RuntimeConfig(Section):
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | Literal["auto"] = Field(
        "auto", description="largest decode batch captured in a CUDA graph; auto: the running-request limit")
    cuda_graph_prune: bool = Field(
        True, description="after capture, time each decode graph once and drop a batch size whose graph is "
                          "slower than the next larger one kept (its batches pad up to that one instead)")
    piecewise_cuda_graph_max_tokens: int | Literal["auto"] = Field(
        "auto", description="largest prefill (extend) batch, in tokens, run through CUDA graphs cut at each "
                            "attention call; 0: prefills run eagerly; auto: 1024 on one GPU (at most the "
                            "largest extend step), 0 on the CPU and under tensor parallelism (where a "
                            "token count turns them on; unmeasured there)")

    @field_validator("cuda_graph_max_bs")
    @classmethod
    def _positive_graph_bs(cls, value: int | str) -> int | str:
        return positive_or_auto(value, "cuda_graph_max_bs")

    @field_validator("piecewise_cuda_graph_max_tokens")
    @classmethod
    def _piecewise_tokens(cls, value: int | str) -> int | str:
        return at_least_or_auto(value, 0, "piecewise_cuda_graph_max_tokens")


class HttpServerConfig(Section):
    host: str = "127.0.0.1"
    port: int = Field(30000, ge=0, le=65535)
    # Secrets are SecretStr so that dumps (`treadle config --show`, /get_server_info, logs) show '**********'.
    api_key: SecretStr | None = None
    api_key_file: str | None = Field(None, description="file whose first line is the API key")
    admin_api_key: SecretStr | None = None
    admin_api_key_file: str | None = Field(None, description="file whose first line is the admin API key")
    cors_allow_origins: list[str] = Field(default_factory=list, description="empty: CORS off")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    max_request_tokens: int | None = Field(None, gt=0)
    max_request_bytes: int = Field(16 * 1024 * 1024, gt=0, description="larger bodies get 413")
    max_queued_requests: int | None = Field(None, ge=0, description="null: sized from the KV pool")
    request_timeout: float | None = Field(None, gt=0, description="seconds; null: no deadline")
    shutdown_timeout: float = Field(30.0, ge=0, description="seconds running requests get after SIGTERM")
    workers: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto", description="HTTP processes (FastAPI + tokenizer) sharing the port; auto: one per 4 CPUs, "
                                  "at most 8, at least 1")
    detokenizers: int = Field(1, ge=1, description="detokenizer processes; HTTP worker w's requests go to detokenizer "
                                                   "w % detokenizers (at most one per worker)")
    event_loop: Literal["auto", "asyncio", "uvloop"] = Field(
        "auto", description="the HTTP workers' event loop; auto: uvloop when it is installed, else asyncio's")

    @model_validator(mode="after")
    def _one_source_per_key(self) -> "HttpServerConfig":
        for name in ("api_key", "admin_api_key"):
            if getattr(self, name) is not None and getattr(self, f"{name}_file") is not None:
                raise ValueError(f"set either server.{name} or server.{name}_file, not both")
        return self

    def resolved_api_key(self) -> str | None:
        """The API key from ``api_key`` or ``api_key_file`` (None: no key needed)."""
        return _secret(self.api_key, self.api_key_file, "server.api_key_file")

    def resolved_admin_api_key(self) -> str | None:
        """The admin key from ``admin_api_key`` or ``admin_api_key_file`` (None: admin routes use the API key)."""
        return _secret(self.admin_api_key, self.admin_api_key_file, "server.admin_api_key_file")


def _secret(value: SecretStr | None, file: str | None, key: str) -> str | None:
    if file is None:
        return value.get_secret_value() if value is not None else None
    try:
        lines = Path(file).read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {file}: {exc.strerror}") from None
    secret = lines[0].strip() if lines else ""
    if not secret:
        raise ConfigError(f"{key}: {file} is empty; its first line must be the key")
    return secret


class ToolsConfig(Section):
    parser: str = Field("auto", description="tool-call parser (tool_parsers plugin); auto: from the model family; "
                                              "none: no parsing of free-text calls")
    max_forced_calls: int = Field(4, ge=1, description="most calls in one reply under tool_choice 'required' with "
                                                       "parallel_tool_calls (the grammar's array bound)")


class ReasoningConfig(Section):
    parser: str = Field("none", description="reasoning parser (reasoning_parsers plugin), e.g. think_tags; none: off")


class GrammarConfig(Section):
    backend: str = Field("xgrammar", description="grammar_backends plugin for json_schema / regex / ebnf constraints")
    cache_size: int = Field(256, ge=0, description="compiled constraints kept per scheduler (LRU); 0 disables")
    any_whitespace: bool = Field(False, description="allow free whitespace between JSON tokens (else compact JSON)")


class ParallelConfig(Section):
    tp_size: int = Field(1, ge=1, description="tensor-parallel ranks (GPUs) that share one copy of the model")
    dp_size: int = Field(1, ge=1, description="data-parallel replicas behind one server (a controller routes requests)")
    dp_policy: Literal["round_robin", "shortest_queue", "least_work", "prefix_aware"] = Field(
        "prefix_aware", description="how the data-parallel controller picks a replica")
    nnodes: int = Field(1, ge=1, description="machines the server spans (one `treadle serve` each): those of one "
                                               "tensor-parallel group, or with dp_size > 1 those the replicas spread over")
    node_rank: int = Field(0, ge=0, description="this machine's index; 0 runs the HTTP server (and rank 0, or the "
                                                "data-parallel controller)")
    dist_init_addr: str | None = Field(
        None, description="host:port of node 0, reachable from every node: rank 0's torch.distributed TCP store, or "
                          "with dp_size > 1 the data-parallel controller's port; needed when nnodes > 1")
    dist_timeout_s: float = Field(600.0, gt=0, description="a collective waiting longer than this fails; so does a "
                                                           "node that has not reached node 0 by then")
    dp_replicas_per_node: list[int] | None = Field(
        None, description="with dp_size > 1 over nnodes > 1: how many replicas each node runs, node 0 first "
                          "(summing to dp_size); null: dp_size / nnodes each")
    custom_all_reduce: bool | Literal["auto"] = Field(
        "auto", description="peer-to-peer all-reduce for small tensor-parallel messages (NCCL for the rest): auto "
                            "uses it where all ranks can (CUDA, one node, peer access), true requires it, false is NCCL")
    step_broadcast: Literal["auto", "gloo"] = Field(
        "auto", description="how rank 0 sends each step's commands to the other ranks: auto through shared memory "
                            "when every rank is on this node (an x86-64 host), else over gloo; gloo always over gloo")

    @model_validator(mode="after")
    def _layout(self) -> "ParallelConfig":
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be below nnodes {self.nnodes}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("nnodes > 1 needs dist_init_addr: host:port of node 0, reachable from every node")
        if self.dp_size > 1:
            self._check_data_parallel_nodes()
        elif self.tp_size % self.nnodes != 0:
            raise ValueError(f"tp_size {self.tp_size} must be a multiple of nnodes {self.nnodes} "
                             "(every node runs tp_size / nnodes ranks)")
        if self.dp_replicas_per_node is not None and (self.dp_size == 1 or self.nnodes == 1):
            raise ValueError("dp_replicas_per_node applies to data parallelism over several nodes "
                             "(dp_size > 1 and nnodes > 1); leave it unset")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"dist_init_addr '{self.dist_init_addr}' must look like host:port")
        return self

    def _check_data_parallel_nodes(self) -> None:
        if self.nnodes == 1:
            if self.dist_init_addr:
                raise ValueError("dp_size > 1 on one node gives each replica its own private rendezvous; leave "
                                 "dist_init_addr unset (or set nnodes to spread the replicas over several nodes)")
            return
        counts = self.dp_replicas_per_node
        if counts is None:
            if self.dp_size % self.nnodes:
                raise ValueError(f"dp_size {self.dp_size} does not split evenly over nnodes {self.nnodes}; set "
                                 f"dp_replicas_per_node (one count per node, summing to {self.dp_size})")
            return
        if len(counts) != self.nnodes or sum(counts) != self.dp_size or min(counts) < 1:
            raise ValueError(f"dp_replicas_per_node {counts} must give each of the {self.nnodes} nodes at least one "
                             f"replica, {self.dp_size} (dp_size) in all")

    def replicas_per_node(self) -> list[int]:
        """How many data-parallel replicas each node runs (node 0 first); every replica's tp_size ranks share
        its node."""
        if self.nnodes == 1 or self.dp_size == 1:
            return [self.dp_size]
        return list(self.dp_replicas_per_node or [self.dp_size // self.nnodes] * self.nnodes)


class ServerConfig(BaseSettings):
    """The whole treadle configuration; YAML files mirror this tree."""

    model_config = SettingsConfigDict(extra="forbid", validate_assignment=True)

    model: ModelConfig = Field(default_factory=ModelConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    attention: AttentionConfig = Field(default_factory=AttentionConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    server: HttpServerConfig = Field(default_factory=HttpServerConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    reasoning: ReasoningConfig = Field(default_factory=ReasoningConfig)
    grammar: GrammarConfig = Field(default_factory=GrammarConfig)
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    multimodal: MultimodalConfig = Field(default_factory=MultimodalConfig)
    plugins: list[str] = Field(default_factory=list)

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, **_sources):  # type: ignore[override]
        # load_config merges file, environment and CLI itself, in that order.
        return (init_settings,)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def load_config(
    path: str | os.PathLike | None = None,
    overrides: Mapping[str, Any] | list[str] | None = None,
    base: Mapping[str, Any] | None = None,
    use_env: bool = True,
) -> ServerConfig:
    """Resolve a ServerConfig from ``base`` < YAML ``path`` < environment < ``overrides``.

    ``overrides`` is ``{"scheduler.policy": "lpm"}`` or ``["scheduler.policy=lpm"]``;
    values given as strings are parsed as YAML scalars (``64`` → int, ``true`` → bool).
    """
    merged: dict[str, Any] = _deep_copy(base or {})
    if path is not None:
        _deep_merge(merged, read_yaml(path))
    if use_env:
        _deep_merge(merged, _env_values())
    _deep_merge(merged, _nest_overrides(overrides or {}))
    return validate_config(merged, source=str(path) if path else None)


def validate_config(values: Mapping[str, Any], source: str | None = None) -> ServerConfig:
    try:
        return ServerConfig(**values)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source)) from None


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"config file not found: {file}")
    try:
        values = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{file}: invalid YAML: {exc}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{file}: the top level must be a mapping of sections, got {type(values).__name__}")
    return values


def format_validation_error(exc: ValidationError, source: str | None = None) -> str:
    lines = []
    for error in exc.errors():
        key = ".".join(str(part) for part in error["loc"]) or "(top level)"
        message = error["msg"]
        if error["type"] == "extra_forbidden":
            message = "unknown key"
        lines.append(f"  {key}: {message}")
    where = f" in {source}" if source else ""
    return f"invalid treadle config{where}:\n" + "\n".join(lines)


def validate_plugin_choices(config: ServerConfig, registry: Any) -> None:
    """Check every plugin name the config picks against the loaded registries."""
    from treadle.core.registry import PluginError

    choices = [
        ("schedule_policies", config.scheduler.policy, "scheduler.policy"),
        ("kv_allocators", config.cache.kv_allocator, "cache.kv_allocator"),
        ("grammar_backends", config.grammar.backend, "grammar.backend"),
    ]
    if config.attention.backend != "auto":
        choices.append(("attention", config.attention.backend, "attention.backend"))
    if config.tools.parser not in ("auto", "none"):
        choices.append(("tool_parsers", config.tools.parser, "tools.parser"))
    if config.reasoning.parser != "none":
        choices.append(("reasoning_parsers", config.reasoning.parser, "reasoning.parser"))
    if config.speculative.method is not None:
        choices.append(("speculators", config.speculative.method, "speculative.method"))
    if config.lora.requested and config.lora.backend != "auto":
        choices.append(("lora_backends", config.lora.backend, "lora.backend"))
    # Checked where methods are registered (a registry without any leaves fp8 to core, as before the kind existed).
    if config.model.quantization not in (None, "auto") and registry.names("quantization_methods"):
        choices.append(("quantization_methods", config.model.quantization, "model.quantization"))
    for kind, name, key in choices:
        try:
            registry.get(kind, name)
        except PluginError as exc:
            raise ConfigError(f"{key}: {exc}") from None


def _env_values() -> dict[str, Any]:
    source = EnvSettingsSource(
        ServerConfig, env_prefix=ENV_PREFIX, env_nested_delimiter="__", case_sensitive=False
    )
    return dict(source())


def _nest_overrides(overrides: Mapping[str, Any] | list[str]) -> dict[str, Any]:
    if isinstance(overrides, list):
        pairs = {}
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override '{item}' must look like section.key=value")
            key, value = item.split("=", 1)
            pairs[key.strip()] = value
        overrides = pairs
    nested: dict[str, Any] = {}
    for dotted, value in overrides.items():
        if isinstance(value, str):
            try:
                value = yaml.safe_load(value) if value != "" else None
            except yaml.YAMLError:
                pass
        node = nested
        parts = dotted.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{dotted}': '{part}' is not a section")
        node[parts[-1]] = value
    return nested


def _deep_merge(into: dict[str, Any], new: Mapping[str, Any]) -> None:
    for key, value in new.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _deep_merge(into[key], value)
        else:
            into[key] = _deep_copy(value) if isinstance(value, Mapping) else value


def _deep_copy(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in values.items()}
