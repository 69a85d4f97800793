"""The built-in grammar backends pass the conformance kit; the kit catches a backend that masks wrongly."""

from __future__ import annotations

import pytest

from treadle.core.grammar import GrammarBackend, GrammarMatcher
from treadle.core.registry import build_registry
from treadle.testing import check_grammar_backend


@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])
def test_builtin_grammar_backend_conforms(name):
    check_grammar_backend(build_registry().get("grammar_backends", name))


class _LeakyMatcher(GrammarMatcher):
    """Wraps a correct matcher but also allows token ``extra`` everywhere."""

    def __init__(self, inner: GrammarMatcher, extra: int) -> None:
        self.inner, self.extra = inner, extra

    def fill_bitmask(self, bitmask, row):
        self.inner.fill_bitmask(bitmask, row)
        bitmask[row, self.extra // 32] |= 1 << (self.extra % 32)

    def accept_token(self, token_id):
        return self.inner.accept_token(token_id)

    def is_terminated(self):
        return self.inner.is_terminated()


def test_the_check_rejects_a_mask_that_admits_too_much():
    xgrammar = build_registry().get("grammar_backends", "xgrammar")

    class LeakyBackend(GrammarBackend):
        def __init__(self, **kwargs):
            self.inner = xgrammar(**kwargs)

        def compile(self, constraint):
            return self.inner.compile(constraint)

        def new_matcher(self, compiled):
            return _LeakyMatcher(self.inner.new_matcher(compiled), extra=12)  # 'c'

    with pytest.raises(AssertionError, match="allow"):
        check_grammar_backend(LeakyBackend)


def test_xgrammar_warns_once_about_string_length_bounds(tmp_path, caplog):
    import json
    import logging

    from transformers import AutoTokenizer

    from treadle.core.grammar import Constraint
    from treadle.plugins.grammar.xgrammar_backend import XGrammarBackend
    from treadle.testing.tokenizer import make_tiny_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(make_tiny_tokenizer(tmp_path / "tokenizer"))
    backend = XGrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    bounded = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}
    with caplog.at_level(logging.WARNING, logger="treadle.plugins.grammar.xgrammar_backend"):
        backend.compile(Constraint("json_schema", json.dumps({"type": "object"})))
        assert not caplog.records
        backend.compile(Constraint("json_schema", json.dumps(bounded)))
        backend.compile(Constraint("json_schema", json.dumps(bounded)))
    assert len(caplog.records) == 1
    assert "maxLength at /properties/name" in caplog.text and "grammar.backend: llguidance" in caplog.text
