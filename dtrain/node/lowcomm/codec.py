"""Wire codecs of the pseudo-gradient all-reduce: their names, what hivemind compression each one is, and how many
bytes an element costs on the wire (what the round deadlines are derived from)."""
from __future__ import annotations

from hivemind.compression import CompressionBase, Float16Compression, NoCompression

from dtrain.node.lowcomm import sparse


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


def allreduce_bytes(elements: int, peers: int, bytes_per_value: float) -> float:
    """Bytes one peer sends (and as many it receives) in one butterfly all-reduce of `elements` values among
    `peers`: it sends every other reducer its part and returns every sender the average of its own part."""
    if peers <= 1:
        return 0.0
    return 2.0 * elements * bytes_per_value * (peers - 1) / peers
