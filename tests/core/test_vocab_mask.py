"""apply_vocab_mask: the bitmask layout every grammar backend writes, unpacked on the device."""

from __future__ import annotations

import torch

from treadle.core.grammar import apply_vocab_mask, bitmask_width, pack_bitmask, unpack_bitmask


def test_bitmask_bits_select_exactly_the_allowed_tokens():
    vocab = 70  # not a multiple of 32: the last word is partly padding
    generator = torch.Generator().manual_seed(0)
    allowed = torch.rand((3, vocab), generator=generator) < 0.3
    allowed[2] = True  # an unconstrained row: every bit set
    bitmask = torch.zeros((3, bitmask_width(vocab)), dtype=torch.int32)
    for row, token in allowed.nonzero().tolist():
        word, bit = divmod(token, 32)
        bitmask[row, word] |= torch.tensor(1 << bit).to(torch.int32)  # bit 31 makes the word negative
    bitmask[2] = -1
    logits = torch.randn((3, vocab), generator=generator)
    masked = apply_vocab_mask(logits, bitmask)
    assert torch.equal(masked.isinf(), ~allowed)
    assert torch.equal(masked[allowed], logits[allowed])
    # pack_bitmask writes the same words from a bool row (padding bits clear, unlike row 2's -1), and
    # unpack_bitmask reads them back.
    for row in range(3):
        if row < 2:
            assert torch.equal(pack_bitmask(allowed[row]), bitmask[row])
        assert torch.equal(unpack_bitmask(pack_bitmask(allowed[row]).unsqueeze(0))[0, :vocab].bool(), allowed[row])
