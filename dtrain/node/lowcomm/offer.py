"""What a node offers a sparse round (node.lowcomm.rounds): the top-k of its pseudo-gradient plus error feedback,
held as the payload it sends."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np
import torch

from dtrain.node.lowcomm import sparse

if TYPE_CHECKING:
    from dtrain.node.lowcomm.rounds import InnerRounds


class SparseOffer(Sequence):
    """A sparse round's offer, held as the payload it sends (node.lowcomm.sparse: positions and 8-bit values, about
    0.06P at top-0.2, where the dense offer held P): the top-k of pseudo-gradient plus error feedback of each tensor,
    quantized over the model's flat order. Iterating decodes it a tensor at a time and gives each tensor dense, with
    the bits the dense offer had."""

    def __init__(self, like: Sequence[torch.Tensor], payload: bytes):
        self._like, self.payload = list(like), payload

    @classmethod
    @torch.no_grad()
    def of(cls, rounds: "InnerRounds") -> "SparseOffer":
        sizes = [p.numel() for p in rounds.params]
        built = sparse.PayloadBuilder(sum(sizes), sparse.max_kept(sizes, rounds.fraction))
        for e, a, q in zip(rounds.feedback, rounds.anchor, rounds.inner_parameters()):
            # one tensor at a time, and one copy of it: its magnitudes for the top-k, then its kept values read
            # again from the same tensors (e + (a - q), the bits the dense sum has)
            e, a, q = (t.reshape(-1) for t in (e, a, q))
            magnitude = a - q
            magnitude.add_(e).abs_()
            idx = sparse.top_k_indices(magnitude, sparse.kept(magnitude.numel(), rounds.fraction))
            del magnitude
            values = e[idx] + (a[idx] - q[idx])
            nonzero = values != 0  # a kept 0 is no position: as quantize_ reads it
            built.add(idx[nonzero].numpy(), values[nonzero].numpy(), e.numel())
        sparse.quantize_([torch.from_numpy(built.values)])  # blocks in the model's flat order, as the dense offer's
        return cls(rounds.params, built.payload(quantized=True))

    def __len__(self) -> int:
        return len(self._like)

    def carried(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Per tensor: the positions within it and the values it carries (what iterating scatters into zeros)."""
        return sparse.decode_tensors(self.payload, [t.numel() for t in self._like], quantized=True)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for like, (local, values) in zip(self._like, self.carried()):
            out = torch.zeros(like.numel(), dtype=torch.float32)
            out[torch.from_numpy(local)] = torch.from_numpy(values)
            yield out.view_as(like)

    def __getitem__(self, i: int) -> torch.Tensor:
        for j, tensor in enumerate(self):
            if j == i:
                return tensor
        raise IndexError(i)
