"""The ``xgrammar`` grammar backend (the default): compiles constraints with the xgrammar library."""

from __future__ import annotations

import re
from typing import Any, Sequence

import torch

from treadle.core.grammar import Constraint, GrammarBackend, GrammarCompileError, GrammarMatcher
from treadle.core.hookspecs import hookimpl

# xgrammar prefixes its messages with a time and a C++ source location; users need neither.
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class XGrammarBackend(GrammarBackend):
    """JSON schema, regex and EBNF (GBNF-style ``root ::= ...``) through xgrammar's compiler."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 any_whitespace: bool = False) -> None:
        import xgrammar

        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_token_ids))
        # treadle's GrammarManager keeps the LRU of compiled grammars; xgrammar's own cache would be a second one.
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._any_whitespace = any_whitespace
        self._batch: Any = None

    def compile(self, constraint: Constraint) -> Any:
        try:
            if constraint.kind == "json_schema":
                return self._compiler.compile_json_schema(constraint.text, any_whitespace=self._any_whitespace,
                                                          strict_mode=True)
            if constraint.kind == "regex":
                return self._compiler.compile_regex(constraint.text)
            if constraint.kind == "ebnf":
                return self._compiler.compile_grammar(constraint.text)
        except (RuntimeError, ValueError) as exc:
            message = _LOG_PREFIX.sub("", str(exc).strip())
            raise GrammarCompileError(f"invalid {constraint.kind}: {message}", param=constraint.kind) from None
        raise GrammarCompileError(f"xgrammar cannot compile a '{constraint.kind}' constraint", param=constraint.kind)

    def new_matcher(self, compiled: Any) -> GrammarMatcher:
        return XGrammarMatcher(self._xgr.GrammarMatcher(compiled))

    def fill_bitmasks(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        if len(matchers) < 2:
            return super().fill_bitmasks(matchers, bitmask, rows)
        if self._batch is None:
            self._batch = self._xgr.BatchGrammarMatcher(max_threads="auto")
        self._batch.batch_fill_next_token_bitmask([m._matcher for m in matchers], bitmask, list(rows))


class XGrammarMatcher(GrammarMatcher):
    """An xgrammar GrammarMatcher; it terminates once a stop token is accepted after a complete match."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


@hookimpl
def treadle_register_grammar_backends(register) -> None:
    register("xgrammar", XGrammarBackend)
