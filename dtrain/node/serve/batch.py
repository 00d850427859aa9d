"""The KV cache of a running decode batch: rows that joined at different times, right-aligned in one cache.

Continuous batching needs one forward per decode step for every running sequence, whatever its length. Rows are
kept right-aligned: column L-1 is every row's newest position, and a row shorter than the batch is padded on
the left with zero keys/values that the attention mask hides. Each row passes its own position ids, so padding
never shifts a row's positions: a row's logits equal those of the same sequence decoded alone (tested).

    columns:   0   1   2   3   4   5
    row 0:     .   .   a0  a1  a2  a3     (mask 0 0 1 1 1 1)
    row 1:     b0  b1  b2  b3  b4  b5     (mask 1 1 1 1 1 1)

A joining row (its prefill cache, all real) is padded on the left to the batch's length, or the batch to its
length; a leaving row is dropped, and columns that are padding in every remaining row are trimmed. So the
batch's length is always its longest row's, never more than the model's positions.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch.nn import functional as F
from transformers import DynamicCache


def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]  # each (B, heads, L, head_dim)


def _pad_left(t: torch.Tensor, columns: int) -> torch.Tensor:
    return F.pad(t, (0, 0, columns, 0)) if columns else t


class KVBatch:
    def __init__(self):
        self.cache: Optional[DynamicCache] = None
        self.mask: Optional[torch.Tensor] = None  # (B, L) long: 1 for a real position, 0 for left padding

    def __len__(self) -> int:
        return 0 if self.mask is None else int(self.mask.shape[0])

    @property
    def length(self) -> int:
        return 0 if self.mask is None else int(self.mask.shape[1])

    def add(self, cache: DynamicCache, rows: int) -> None:
        """Append `rows` rows whose prefill cache `cache` holds (all positions real, the same length)."""
        new = _layers(cache)
        T = int(new[0][0].shape[2])
        assert new[0][0].shape[0] == rows, (new[0][0].shape, rows)
        new_mask = torch.ones(rows, T, dtype=torch.long, device=new[0][0].device)  # on the cache's device
        if self.cache is None:
            self.cache, self.mask = cache, new_mask
            return
        L = self.length
        width = max(L, T)
        merged = [(torch.cat([_pad_left(k, width - L), _pad_left(nk, width - T)]),
                   torch.cat([_pad_left(v, width - L), _pad_left(nv, width - T)]))
                  for (k, v), (nk, nv) in zip(_layers(self.cache), new)]
        self.cache = DynamicCache(ddp_cache_data=merged)
        self.mask = torch.cat([F.pad(self.mask, (width - L, 0)), F.pad(new_mask, (width - T, 0))])

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only `rows` (indices in the current order, in that order); trim all-padding columns."""
        if not rows:
            self.cache = self.mask = None
            return
        index = torch.tensor(list(rows), dtype=torch.long, device=self.mask.device)
        mask = self.mask.index_select(0, index)
        first = int(mask.any(dim=0).nonzero()[0])  # columns before it are padding in every kept row
        self.mask = mask[:, first:]
        self.cache = DynamicCache(ddp_cache_data=[(k.index_select(0, index)[:, :, first:],
                                                   v.index_select(0, index)[:, :, first:])
                                                  for k, v in _layers(self.cache)])

    def extended_mask(self) -> torch.Tensor:
        """The attention mask of the next decode step: every row gets one more real position."""
        return torch.cat([self.mask, torch.ones(len(self), 1, dtype=torch.long, device=self.mask.device)], dim=1)
