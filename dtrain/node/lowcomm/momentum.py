"""The swarm's outer momentum, kept in 8 bits (docs/low-communication.md, "How a node joins").

A tensor's momentum is cut into blocks of BLOCK consecutive elements from its first (its last block may be
shorter). A block is stored as BLOCK int8 codes and one f32 scale, its absolute maximum / LEVELS, and holds
code * scale. Every peer rounds its momentum to this form after each outer step, with the same operations on the
same values, so the swarm's momentum is these bytes on every node: 1 + 4/BLOCK bytes per parameter in memory and in
a joiner's download, where f32 took 4 (the state a joiner moves: 5.02 bytes per parameter instead of 8).
`bench/bench_state_encoding.py` measured what keeping it so costs the training: no loss that run could tell from
noise.

The operations are elementwise within a block, so a run of whole blocks (a range of a download: node.lowcomm.ranges)
is rounded to the same bits as the whole tensor. Pure: tensors in, tensors out.
"""
from __future__ import annotations

import torch

BLOCK = 256  # elements per scale
LEVELS = 127  # codes in [-LEVELS, LEVELS]: a block's largest magnitude is +-LEVELS
# a download of a low-comm node's state: the f32 parameters, the momentum's code and its share of a scale
STATE_BYTES_PER_ELEMENT = 4 + 1 + 4 / BLOCK


def blocks(n: int) -> int:
    """The blocks (scales) of a run of `n` elements that starts at a block's first element."""
    return -(-n // BLOCK)


def zeros(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The momentum of `p` at the start: codes shaped as `p`, and its scales."""
    return (torch.zeros(p.shape, dtype=torch.int8, device=p.device),
            torch.zeros(blocks(p.numel()), dtype=torch.float32, device=p.device))


def _split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A flat run's whole blocks as rows, and the shorter block after them (empty when there is none)."""
    full = t.numel() // BLOCK * BLOCK
    return t[:full].view(-1, BLOCK), t[full:]


def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The f32 momentum a run of whole blocks holds (flat)."""
    codes = codes.reshape(-1)
    if scales.numel() != blocks(codes.numel()):
        raise ValueError(f"{scales.numel()} scales for {codes.numel()} codes, not {blocks(codes.numel())}")
    out = codes.to(torch.float32)
    rows, tail = _split(out)
    rows.mul_(scales[:len(rows)].unsqueeze(1))
    if tail.numel():
        tail.mul_(scales[-1])
    return out


def quantize_(values: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """Round the f32 run `values` to 8 bits: into `codes` (as many elements) and `scales`."""
    values, flat_codes = values.reshape(-1), codes.view(-1)
    if flat_codes.numel() != values.numel() or scales.numel() != blocks(values.numel()):
        raise ValueError(f"{flat_codes.numel()} codes and {scales.numel()} scales for {values.numel()} values")
    rows, tail = _split(values)
    code_rows, code_tail = _split(flat_codes)
    if len(rows):
        torch.div(rows.abs().amax(dim=1), LEVELS, out=scales[:len(rows)])
        _round_into(rows, scales[:len(rows)].unsqueeze(1), code_rows)
    if tail.numel():
        torch.div(tail.abs().amax(), LEVELS, out=scales[-1])
        _round_into(tail, scales[-1], code_tail)


def _round_into(values: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block: codes 0, scale 0
    out.copy_(torch.round(values / divisor).clamp_(-LEVELS, LEVELS))
