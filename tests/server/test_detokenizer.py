"""The detokenizer drops a finishing stop token from the text, and only a stop token."""

from __future__ import annotations

from transformers import AutoTokenizer

from treadle.core.request import FinishReason, ReqOutput
from treadle.server.detokenizer import Detokenizer
from treadle.server.ipc import BatchTokenIDOut, RegisterDecode
from treadle.testing.tokenizer import make_tiny_tokenizer


def test_last_token_is_dropped_only_when_it_is_a_stop_token(tmp_path):
    make_tiny_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    ids = tokenizer.encode("Paris", add_special_tokens=False)
    detokenizer = Detokenizer(tokenizer)

    def finish(rid: str, detail: str | None) -> str:
        detokenizer.handle(RegisterDecode(rid, skip_special_tokens=False, stop=[]))
        out = ReqOutput(rid, ids, FinishReason.STOP, detail, prompt_tokens=1, completion_tokens=len(ids),
                        cached_tokens=0)
        return detokenizer.handle(BatchTokenIDOut([out])).outputs[0].text_delta

    assert finish("eos", str(ids[-1])) == tokenizer.decode(ids[:-1])  # ended on a stop token: not in the text
    assert finish("grammar", None) == "Paris"  # a constraint completed on an ordinary token: kept
