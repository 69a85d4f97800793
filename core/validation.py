"""Validation of a request: its token ids and sampling parameters against the server's limits.

Every entry point checks a request here before anything is queued: the scheduler
(``Scheduler.check_request``, so ``Engine.generate`` and the scheduler process), the
HTTP process's tokenizer manager (with the limits the scheduler reported in its
``model_info``), and so every route. A failure is an :class:`InvalidRequestError`
naming the field (``param``), which servers answer with HTTP 400.

Messages and ``param`` use the core's field names (``max_new_tokens``,
``top_logprobs_num``, ``prompt``, ``input_ids``); an API whose body names them
otherwise passes ``names`` (OpenAI's ``max_tokens``, ``messages``...), so the
client reads its own field's name.

This module is the bottom of ``core``'s request layer: it imports nothing of
treadle's, and :mod:`treadle.core.request` and :mod:`treadle.core.grammar` import it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:
    from treadle.core.request_io import SamplingParams

# The constraint fields of SamplingParams; a request gives at most one.
CONSTRAINT_KINDS = ("json_schema", "regex", "ebnf")
# model_info's key for the scheduler's RequestLimits (as a dict): the HTTP process checks requests against them.
REQUEST_LIMITS_KEY = "request_limits"
# A logit bias is added to a logit before sampling: -100 bans a token, +100 all but forces it (as OpenAI's).
MAX_ABS_LOGIT_BIAS = 100


class InvalidRequestError(ValueError):
    """A request's parameters are out of range or inconsistent; servers map this to HTTP 400.

    ``param`` names the field at fault, ``code`` is an OpenAI-style error code (e.g. ``context_length_exceeded``).
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class RequestLimits:
    """What a request must fit: built once by the scheduler from its model and KV pool.

    A limit left None is not checked (a process that does not know it).
    """

    context_len: int | None = None  # prompt + output tokens
    vocab_size: int | None = None  # token ids, logit_bias ids and top_logprobs_num are below (at most) this
    kv_slots: int | None = None  # the KV pool: a prompt (plus its first output token) must fit it whole
    max_request_tokens: int | None = None  # server.max_request_tokens: prompt + max_new_tokens

    @classmethod
    def from_model_info(cls, model_info: Mapping[str, Any]) -> "RequestLimits":
        """The limits a scheduler reported in ``model_info`` (none when it reported none)."""
        return cls(**model_info.get(REQUEST_LIMITS_KEY, {}))

    def as_dict(self) -> dict[str, int | None]:
        return asdict(self)


def check_request(input_ids: Sequence[int], params: "SamplingParams", limits: RequestLimits, *,
                  top_logprobs_num: int = 0, output_must_fit: bool = False,
                  names: Mapping[str, str] | None = None) -> None:
    """Raise InvalidRequestError for the first thing that keeps this request from ever running.

    ``output_must_fit``: ``max_new_tokens`` was asked for explicitly and must fit beside the prompt in the
    context (as OpenAI requires of ``max_tokens``); otherwise the scheduler shortens it to what fits.
    ``names`` maps core field names to the caller's (see the module's docstring).
    """
    name = _namer(names)
    check_sampling_params(params, names)
    prompt_len = len(input_ids)
    if prompt_len == 0:
        raise InvalidRequestError("the prompt is empty", param=name("prompt"))
    context = limits.context_len
    if context is not None and prompt_len >= context:
        raise InvalidRequestError(
            f"the prompt is too long: it has {prompt_len} tokens and this model's context length is {context} "
            "tokens (prompt + output must fit); shorten the prompt", param=name("prompt"),
            code="context_length_exceeded")
    if limits.kv_slots is not None and prompt_len + 1 > limits.kv_slots:
        raise InvalidRequestError(
            f"the prompt has {prompt_len} tokens but the KV cache holds only {limits.kv_slots}; "
            "raise cache.max_total_tokens", param=name("prompt"))
    vocab = limits.vocab_size
    if vocab is not None and (min(input_ids) < 0 or max(input_ids) >= vocab):
        raise InvalidRequestError(f"token ids must be in [0, {vocab})", param=name("input_ids"))
    _check_output_budget(prompt_len, params.max_new_tokens, limits, output_must_fit, name("max_new_tokens"))
    if vocab is not None:
        bias = params.logit_bias
        if bias and max(bias) >= vocab:
            raise InvalidRequestError(f"logit_bias names token {max(bias)}, but token ids must be in [0, {vocab})",
                                      param=name("logit_bias"))
    top_name = name("top_logprobs_num")
    if top_logprobs_num < 0 or (vocab is not None and top_logprobs_num > vocab):
        bound = f"[0, {vocab}] (the vocabulary size)" if vocab is not None else ">= 0"
        raise InvalidRequestError(f"{top_name} must be in {bound}, got {top_logprobs_num}", param=top_name)


def check_sampling_params(params: "SamplingParams", names: Mapping[str, str] | None = None) -> None:
    """Raise InvalidRequestError naming the first out-of-range or inconsistent field of ``params``."""
    name = _namer(names)
    checks = [
        (params.max_new_tokens >= 0, "max_new_tokens", "must be >= 0"),
        (params.temperature >= 0, "temperature", "must be >= 0"),
        (0 < params.top_p <= 1, "top_p", "must be in (0, 1]"),
        (params.top_k == -1 or params.top_k >= 1, "top_k", "must be -1 (off) or >= 1"),
        (0 <= params.min_p <= 1, "min_p", "must be in [0, 1]"),
        (0 < params.repetition_penalty <= 2, "repetition_penalty", "must be in (0, 2]"),
        (-2 <= params.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
        (-2 <= params.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
        (params.seed is None or -2**63 <= params.seed < 2**63, "seed", "must fit in 64 bits"),
    ]
    for ok, field, rule in checks:
        if not ok:
            raise InvalidRequestError(f"{name(field)} {rule}, got {getattr(params, field)!r}", param=name(field))
    for token_id, bias in (params.logit_bias or {}).items():
        if not -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS:
            raise InvalidRequestError(
                f"logit_bias of token {token_id} must be in [-{MAX_ABS_LOGIT_BIAS}, {MAX_ABS_LOGIT_BIAS}], "
                f"got {bias!r}", param=f"{name('logit_bias')}.{token_id}")
    check_constraint_fields(params)


def check_constraint_fields(params: "SamplingParams") -> None:
    """At most one of json_schema / regex / ebnf, each a string, and a json_schema that is a JSON object."""
    given = [kind for kind in CONSTRAINT_KINDS if getattr(params, kind) is not None]
    if len(given) > 1:
        raise InvalidRequestError(f"give at most one of json_schema, regex, ebnf; got {', '.join(given)}",
                                  param=given[1])
    for kind in given:
        if not isinstance(getattr(params, kind), str):
            raise InvalidRequestError(f"{kind} must be a string, got {type(getattr(params, kind)).__name__}",
                                      param=kind)
    if params.json_schema is not None:
        try:
            schema = json.loads(params.json_schema)
        except ValueError as exc:
            raise InvalidRequestError(f"json_schema is not valid JSON: {exc}", param="json_schema") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError(f"json_schema must be a JSON object, got {type(schema).__name__}",
                                      param="json_schema")
    for kind in ("regex", "ebnf"):
        if getattr(params, kind) == "":
            raise InvalidRequestError(f"{kind} must not be empty", param=kind)


def logit_bias_map(bias: Any) -> dict[int, float]:
    """``bias`` as {token id: float}; InvalidRequestError for anything that is not a map of ids >= 0 to numbers.

    Keys may be strings of digits, as JSON objects carry them.
    """
    if not isinstance(bias, dict):
        raise InvalidRequestError(f"logit_bias must map token ids to numbers, got {type(bias).__name__}",
                                  param="logit_bias")
    normalized = {}
    for key, value in bias.items():
        is_id = (isinstance(key, int) and not isinstance(key, bool) and key >= 0) or (
            isinstance(key, str) and key.isdigit())
        if not is_id:
            raise InvalidRequestError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}",
                                      param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidRequestError(f"logit_bias of token {key} must be a number, got {value!r}", param="logit_bias")
        normalized[int(key)] = float(value)
    return normalized


def _check_output_budget(prompt_len: int, max_new_tokens: int, limits: RequestLimits, must_fit: bool,
                         max_name: str) -> None:
    context = limits.context_len
    if must_fit and context is not None and prompt_len + max_new_tokens > context:
        raise InvalidRequestError(
            f"this model's context length is {context} tokens, but the prompt has {prompt_len} and {max_name} "
            f"asks for {max_new_tokens} more; lower {max_name} to at most {context - prompt_len}",
            param=max_name, code="context_length_exceeded")
    limit = limits.max_request_tokens
    if limit is not None and prompt_len + max_new_tokens > limit:
        raise InvalidRequestError(
            f"prompt ({prompt_len} tokens) plus {max_name} ({max_new_tokens}) exceeds server.max_request_tokens = "
            f"{limit}", param=max_name)


def _namer(names: Mapping[str, str] | None):
    if not names:
        return lambda field: field
    return lambda field: names.get(field, field)


def check_task(wants_embedding: bool, task: str) -> None:
    """Raise InvalidRequestError for an embedding request to a generation model or the other way round."""
    if wants_embedding and task != "embed":
        raise InvalidRequestError(
            "this model generates text (model.task: generate) and serves no embeddings; send embedding requests "
            "to a server whose model is an embedding model (model.task: embed)", param="model",
            code="model_task_mismatch")
    if not wants_embedding and task == "embed":
        raise InvalidRequestError(
            "this model serves embeddings (model.task: embed) and generates no text; use /v1/embeddings "
            "(Engine.encode offline)", param="model", code="model_task_mismatch")
