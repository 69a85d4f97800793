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
