"""IncrementalDecoder: streamed deltas add up to the full text; stop strings never leak."""

from __future__ import annotations

import pytest

from treadle.text.incremental_decode import IncrementalDecoder, trim_at_stop


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer

    from treadle.testing.tokenizer import make_tiny_tokenizer

    return AutoTokenizer.from_pretrained(make_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


TEXTS = ["The capital of France is Paris.", "naïve café 😀 東京 über", " leading space and  double"]


def _stream(decoder: IncrementalDecoder, ids: list[int], step: int) -> list[str]:
    deltas = [decoder.feed(ids[i:i + step]) for i in range(0, len(ids), step)]
    return deltas + [decoder.finish()]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 3])
def test_deltas_add_up_to_the_full_decode(tokenizer, text: str, step: int) -> None:
    ids = tokenizer.encode(text)
    deltas = _stream(IncrementalDecoder(tokenizer), ids, step)
    assert "".join(deltas) == tokenizer.decode(ids) == text


def test_multi_token_characters_are_never_split(tokenizer) -> None:
    ids = tokenizer.encode("😀")
    assert len(ids) > 1  # a byte-level emoji spans tokens
    deltas = _stream(IncrementalDecoder(tokenizer), ids, 1)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == "😀"


def test_text_that_may_start_a_stop_string_is_held_back(tokenizer) -> None:
    decoder = IncrementalDecoder(tokenizer, stop=["Paris."])
    shown = ""
    for token in tokenizer.encode("The capital of France is Paris. Really"):
        shown += decoder.feed([token])
        assert "Par" not in shown
    shown += decoder.finish()
    assert shown == "The capital of France is "


def test_finish_releases_a_held_back_partial_match(tokenizer) -> None:
    decoder = IncrementalDecoder(tokenizer, stop=["Paris!"])
    shown = "".join(_stream(decoder, tokenizer.encode("It is Paris"), 1))
    assert shown == "It is Paris"


def test_special_tokens_are_skipped_unless_asked(tokenizer) -> None:
    ids = tokenizer.encode("hi") + [tokenizer.eos_token_id]
    assert "".join(_stream(IncrementalDecoder(tokenizer), ids, 1)) == "hi"
    assert "".join(_stream(IncrementalDecoder(tokenizer, skip_special_tokens=False), ids, 1)) == "hi</s>"


def test_trim_at_stop_cuts_at_the_earliest_stop() -> None:
    assert trim_at_stop("a b STOP c END", ["END", "STOP"]) == "a b "
    assert trim_at_stop("nothing here", ["x"]) == "nothing here"
    assert trim_at_stop("text", None) == "text"
