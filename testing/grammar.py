"""Conformance check for grammar backends: masks admit exactly the strings the constraint accepts.

On a tiny byte-level tokenizer (single characters plus a few merged tokens)
every text a backend's masks let through is explored, and at each one the
allowed tokens are compared with what Python decides: ``re.fullmatch`` over
the whole (finite) language for regexes and EBNF, ``json.loads`` plus
``jsonschema`` for JSON schemas.
"""

from __future__ import annotations

import itertools
import json
import re
from functools import lru_cache
from typing import Any, Callable

import torch

from treadle.core.grammar import Constraint, GrammarBackend, GrammarCompileError, bitmask_width, unpack_bitmask

# Finite languages over the tokenizer's characters: (pattern, GBNF equivalent or None).
REGEX_CASES: list[tuple[str, str | None]] = [
    (r"(ab|c)[01]{1,2}", 'root ::= ("ab" | "c") [01] [01]?'),
    (r"a{1,3}b?", None),
    (r"[abc]{2}|10", 'root ::= [abc] [abc] | "10"'),
    (r"(a|b)c(0|1)?", None),
]
# Schemas whose compact JSON texts are finite, with every value they admit.
JSON_CASES: list[tuple[dict[str, Any], list[Any]]] = [
    ({"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"enum": [0, 1]}},
      "required": ["a", "b"], "additionalProperties": False},
     [{"a": a, "b": b} for a in (True, False) for b in (0, 1)]),
    ({"type": "array", "items": {"enum": [0, 1]}, "maxItems": 2},
     [[]] + [[x] for x in (0, 1)] + [[x, y] for x in (0, 1) for y in (0, 1)]),
    ({"enum": ["ab", 10, None, True]}, ["ab", 10, None, True]),
]
INVALID_CONSTRAINTS = [
    Constraint("regex", "(ab"),
    Constraint("json_schema", '{"type": "no-such-type"}'),
    Constraint("ebnf", "root ::= undefined_rule"),
]
_REGEX_ALPHABET = "abc01"
_MERGES = [("a", "b"), ("1", "0"), ("{", '"'), ('"', ":"), ("t", "r"), ("tr", "u"), ("tru", "e"), ("n", "u"),
           ("nu", "l"), ("nul", "l"), ('"', ","), (",", "Ġ")]
_CHARS = sorted(set(_REGEX_ALPHABET + '{}[]",:Ġtruefalsn'))
_MAX_TEXTS = 4000


def check_grammar_backend(factory: Callable[..., GrammarBackend]) -> None:
    """Raise AssertionError unless ``factory``'s backend masks exactly the texts each constraint accepts."""
    tokenizer = grammar_test_tokenizer()
    vocab_size = len(tokenizer) + 5  # model vocab wider than the tokenizer: the extra ids are never allowed
    eos = tokenizer.eos_token_id
    backend = factory(tokenizer=tokenizer, vocab_size=vocab_size, stop_token_ids=[eos], any_whitespace=False)
    texts = _token_texts(tokenizer)
    for pattern, gbnf in REGEX_CASES:
        _check_finite_language(backend, Constraint("regex", pattern), pattern, texts, vocab_size, eos)
        if gbnf is not None:
            _check_finite_language(backend, Constraint("ebnf", gbnf), pattern, texts, vocab_size, eos)
    for schema, values in JSON_CASES:
        _check_json_schema(backend, schema, values, texts, vocab_size, eos)
    for constraint in INVALID_CONSTRAINTS:
        try:
            backend.compile(constraint)
        except GrammarCompileError:
            continue
        except Exception as exc:
            raise AssertionError(f"compiling the invalid {constraint.kind} {constraint.text!r} raised "
                                 f"{type(exc).__name__}, expected GrammarCompileError: {exc}") from exc
        raise AssertionError(f"the invalid {constraint.kind} {constraint.text!r} compiled without an error")


@lru_cache(maxsize=1)
def grammar_test_tokenizer() -> Any:
    """A byte-level BPE tokenizer of a few dozen tokens: single characters and some merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(["<pad>", "<s>", "</s>"] + _CHARS)}
    for left, right in _MERGES:
        vocab[left + right] = len(vocab)
    model = models.BPE(vocab=vocab, merges=list(_MERGES))
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def _token_texts(tokenizer: Any) -> dict[int, str]:
    special = set(tokenizer.all_special_ids)
    return {i: tokenizer.decode([i]) for i in range(len(tokenizer)) if i not in special}


def _check_finite_language(backend: GrammarBackend, constraint: Constraint, pattern: str,
                           texts: dict[int, str], vocab_size: int, eos: int) -> None:
    longest = 6
    language = {
        "".join(chars) for n in range(longest + 1) for chars in itertools.product(_REGEX_ALPHABET, repeat=n)
        if re.fullmatch(pattern, "".join(chars))
    }
    prefixes = {word[:i] for word in language for i in range(len(word) + 1)}
    reached = _explore(backend, constraint, texts, vocab_size, eos, longest)
    assert set(reached) == prefixes, (
        f"{constraint.kind} {constraint.text!r}: masks reach {sorted(set(reached) - prefixes)[:5]} beyond the "
        f"language's prefixes and miss {sorted(prefixes - set(reached))[:5]}")
    for text, allowed in reached.items():
        expected = {t for t, piece in texts.items() if text + piece in prefixes}
        if text in language:
            expected.add(eos)
        assert allowed == expected, (
            f"{constraint.kind} {constraint.text!r} after {text!r}: mask allows "
            f"{sorted(texts.get(t, t) for t in allowed - expected)} it should not and misses "
            f"{sorted(texts.get(t, t) for t in expected - allowed)}")


def _check_json_schema(backend: GrammarBackend, schema: dict[str, Any], values: list[Any],
                       texts: dict[int, str], vocab_size: int, eos: int) -> None:
    import jsonschema

    constraint = Constraint("json_schema", json.dumps(schema))
    reached = _explore(backend, constraint, texts, vocab_size, eos, 40)
    accepted = [text for text, allowed in reached.items() if eos in allowed]
    decoded = []
    for text in accepted:
        try:
            value = json.loads(text)
        except ValueError:
            raise AssertionError(f"json_schema {schema}: the masks accept {text!r}, which is not JSON") from None
        try:
            jsonschema.validate(value, schema)
        except jsonschema.ValidationError as exc:
            raise AssertionError(f"json_schema {schema}: the masks accept {text!r}: {exc.message}") from None
        decoded.append(json.dumps(value, sort_keys=True))
    expected = {json.dumps(value, sort_keys=True) for value in values}
    assert set(decoded) == expected, (
        f"json_schema {schema}: accepted values {sorted(set(decoded))} != expected {sorted(expected)}")
    for text, allowed in reached.items():
        assert eos in allowed or any(t != eos for t in allowed), f"json_schema {schema}: dead end after {text!r}"


def _explore(backend: GrammarBackend, constraint: Constraint, texts: dict[int, str], vocab_size: int,
             eos: int, max_len: int) -> dict[str, set[int]]:
    """Every text the masks let a generation reach (up to ``max_len`` characters), with its allowed ids."""
    compiled = backend.compile(constraint)
    width = bitmask_width(vocab_size)
    paths: dict[str, list[int]] = {"": []}
    queue = [""]
    reached: dict[str, set[int]] = {}
    while queue:
        text = queue.pop()
        matcher = backend.new_matcher(compiled)
        for token in paths[text]:
            assert matcher.accept_token(token), f"{constraint.kind} {constraint.text!r}: token {token} was allowed " \
                                                f"after {text!r} but accept_token refused it"
        bitmask = torch.zeros((2, width), dtype=torch.int32)
        matcher.fill_bitmask(bitmask, 1)
        assert not bitmask[0].any(), "fill_bitmask wrote outside its row"
        allowed = _allowed_ids(bitmask[1], vocab_size)
        reached[text] = allowed
        stray = [t for t in allowed if t != eos and t not in texts]
        assert not stray, (f"{constraint.kind} {constraint.text!r} after {text!r}: mask allows special or "
                           f"out-of-vocabulary ids {stray}")
        if eos in allowed:
            assert not matcher.is_terminated() or not (allowed - {eos}), \
                f"{constraint.kind}: terminated after {text!r} while tokens are still allowed"
            assert matcher.accept_token(eos) and matcher.is_terminated(), (
                f"{constraint.kind} {constraint.text!r}: accepting the stop token after {text!r} "
                f"does not terminate the matcher")
        for token in allowed - {eos}:
            new = text + texts[token]
            if new not in paths and len(new) <= max_len:
                paths[new] = paths[text] + [token]
                queue.append(new)
        assert len(paths) <= _MAX_TEXTS, f"{constraint.kind} {constraint.text!r}: more than {_MAX_TEXTS} texts"
    _check_batched_fill(backend, compiled, [paths[text] for text in sorted(reached)[:8]], width)
    _check_rollback(backend, compiled, [paths[max(reached, key=len)]], width, eos)
    rejected = backend.new_matcher(compiled)
    bad = next((t for t in texts if t not in reached[""]), None)
    if bad is not None:
        assert not rejected.accept_token(bad), (
            f"{constraint.kind} {constraint.text!r}: accept_token took {texts[bad]!r}, which the mask forbids")
    return reached


def _check_batched_fill(backend: GrammarBackend, compiled: Any, prefixes: list[list[int]], width: int) -> None:
    """``fill_bitmasks`` into scattered rows writes what each matcher's own ``fill_bitmask`` writes."""
    matchers = []
    for tokens in prefixes:
        matcher = backend.new_matcher(compiled)
        for token in tokens:
            matcher.accept_token(token)
        matchers.append(matcher)
    rows = [2 * i + 1 for i in range(len(matchers))][::-1]
    batched = torch.zeros((2 * len(matchers) + 1, width), dtype=torch.int32)
    backend.fill_bitmasks(matchers, batched, rows)
    for matcher, row in zip(matchers, rows):
        alone = torch.zeros((1, width), dtype=torch.int32)
        matcher.fill_bitmask(alone, 0)
        assert torch.equal(batched[row], alone[0]), f"fill_bitmasks row {row} differs from fill_bitmask"
    assert not batched[0::2].any(), "fill_bitmasks wrote rows it was not given"


def _check_rollback(backend: GrammarBackend, compiled: Any, paths: list[list[int]], width: int, eos: int) -> None:
    """Where matchers can roll back (``max_rollback_tokens`` > 0, what speculative decoding needs): after a path
    (and after it the stop token, where that is the token that terminates the matcher), ``rollback(n)`` leaves the
    mask and the termination of a fresh matcher that accepted all but the last ``n`` tokens."""
    for path in list(paths):
        matcher = backend.new_matcher(compiled)
        for token in path:
            matcher.accept_token(token)
        if not matcher.is_terminated() and matcher.accept_token(eos):
            paths.append(path + [eos])
    for path in paths:
        matcher = backend.new_matcher(compiled)
        depth = min(len(path), getattr(matcher, "max_rollback_tokens", 0))
        for token in path:
            assert matcher.accept_token(token), f"accept_token refused {token} while replaying {path}"
        for n in sorted({1, 2, depth} & set(range(1, depth + 1))):
            matcher.rollback(n)
            fresh = backend.new_matcher(compiled)
            for token in path[:len(path) - n]:
                fresh.accept_token(token)
            rolled, expected = (torch.zeros((1, width), dtype=torch.int32) for _ in range(2))
            matcher.fill_bitmask(rolled, 0)
            fresh.fill_bitmask(expected, 0)
            assert torch.equal(rolled, expected) and matcher.is_terminated() == fresh.is_terminated(), (
                f"after the tokens {path}, rollback({n}) does not return to the state after {path[:len(path) - n]}")
            for token in path[len(path) - n:]:  # forward again, as speculative decoding does after a rollback
                assert matcher.accept_token(token), f"accept_token refused {token} again after rollback({n})"


def _allowed_ids(row: torch.Tensor, vocab_size: int) -> set[int]:
    bits = unpack_bitmask(row.unsqueeze(0))[0]
    beyond = bits[vocab_size:]
    assert not beyond.any(), "the mask sets bits past vocab_size"
    return set(torch.nonzero(bits[:vocab_size]).flatten().tolist())
