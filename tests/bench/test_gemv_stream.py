"""bench/gemv_stream.py's kernel under Triton's interpreter: each row's packed words summed (wrapping, as int32 adds
wrap) over each K range, loaded with the GEMV's launch parameters; a K that the ranges do not tile is refused."""

from __future__ import annotations

CHECKS = r"""
import json, torch
from treadle.bench.gemv_stream import stream
torch.manual_seed(0)
words = torch.randint(-2**31, 2**31 - 1, (20, 256), dtype=torch.int32)
found = {}
for block_n, block_w, split_k in ((8, 64, 1), (16, 32, 2), (4, 128, 2)):
    got = stream(words, block_n, block_w, split_k, 1).long()
    sums = words.long().view(20, split_k, -1).sum(-1).t()
    wrapped = (sums + 2**31) % 2**32 - 2**31
    found[f"{block_n}x{block_w}/{split_k}"] = bool(torch.equal(got, wrapped))
try:
    stream(words, 8, 128, 4, 1)
    found["refused"] = False
except ValueError:
    found["refused"] = True
print("RESULTS " + json.dumps(found))
"""


def test_the_stream_kernel_sums_each_rows_words_per_k_range():
    from interpreted import interpreted_code_results

    found = interpreted_code_results(CHECKS)
    assert found == {"8x64/1": True, "16x32/2": True, "4x128/2": True, "refused": True}
