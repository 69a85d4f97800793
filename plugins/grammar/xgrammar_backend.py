"""The ``xgrammar`` grammar backend (the default): compiles constraints with the xgrammar library."""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Iterator, Sequence

import torch

from treadle.core.grammar import Constraint, GrammarBackend, GrammarCompileError, GrammarMatcher, pack_bitmask
from treadle.core.hookspecs import hookimpl

# xgrammar prefixes its messages with a time and a C++ source location; users need neither.
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
# Keywords xgrammar 0.2.8 accepts but does not enforce: a request using them must fail, not be half-honoured.
# llguidance refuses these too.
_IGNORED_KEYWORDS = ("not", "uniqueItems", "if", "then", "else", "dependentRequired", "dependentSchemas", "contains",
                    "minContains", "maxContains")
# String length bounds xgrammar 0.2.8 drops when a pattern or a format shapes the string (it accepted "123-45" for
# {"pattern": "^[0-9]{3}-[0-9]{2}$", "maxLength": 3}); llguidance intersects the two.
_LENGTH_KEYWORDS = ("maxLength", "minLength")
_SHAPE_KEYWORDS = ("pattern", "format")
# Next to "enum" or "const" xgrammar 0.2.8 allows every listed value and drops the node's other keywords (it accepted
# 1 for {"enum": [1, 5], "minimum": 3} and for {"enum": [1, "a"], "type": "string"}): "type" is applied here by
# dropping the values of another type; the keywords below are refused (llguidance applies them).
_DROPPED_NEXT_TO_VALUES = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength",
                           "maxLength", "pattern", "format", "minItems", "maxItems", "items", "prefixItems",
                           "properties", "required", "additionalProperties", "minProperties", "maxProperties")
# xgrammar 0.2.8 also builds masks for these counted repetitions ~30x more slowly (mlc-ai/xgrammar#852).
_SLOW_KEYWORDS = _LENGTH_KEYWORDS
# JSON text holds no raw control character (U+0000-U+001F) but the whitespace between tokens; xgrammar 0.2.8 lets
# them into strings with minLength/maxLength, which no JSON parser then accepts. JSON-schema rows are masked to
# tokens without them (tab, newline and carriage return stay allowed with grammar.any_whitespace).
_JSON_WHITESPACE = b"\t\n\r"
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "propertyNames", "contains", "not", "if", "then", "else",
                  "unevaluatedProperties", "unevaluatedItems", "additionalItems")

logger = logging.getLogger(__name__)
_UNLIMITED = 1 << 30  # how many accepted tokens a matcher can undo: all of them


class XGrammarBackend(GrammarBackend):
    """JSON schema, regex and EBNF (GBNF-style ``root ::= ...``) through xgrammar's compiler."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 any_whitespace: bool = False, batch_threads: int | str = "auto") -> None:
        import xgrammar

        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_token_ids))
        # treadle's GrammarManager keeps the LRU of compiled grammars; xgrammar's own cache would be a second one.
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._any_whitespace = any_whitespace
        self._json_mask = _no_control_characters(info, vocab_size, any_whitespace)
        self._batch: Any = None
        self._batch_threads = batch_threads  # xgrammar's "auto": half the hardware threads
        self._warned_slow = False

    def compile(self, constraint: Constraint) -> Any:
        try:
            if constraint.kind == "json_schema":
                schema = json.loads(constraint.text)
                text = json.dumps(schema) if self._check_enforceable(schema) else constraint.text
                return _Compiled(self._compiler.compile_json_schema(
                    text, any_whitespace=self._any_whitespace, strict_mode=True), self._json_mask)
            if constraint.kind == "regex":
                return _Compiled(self._compiler.compile_regex(constraint.text))
            if constraint.kind == "ebnf":
                return _Compiled(self._compiler.compile_grammar(constraint.text))
        except GrammarCompileError:
            raise
        except (RuntimeError, ValueError) as exc:
            message = _LOG_PREFIX.sub("", str(exc).strip())
            raise GrammarCompileError(f"invalid {constraint.kind}: {message}", param=constraint.kind) from None
        raise GrammarCompileError(f"xgrammar cannot compile a '{constraint.kind}' constraint", param=constraint.kind)

    def _check_enforceable(self, schema: Any) -> bool:
        """Raise GrammarCompileError for what xgrammar would silently not enforce; True when ``schema`` was
        narrowed in place to what it does enforce (enum values of another type than the node's dropped)."""
        narrowed = False
        for path, node in _subschemas(schema, ""):
            where = path or "the top level"
            if not self._warned_slow and any(key in node for key in _SLOW_KEYWORDS):
                # Once per scheduler: operators see it in the log, clients are not refused.
                self._warned_slow = True
                logger.warning(
                    "a json_schema bounds a string's length (%s at %s): xgrammar builds such token masks ~30x "
                    "more slowly (mlc-ai/xgrammar#852), which costs throughput when many of these requests run at "
                    "once; grammar.backend: llguidance does not have this cost",
                    next(key for key in _SLOW_KEYWORDS if key in node), where)
            unsupported = [key for key in _IGNORED_KEYWORDS if key in node]
            if unsupported:
                raise GrammarCompileError(
                    f"invalid json_schema: '{unsupported[0]}' at {where} is not supported by grammar backend "
                    "'xgrammar' (it would be ignored; llguidance does not support it either); remove it",
                    param="json_schema")
            dropped = ["allOf"] if len(node.get("allOf") or []) > 1 else []
            shape = next((key for key in _SHAPE_KEYWORDS if key in node), None)
            if shape is not None:
                dropped += [f"{key}' next to '{shape}" for key in _LENGTH_KEYWORDS if key in node]
            values_key = "enum" if isinstance(node.get("enum"), list) else "const" if "const" in node else None
            if values_key is not None:
                dropped += [f"{key}' next to '{values_key}" for key in _DROPPED_NEXT_TO_VALUES if key in node]
            if dropped:
                raise GrammarCompileError(
                    f"invalid json_schema: '{dropped[0]}' at {where} is not supported by grammar backend 'xgrammar' "
                    f"(it would be ignored); remove it, or use grammar.backend: llguidance", param="json_schema")
            if values_key is not None and "type" in node:
                values = node["enum"] if values_key == "enum" else [node["const"]]
                kept = [value for value in values if _has_json_type(value, node["type"])]
                if not kept:
                    raise GrammarCompileError(
                        f"invalid json_schema: no value of the '{values_key}' at {where} has its type "
                        f"{json.dumps(node['type'])}, so nothing can match", param="json_schema")
                if len(kept) < len(values):
                    node["enum"], narrowed = kept, True
            if isinstance(node.get("pattern"), str):
                # Inside a schema xgrammar drops what its regex engine lacks (look-around) with only a warning.
                try:
                    self._compiler.compile_regex(node["pattern"])
                except (RuntimeError, ValueError) as exc:
                    message = _LOG_PREFIX.sub("", str(exc).strip())
                    raise GrammarCompileError(f"invalid json_schema: the pattern at {where}: {message}",
                                              param="json_schema") from None
        return narrowed

    def new_matcher(self, compiled: "_Compiled") -> GrammarMatcher:
        return XGrammarMatcher(self._xgr.GrammarMatcher(compiled.grammar), compiled.mask)

    def fill_bitmasks(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        if len(matchers) < 2:
            return super().fill_bitmasks(matchers, bitmask, rows)
        if self._batch is None:
            self._batch = self._xgr.BatchGrammarMatcher(max_threads=self._batch_threads)
        self._batch.batch_fill_next_token_bitmask([m._matcher for m in matchers], bitmask, list(rows))
        json_rows = [row for matcher, row in zip(matchers, rows) if matcher.mask is not None]
        if json_rows:
            bitmask[json_rows] &= self._json_mask


class _Compiled:
    """An xgrammar compiled grammar and the mask its rows are narrowed by (None: none)."""

    def __init__(self, grammar: Any, mask: torch.Tensor | None = None) -> None:
        self.grammar = grammar
        self.mask = mask


class XGrammarMatcher(GrammarMatcher):
    """An xgrammar GrammarMatcher; it terminates once a stop token is accepted after a complete match.
    ``mask`` (an int32 bitmask row) narrows each filled row further. Built without a rollback limit: it keeps
    every accepted token's state, so any number of them can be undone."""

    max_rollback_tokens = _UNLIMITED

    def __init__(self, matcher: Any, mask: torch.Tensor | None = None) -> None:
        self._matcher = matcher
        self.mask = mask

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if self.mask is not None:
            bitmask[row] &= self.mask

    def accept_token(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)


def _no_control_characters(info: Any, vocab_size: int, any_whitespace: bool) -> torch.Tensor:
    """The bitmask row of the tokens whose text holds no raw control character (but JSON whitespace, when
    ``any_whitespace``); special tokens (the stop tokens among them) stay allowed."""
    allowed_controls = set(_JSON_WHITESPACE) if any_whitespace else set()
    special = set(info.special_token_ids)
    allowed = torch.ones(vocab_size, dtype=torch.bool)
    for token_id, text in enumerate(info.decoded_vocab[:vocab_size]):
        if token_id not in special and any(byte < 0x20 and byte not in allowed_controls for byte in text):
            allowed[token_id] = False
    return pack_bitmask(allowed)


def _has_json_type(value: Any, types: Any) -> bool:
    """Whether a JSON value is of the JSON-schema ``type`` (a name or a list of names)."""
    for name in [types] if isinstance(types, str) else list(types or ()):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if (name == "null" and value is None or name == "boolean" and isinstance(value, bool)
                or name == "integer" and number and (isinstance(value, int) or value.is_integer())
                or name == "number" and number or name == "string" and isinstance(value, str)
                or name == "array" and isinstance(value, list) or name == "object" and isinstance(value, dict)):
            return True
    return False


def _subschemas(schema: Any, path: str) -> Iterator[tuple[str, dict]]:
    """Every (JSON pointer, schema object) in ``schema``, descending only where keywords hold schemas."""
    if not isinstance(schema, dict):
        return
    yield path, schema
    for key in _SCHEMA_MAPS:
        for name, sub in (schema.get(key) or {}).items() if isinstance(schema.get(key), dict) else ():
            yield from _subschemas(sub, f"{path}/{key}/{name}")
    for key in _SCHEMA_LISTS + _SCHEMA_VALUES:
        value = schema.get(key)
        if isinstance(value, list) and key in _SCHEMA_LISTS + ("items",):
            for i, sub in enumerate(value):
                yield from _subschemas(sub, f"{path}/{key}/{i}")
        elif isinstance(value, dict):
            yield from _subschemas(value, f"{path}/{key}")


@hookimpl
def treadle_register_grammar_backends(register) -> None:
    register("xgrammar", XGrammarBackend)
