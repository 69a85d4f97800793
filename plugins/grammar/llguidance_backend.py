"""The ``llguidance`` grammar backend: compiles constraints with Microsoft's llguidance library."""

from __future__ import annotations

import json
from typing import Any, Sequence

import torch

from treadle.core.grammar import Constraint, GrammarBackend, GrammarCompileError, GrammarMatcher
from treadle.core.hookspecs import hookimpl


class LLGuidanceBackend(GrammarBackend):
    """JSON schema, regex (Rust ``regex`` syntax) and GBNF/Lark grammars through llguidance.

    llguidance builds its token automaton lazily, so "compiling" is a validation
    of the grammar against the tokenizer; each matcher then starts from the text.
    """

    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 any_whitespace: bool = False) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self._llg = llguidance
        # llguidance knows only the tokenizer's ids; a model may list stop ids past them (a padded vocabulary).
        eos = [t for t in stop_token_ids if t < len(tokenizer)] or None
        try:
            self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        except TypeError:  # llguidance < 1.7 takes one stop token: prefer the tokenizer's own
            own = tokenizer.eos_token_id
            single = own if eos and own in eos else (eos[0] if eos else None)
            self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=single)
        self._any_whitespace = any_whitespace
        self._executor: Any = None

    def compile(self, constraint: Constraint) -> Any:
        llg = self._llg
        try:
            if constraint.kind == "json_schema":
                grammar = llg.LLMatcher.grammar_from_json_schema(
                    _closed_objects(json.loads(constraint.text)),
                    defaults={"whitespace_flexible": self._any_whitespace})
            elif constraint.kind == "regex":
                grammar = llg.LLMatcher.grammar_from_regex(constraint.text)
            elif constraint.kind == "ebnf":
                grammar = llg.grammar_from("gbnf", constraint.text)
            else:
                raise GrammarCompileError(f"llguidance cannot compile a '{constraint.kind}' constraint",
                                          param=constraint.kind)
        except ValueError as exc:
            if isinstance(exc, GrammarCompileError):
                raise
            raise GrammarCompileError(f"invalid {constraint.kind}: {exc}", param=constraint.kind) from None
        error = llg.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise GrammarCompileError(f"invalid {constraint.kind}: {error.strip()}", param=constraint.kind)
        return grammar

    def new_matcher(self, compiled: Any) -> GrammarMatcher:
        return LLGuidanceMatcher(self._llg.LLMatcher(self._tokenizer, compiled, log_level=0))

    def fill_bitmasks(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        if len(matchers) < 2:
            return super().fill_bitmasks(matchers, bitmask, rows)
        from llguidance.torch import fill_next_token_bitmask_par

        if self._executor is None:
            self._executor = self._llg.LLExecutor()
        fill_next_token_bitmask_par(self._executor, [(m._matcher, row) for m, row in zip(matchers, rows)], bitmask)


class LLGuidanceMatcher(GrammarMatcher):
    """An llguidance LLMatcher; it terminates as soon as the grammar admits nothing but a stop token. It keeps
    every accepted token's state, so any number of them can be undone."""

    max_rollback_tokens = 1 << 30

    def __init__(self, matcher: Any) -> None:
        from llguidance.torch import fill_next_token_bitmask

        self._matcher = matcher
        self._fill = fill_next_token_bitmask

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._fill(self._matcher, bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        return self._matcher.consume_token(token_id)

    def is_terminated(self) -> bool:
        return self._matcher.is_stopped()

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)


def _closed_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` wherever an object lists its properties and says
    nothing about others — the strict reading xgrammar and OpenAI's structured outputs use."""
    if isinstance(schema, list):
        return [_closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed_objects(value) for key, value in schema.items()}
    if "properties" in closed and "additionalProperties" not in closed and "patternProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


@hookimpl
def treadle_register_grammar_backends(register) -> None:
    register("llguidance", LLGuidanceBackend)
