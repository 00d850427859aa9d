"""The outer momentum's 8-bit form (node.lowcomm.momentum): what a block holds, how close it stays, and that a run
of whole blocks rounds to the bits of the whole tensor."""
from __future__ import annotations

import pytest
import torch

from dtrain.node.lowcomm import momentum as momentum8

pytestmark = pytest.mark.unit

BLOCK = momentum8.BLOCK


def rounded(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    codes, scales = momentum8.zeros(values)
    momentum8.quantize_(values, codes, scales)
    return codes, scales


def test_each_block_keeps_its_largest_magnitude_and_every_value_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    n = 3 * BLOCK + 41  # three whole blocks and a shorter one
    values = torch.randn(n, generator=g) * torch.logspace(-6, 2, n)  # blocks of very different magnitudes
    values[BLOCK:2 * BLOCK] = 0.0  # an all-zero block
    codes, scales = rounded(values)
    assert codes.dtype == torch.int8 and scales.shape == (4,) and codes.abs().max() == momentum8.LEVELS
    assert scales[1] == 0 and not codes[BLOCK:2 * BLOCK].any()
    back = momentum8.dequantize(codes, scales)
    for b in range(4):
        block = slice(b * BLOCK, min(n, (b + 1) * BLOCK))
        assert scales[b] == values[block].abs().max() / momentum8.LEVELS
        assert (back[block] - values[block]).abs().max() <= scales[b] / 2 * (1 + 1e-6)
        assert back[block].abs().max() == pytest.approx(values[block].abs().max().item(), rel=1e-6)


def test_a_run_of_whole_blocks_rounds_to_the_bits_of_the_whole_tensor():
    g = torch.Generator().manual_seed(1)
    values = torch.randn(5 * BLOCK + 7, generator=g)
    codes, scales = rounded(values)
    for first, last in ((0, 1), (1, 3), (4, 6), (5, 6)):  # blocks [first, last), the last one the shorter block
        run = values[first * BLOCK:last * BLOCK]
        c, s = rounded(run)
        assert torch.equal(c, codes[first * BLOCK:last * BLOCK]) and torch.equal(s, scales[first:last])
        assert torch.equal(momentum8.dequantize(c, s), momentum8.dequantize(codes, scales)[first * BLOCK:last * BLOCK])


def test_codes_keep_their_tensors_shape_and_sizes_that_do_not_match_are_refused():
    p = torch.zeros(3, 100)
    codes, scales = momentum8.zeros(p)
    assert codes.shape == p.shape and scales.shape == (momentum8.blocks(300),) == (2,)
    momentum8.quantize_(torch.ones(3, 100), codes, scales)
    assert codes.shape == p.shape and torch.equal(momentum8.dequantize(codes, scales), torch.ones(300))
    with pytest.raises(ValueError):
        momentum8.quantize_(torch.ones(301), codes, scales)
    with pytest.raises(ValueError):
        momentum8.dequantize(codes, torch.zeros(3))
    assert momentum8.STATE_BYTES_PER_ELEMENT == 4 + 1 + 4 / BLOCK  # a downloaded state: f32 parameters, the form
