"""Wire codecs of the pseudo-gradient all-reduce: their names, what hivemind compression each one is, how many
bytes an element costs on the wire (what the round deadlines are sized for: `round_sizes`), and how the swarm's
gradient rounds average with each (`averaging`)."""
from __future__ import annotations

from functools import partial

from hivemind.compression import CompressionBase, Float16Compression, NoCompression

from dtrain.node.config import SwarmConfig
from dtrain.node.lowcomm import sparse
from dtrain.node.lowcomm.gather import SparseGatherAverager
from dtrain.node.swarm.commit import CommittingGradientAverager
from dtrain.node.swarm.deadlines import DEADLINE_PEERS, RoundSizes, allreduce_bytes
from dtrain.node.swarm.swarm import Averaging


class UnknownCodec(ValueError):
    """A wire codec name that is not one of CODECS."""


# name -> (bytes per element on the wire, hivemind compression factory) of the dense all-reduce codecs; "sparse"
# gathers top-k payloads instead (node.lowcomm.sparse, node.lowcomm.gather), and its bytes depend on the fraction
CODECS = {
    "fp32": (4.0, NoCompression),
    "fp16": (2.0, Float16Compression),
    "sparse": (None, NoCompression),
}
# No 8-bit codec: hivemind's (Uniform8BitQuantization) clips at 6 standard deviations of a part, which a
# pseudo-gradient's heavy tails exceed, and is built on torch's quantized tensors, which torch deprecates.
PARAMS_BYTES = 4.0  # dense codecs: parameters are averaged after each outer round uncompressed (equal bytes)
NEVER = 2 ** 31 - 1  # average_state_every that never comes: the sparse codec's outer steps agree to the bit
# a failed outer round makes no update while others train: its members carry their pseudo-gradients into the next
# (node.swarm.optimizer.SwarmOptimizer._no_round_alone); the third failure in a row at one epoch updates alone
FAILED_ROUNDS_CARRIED = 2


def check(name: str) -> str:
    if name not in CODECS:
        raise UnknownCodec(f"wire codec must be one of {sorted(CODECS)}, got {name!r}")
    return name


def compression(name: str) -> CompressionBase:
    return CODECS[check(name)][1]()


def bytes_per_element(name: str, fraction: float = 1.0) -> float:
    """Bytes per model element one peer sends in a round: a dense part, or its sparse payload of `fraction`."""
    if check(name) == "sparse":
        return sparse.bytes_per_element(fraction)
    return CODECS[name][0]


def round_bytes(name: str, elements: int, peers: int, fraction: float = 1.0) -> float:
    """Bytes one peer sends in one outer round among `peers`: the pseudo-gradient's exchange, then (dense codecs)
    the parameters' averaging. In the sparse exchange every member sends its payload to every other member (the
    hub of a group with client-mode members forwards theirs too: node.lowcomm.gather)."""
    if peers <= 1:
        return 0.0
    if check(name) == "sparse":
        return elements * sparse.bytes_per_element(fraction) * (peers - 1)
    return allreduce_bytes(elements, peers, CODECS[name][0]) + allreduce_bytes(elements, peers, PARAMS_BYTES)


def round_sizes(swarm: SwarmConfig, elements: int) -> RoundSizes:
    """The bytes a low-comm round's deadline is sized for, and what a round's exchange moved (node.swarm.deadlines)."""
    if swarm.wire_codec == "sparse":  # every member sends its payload to every other member
        def sparse_bytes(peers: int) -> float:
            return round_bytes("sparse", elements, peers, swarm.topk_fraction)
        return RoundSizes(sparse_bytes(DEADLINE_PEERS), sparse_bytes,
                          f"top-{swarm.topk_fraction:g} sparse payloads with error feedback")
    per_value = bytes_per_element(swarm.wire_codec)
    return RoundSizes(elements * max(per_value, PARAMS_BYTES),
                      lambda peers: allreduce_bytes(elements, peers, per_value), swarm.wire_codec)


def averaging(swarm: SwarmConfig) -> Averaging:
    """How a low-comm swarm's rounds average: the pseudo-gradient in `swarm.wire_codec`, the outer Nesterov step,
    and only the parameters averaged after it (the outer momentum is each node's own, built from the same averaged
    pseudo-gradients); with the sparse codec every member computes the same average from the same payloads
    (node.lowcomm.gather), so the outer step gives the same bits everywhere and no parameter averaging follows."""
    if check(swarm.wire_codec) == "sparse":
        return Averaging(partial(SparseGatherAverager, fraction=swarm.topk_fraction),
                         dict(grad_compression=compression("sparse"), average_opt_statistics=(),
                              average_state_every=NEVER), failed_rounds_carried=FAILED_ROUNDS_CARRIED)
    return Averaging(CommittingGradientAverager,
                     dict(grad_compression=compression(swarm.wire_codec), average_opt_statistics=()),
                     failed_rounds_carried=FAILED_ROUNDS_CARRIED)
