"""Log-probabilities in OpenAI's two shapes: chat's ``logprobs.content`` and the completions API's
``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``.

With ``echo`` the completions shape starts with the prompt's tokens, the first of which has no
log-prob (nothing comes before it): that is how evaluation tools (lm-eval-harness and the like)
score a text's likelihood, with ``max_tokens: 0``.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any, Callable, Sequence

TopLogprobs = Sequence[tuple[int, float]]  # (token id, log-prob), best first
Decode = Callable[[int], str]  # one token's text


def chat_logprobs(decode: Decode, ids: Sequence[int], logprobs: Sequence[float],
                  tops: Sequence[TopLogprobs]) -> dict[str, Any]:
    """``choices[i].logprobs`` of a chat completion (or of one chunk of a streamed one)."""
    content = []
    for pos, (token_id, logprob) in enumerate(zip(ids, logprobs)):
        text = decode(token_id)
        top = tops[pos] if pos < len(tops) else []
        content.append({
            "token": text, "logprob": logprob, "bytes": list(text.encode()),
            "top_logprobs": [{"token": (t := decode(i)), "logprob": v, "bytes": list(t.encode())} for i, v in top],
        })
    return {"content": content}


def completion_logprobs(decode: Decode, ids: Sequence[int], logprobs: Sequence[float | None],
                        tops: Sequence[TopLogprobs | None], start_offset: int = 0) -> tuple[dict[str, Any], int]:
    """``choices[i].logprobs`` of a completion (or of one chunk of a streamed one), and the text offset after it.

    One entry per token in every list. ``top_logprobs[i]`` maps the ``logprobs`` best tokens' texts to their
    log-probs, plus token ``i`` itself (as OpenAI does: up to ``logprobs + 1`` entries); None where the token has
    no log-prob (an echoed prompt's first). ``text_offset[i]`` is where token ``i``'s text starts in the
    concatenation of ``tokens`` from ``start_offset`` on (the offset after the previous chunk of a stream).
    """
    tokens = [decode(token_id) for token_id in ids]
    offsets = list(accumulate((len(token) for token in tokens), initial=start_offset))
    top_logprobs = []
    for pos, (token, logprob) in enumerate(zip(tokens, logprobs)):
        top = tops[pos] if pos < len(tops) else None
        top_logprobs.append(None if logprob is None else _top_entry(decode, token, logprob, top or ()))
    payload = {"tokens": tokens, "token_logprobs": list(logprobs[: len(ids)]), "top_logprobs": top_logprobs,
               "text_offset": offsets[:-1]}
    return payload, offsets[-1]


def _top_entry(decode: Decode, token: str, logprob: float, top: TopLogprobs) -> dict[str, float]:
    entry: dict[str, float] = {}
    for token_id, value in top:
        entry.setdefault(decode(token_id), value)  # two ids with one text: the likelier one's log-prob
    entry.setdefault(token, logprob)
    return entry
