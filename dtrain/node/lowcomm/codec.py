"""Wire codecs of the pseudo-gradient all-reduce: their names, what hivemind compression each one is, and how many
bytes an element costs on the wire (what the round deadlines are derived from)."""
from __future__ import annotations

from hivemind.compression import CompressionBase, Float16Compression, NoCompression


class UnknownCodec(ValueError):
    """A wire codec name that is not one of CODECS."""


# name -> (bytes per element on the wire, hivemind compression factory)
CODECS = {
    "fp32": (4.0, NoCompression),
    "fp16": (2.0, Float16Compression),
}
# No 8-bit codec: hivemind's (Uniform8BitQuantization) clips at 6 standard deviations of a part, which a
# pseudo-gradient's heavy tails exceed, and is built on torch's quantized tensors, which torch deprecates.
PARAMS_BYTES = 4.0  # parameters are averaged after each outer round uncompressed: equal steps mean equal bytes


def check(name: str) -> str:
    if name not in CODECS:
        raise UnknownCodec(f"wire codec must be one of {sorted(CODECS)}, got {name!r}")
    return name


def compression(name: str) -> CompressionBase:
    return CODECS[check(name)][1]()


def bytes_per_element(name: str) -> float:
    return CODECS[check(name)][0]


def allreduce_bytes(elements: int, peers: int, bytes_per_value: float) -> float:
    """Bytes one peer sends (and as many it receives) in one butterfly all-reduce of `elements` values among
    `peers`: it sends every other reducer its part and returns every sender the average of its own part."""
    if peers <= 1:
        return 0.0
    return 2.0 * elements * bytes_per_value * (peers - 1) / peers
