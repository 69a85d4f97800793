"""Token ids → text, a few tokens at a time, as they stream out of the scheduler.

Decoding each new token on its own is wrong twice over: a character may span
several byte-level tokens (an emoji is often 3-4), and SentencePiece-style
tokenizers drop a token's leading space when it is decoded without context.
:class:`IncrementalDecoder` decodes a short window of already-emitted tokens
together with the new ones and emits only the difference, holding it back
while it ends in an incomplete character.

Stop strings: the scheduler decides *when* a request stops; the decoder makes
sure no text from a stop string ever reaches the client. It holds back any
tail that could be the start of a stop string, and cuts the final text before
the first stop string it contains.
"""

from __future__ import annotations

from typing import Any, Sequence

_REPLACEMENT_CHAR = "\ufffd"


def trim_at_stop(text: str, stop: Sequence[str] | None) -> str:
    """``text`` cut before the earliest occurrence of any stop string (unchanged when none occurs)."""
    cut = len(text)
    for s in stop or ():
        if s:
            pos = text.find(s)
            if pos != -1 and pos < cut:
                cut = pos
    return text[:cut]


def stopped_by_token(finished_reason: Any, finished_detail: Any, stop_strings: Sequence[str] | None) -> bool:
    """Whether a request ended on a stop token (EOS or stop_token_ids) rather than a stop string: that token
    is not part of the text, as with OpenAI. A stop token always records its id as the detail; a STOP without
    a detail (a grammar that completed on an ordinary token) keeps its last token."""
    return finished_reason == "stop" and finished_detail is not None and finished_detail not in (stop_strings or ())


class IncrementalDecoder:
    """Turns a request's output token ids into text deltas that are safe to send.

    ``feed(ids)`` returns the new text that can be shown now; ``finish()``
    returns whatever was held back, cut before a matched stop string. The
    concatenation of all returned deltas equals ``trim_at_stop(decode(all ids), stop)``
    up to how the tokenizer renders an incomplete final character.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True, stop: Sequence[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in (stop or []) if s]
        self.token_ids: list[int] = []
        self.text = ""  # decoded text of token_ids[:read_offset]
        self.sent = 0  # characters of self.text already returned
        self.stopped = False  # a stop string was seen: nothing more is ever returned
        self._prefix_offset = 0
        self._read_offset = 0

    def feed(self, token_ids: Sequence[int]) -> str:
        """Add new token ids; return the text that became safe to send."""
        self.token_ids.extend(int(t) for t in token_ids)
        self._advance(final=False)
        return self._release(final=False)

    def finish(self) -> str:
        """Flush the held-back text (the request is over); cut it before a matched stop string."""
        self._advance(final=True)
        return self._release(final=True)

    @property
    def output_text(self) -> str:
        """All text returned so far."""
        return self.text[: self.sent]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _advance(self, final: bool) -> None:
        if self._read_offset >= len(self.token_ids):
            return
        # The window starts at tokens already turned into text, so that spaces and
        # merges at the boundary decode exactly as they do in the full sequence.
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.token_ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith(_REPLACEMENT_CHAR)):
            self.text += new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.token_ids)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        end = len(self.text)
        if self.stop:
            # A stop string can start at most max_len - 1 characters before what was sent.
            longest = max(len(s) for s in self.stop)
            search_from = max(0, self.sent - longest + 1)
            window = self.text[search_from:]
            trimmed = trim_at_stop(window, self.stop)
            if len(trimmed) < len(window):
                end = search_from + len(trimmed)
                self.stopped = True
            elif not final:
                end -= _partial_stop_suffix(self.text, self.stop, self.sent)
        delta = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta


def _partial_stop_suffix(text: str, stop: list[str], sent: int) -> int:
    """Length of the longest tail of ``text`` (not yet sent) that is a proper prefix of a stop string."""
    best = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text) - sent), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
