"""examples/pngplot.py: the PNG bytes decode, by the format's own rules, to the pixels drawn; the glyphs and the
plot land where they are drawn. And examples/train_corpus.py's flags."""
from __future__ import annotations

import importlib.util
import struct
import sys
import zlib

import numpy as np
import pytest

from tests.nodeproc import REPO

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def _example(name: str):
    if name not in sys.modules:  # dataclasses look their module up there
        spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def decode_png(data: bytes) -> np.ndarray:
    """An 8-bit RGB, non-interlaced PNG's pixels; every chunk's CRC checked, every row's filter must be 0."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack_from(">I", data, pos)
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack_from(">I", data, pos + 8 + length)
        assert crc == zlib.crc32(kind + body), kind
        chunks.append((kind, body))
        pos += 12 + length
    assert [k for k, _ in chunks][0] == b"IHDR" and chunks[-1] == (b"IEND", b"")
    w, h, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, colour, interlace) == (8, 2, 0)
    raw = np.frombuffer(zlib.decompress(b"".join(b for k, b in chunks if k == b"IDAT")), np.uint8)
    rows = raw.reshape(h, 1 + 3 * w)
    assert not rows[:, 0].any()
    return rows[:, 1:].reshape(h, w, 3)


def test_png_bytes_decode_to_the_pixels():
    pngplot = _example("pngplot")
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (5, 7, 3), dtype=np.uint8)
    assert np.array_equal(decode_png(pngplot.encode_png(img)), img)
    with pytest.raises(ValueError):
        pngplot.encode_png(img.astype(np.float32))


def test_glyphs_and_plot(tmp_path):
    pngplot = _example("pngplot")
    one = pngplot.text_mask("1")
    assert one.shape == (7, 6) and one[:, 2].all() and one[6, 1:4].all() and not one[:, 5].any()
    assert np.array_equal(pngplot.text_mask("Ab"), pngplot.text_mask("ab"))
    with pytest.raises(ValueError, match="no glyph"):
        pngplot.text_mask("ß")
    path = tmp_path / "plot.png"
    img = pngplot.line_plot(path, [("1 node", [0, 10], [3.0, 1.0]), ("3 nodes", [0, 10], [2.5, 2.0])],
                            x_label="samples", y_label="loss", size=(300, 200))
    assert img.shape == (200, 300, 3)
    assert np.array_equal(decode_png(path.read_bytes()), img)
    for colour in pngplot.COLORS[:2]:  # both lines drawn, each with its legend entry
        assert (img == colour).all(axis=2).sum() > 100
    # the first line starts at (x 0, y 3): the plot's bottom left is (0, 1), its top (3), so that point is the
    # axes' top left corner
    assert (img[30 - 2:30 + 3, 70 - 2:70 + 3] == pngplot.COLORS[0]).all(axis=2).any()


def test_train_corpus_flags():
    train_corpus = _example("train_corpus")
    args = train_corpus.parse_args(["--nodes", "1,3", "--samples", "800"])
    assert args.node_counts == [1, 3] and args.samples == 800
    for bad in (["--nodes", "0"], ["--nodes", "one"], ["--held-out-fraction", "0.9"]):
        with pytest.raises(SystemExit):
            train_corpus.parse_args(bad)
