"""bench/mma_sass.py reads the W4A16 tensor-core kernels' main loops out of their sm_90 SASS on a CPU: what it reports
for magic_mma (each of its four pair dots waited for, the activations re-laid out through shared memory) against
natural_mma (one dot a panel, no wait in the loop), and wide_mma's 128-token wgmmas, is what docs/quantization.md
cites."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")


def test_loop_report_tells_the_two_kernels_apart() -> None:
    from treadle.bench.mma_sass import loop_report
    from treadle.kernels.packed_int_magic import MagicMmaTiles
    from treadle.kernels.packed_int_natural import NaturalMmaTiles

    natural = loop_report(NaturalMmaTiles(32, 128, 2))
    magic = loop_report(MagicMmaTiles(32, 128, 2, scaled=True))
    # A 128-row weight tile by 32 tokens a K step of 128: 16 wgmmas (64 x 32 x 16) either way.
    assert natural["HGMMA"] == magic["HGMMA"] == 16
    assert natural["wait_all"] == 0 and magic["wait_all"] == 4
    assert natural["STS"] < magic["STS"] and natural["BAR"] < magic["BAR"]
    assert natural["LDGSTS"] > 0 and 0 < natural["programs_per_sm"] <= 16
    assert 100 < natural["instructions"] < magic["instructions"]


def test_wide_mma_feeds_128_token_wgmmas_from_registers_two_programs_an_sm() -> None:
    # kernels/packed_int_wide.py: a 128-row weight tile by 128 tokens a K step of 128: 16 wgmmas (64 x 128 x 16)
    # none waited for in the loop, words and activations copied asynchronously; two programs an SM.
    from treadle.bench.mma_sass import loop_report
    from treadle.kernels.packed_int_wide import WideMmaTiles

    wide = loop_report(WideMmaTiles(128, 128))
    assert wide["HGMMA"] == 16 and wide["wait_all"] == 0 and wide["LDG"] <= 1
    assert wide["LDGSTS"] >= 20 and wide["programs_per_sm"] == 2, wide
