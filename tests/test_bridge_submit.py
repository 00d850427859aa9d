"""Training API v1 conformance over real HTTP, packet submission: POST /api/v1/train/submit's answers (200, every
malformed packet's 400, 409 outside the step window, 411, 413), a large packet sent in pieces, and then the losses
and status the accepted packets' updates report.

One node of test_bridge_http.py's kind (its fixtures: --no-data, min_nodes_for_update 1, target batch 1: each
accepted packet is one update) serves the whole module; the model's routes, CORS and framing are tested there.
"""
from __future__ import annotations

import http.client
import struct
import time

import numpy as np
import pytest

from dtrain.bridge import dgrd
from dtrain.bridge.training_routes import INLINE_INGEST_BYTES
from dtrain.node.device import resolve, threads_now
from tests import test_bridge_http as conformance
from tests.test_bridge_http import (SUBMIT, Answer, _headers_only, assert_error, assert_plain_response, current_step,
                                    small_packet, submit, wait_step)

pytestmark = [pytest.mark.http, pytest.mark.timeout(240)]

# test_bridge_http.py's module fixtures, bound here so that this module starts a node of that kind of its own
train_config_file, node = conformance.train_config_file, conformance.node
manifest, elements = conformance.manifest, conformance.elements


# ---------------------------------------------------------------------------------------------
# submissions


def test_submit_200_body(node):
    step = current_step(node)
    a = submit(node, small_packet(step))
    assert a.status == 200
    assert_plain_response(a)
    assert a.headers["Content-Type"].startswith("application/json")
    assert a.json() == {"ok": True, "message": "ok", "server_step": step}
    wait_step(node, step + 1)  # min_nodes_for_update 1, target batch 1: one update per packet


def _patched(data: bytes, offset: int, fmt: str, value) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


def _malformed(step: int, elements) -> dict[str, tuple[bytes, str]]:
    """name -> (packet, a word its 400 message must hold); one per case of NOTES.md."""
    nid = b"conformance"
    tail = 16 + len(nid)  # offset of train_loss
    first = tail + 12  # offset of the first section
    good = small_packet(step)
    dense = dgrd.encode(step, "conformance", 1.0, 1, [(3, None, np.ones(elements[3], np.float32))])
    mode2 = dgrd.encode(step, "conformance", 1.0, 1, [(1, np.array([0, 1]), np.ones(2, np.float32))], flags=1)
    assert elements[2] <= 255  # a layer norm: one u8 skip reaches past its end
    small2 = dgrd.encode(step, "conformance", 1.0, 1, [(2, np.array([0]), np.ones(1, np.float32))], flags=1)

    def header(id_len, node_id):
        return struct.pack("<4sHHII", b"DGRD", 1, 0, step, id_len) + node_id + struct.pack("<fII", 1.0, 1, 0)

    return {
        "magic": (b"DGRX" + good[4:], "magic"),
        "version": (_patched(good, 4, "<H", 2), "version"),
        "flags": (_patched(good, 6, "<H", 2), "flags"),
        "truncated": (good[:-3], "truncated"),
        "truncated header": (good[:10], "truncated"),
        "empty": (b"", "truncated"),
        "truncated dense": (dense[:-2], "truncated"),
        "trailing": (good + b"\x00", "trailing"),
        "unknown tensor": (_patched(good, first, "<I", len(elements)), "unknown tensor"),
        "index mode 1": (_patched(good, first + 8, "<I", elements[1]), "index"),
        "index mode 2": (_patched(small2, first + 8, "<B", elements[2]), "index"),
        "twice": (dgrd.encode(step, "conformance", 1.0, 1, [(1, np.array([0]), np.ones(1)),
                                                           (1, np.array([1]), np.ones(1))]), "twice"),
        "samples 0": (_patched(good, tail + 4, "<I", 0), "samples"),
        "nan value": (_patched(good, first + 12, "<f", float("nan")), "not finite"),
        "inf value": (_patched(good, first + 12, "<f", float("inf")), "not finite"),
        "inf f16 value": (_patched(mode2, first + 9, "<e", float("inf")), "not finite"),
        "nan dense": (_patched(dense, first + 8, "<e", float("nan")), "not finite"),
        "nan loss": (_patched(good, tail, "<f", float("nan")), "train_loss"),
        "inf loss": (_patched(good, tail, "<f", float("-inf")), "train_loss"),
        "node_id empty": (header(0, b""), "node_id"),
        "node_id long": (header(257, b"x" * 257), "node_id"),
        "node_id utf8": (header(2, b"\xff\xfe"), "UTF-8"),
    }


def test_submit_400_every_malformed_case(node, elements):
    step = current_step(node)
    cases = _malformed(step, elements)
    # a malformed packet is 400 whatever its step: only well-formed packets are judged against the window
    cases["malformed and stale"] = (_patched(cases["twice"][0], 8, "<I", step + 100), "twice")
    for name, (packet, word) in cases.items():
        body = assert_error(submit(node, packet), 400, word)
        assert body["server_step"] == step, name
    assert current_step(node) == step


def _send_in_pieces(node, packet: bytes, pieces: int = 10, pause_s: float = 0.05) -> Answer:
    """POST `packet` a piece at a time, pausing between pieces: the node reads the first while the rest has not
    been sent."""
    conn = http.client.HTTPConnection("127.0.0.1", node.port, timeout=30)
    try:
        conn.putrequest("POST", SUBMIT)
        conn.putheader("Content-Type", "application/octet-stream")
        conn.putheader("Content-Length", str(len(packet)))
        conn.endheaders()
        size = -(-len(packet) // pieces)
        for start in range(0, len(packet), size):
            conn.send(packet[start:start + size])
            time.sleep(pause_s)
        resp = conn.getresponse()
        return Answer(resp, resp.read())
    finally:
        conn.close()


def test_submit_a_large_packet_sent_in_pieces(node, elements):
    """A Mode 2 body of several MB (a huge-page body buffer, decoded on the executor) sent in pieces with pauses
    between them: a value that is not finite two thirds in is named as decode names it, and nothing is applied;
    without it the packet is accepted and makes one update."""
    step = current_step(node)
    rng = np.random.default_rng(3)
    idx = np.sort(rng.choice(elements[0], elements[0] * 9 // 10, replace=False))
    good = dgrd.encode(step, "large", 1.0, 1, [(1, np.array([0, 3]), np.ones(2)),
                                               (0, idx, rng.standard_normal(idx.size))], dgrd.FLAGS_MODE2)
    assert len(good) > INLINE_INGEST_BYTES  # the other packets of this module are decoded on the event loop
    bad = bytearray(good)
    # every exponent bit of an entry's value: the sparse bodies start at byte 1 mod 3 (33 + 8 + 6 + 8 = 55), so the
    # bytes at 0 mod 3 are the values' high bytes
    bad[len(good) * 2 // 3 // 3 * 3] |= 0x7C
    with pytest.raises(dgrd.PacketError) as expected:
        dgrd.decode(bytes(bad), elements)
    assert "not finite" in str(expected.value)
    body = assert_error(_send_in_pieces(node, bytes(bad)), 400, str(expected.value))
    assert body["server_step"] == step and current_step(node) == step
    a = _send_in_pieces(node, good)
    assert a.status == 200 and a.json()["server_step"] == step
    wait_step(node, step + 1)


def test_submit_409_stale_and_future(node):
    # drive the node to step >= 7 so that step - 6 is a valid u32
    while (step := current_step(node)) < 7:
        assert submit(node, small_packet(step)).status == 200
        wait_step(node, step + 1)
    for bad in (step - 6, step + 1, step + 1000, 0):
        body = assert_error(submit(node, small_packet(bad)), 409, "step mismatch")
        assert body["server_step"] == step
    assert current_step(node) == step
    # the edge of the late window is still accepted
    a = submit(node, small_packet(step - 5))
    assert a.status == 200 and a.json()["server_step"] == step
    wait_step(node, step + 1)


def test_submit_411_without_content_length(node):
    conn = http.client.HTTPConnection("127.0.0.1", node.port, timeout=30)
    try:
        conn.request("POST", SUBMIT, body=iter([small_packet(1)]), encode_chunked=True,
                     headers={"Content-Type": "application/octet-stream", "Transfer-Encoding": "chunked"})
        resp = conn.getresponse()
        a = Answer(resp, resp.read())
    finally:
        conn.close()
    assert_error(a, 411, "Content-Length")


def test_submit_413_above_max_packet_bytes(node, elements):
    limit = dgrd.max_packet_bytes(elements)
    for length in (limit + 1, 10**12):
        assert_error(_headers_only(node, length), 413, str(length))


def test_submit_at_max_packet_bytes_is_not_413(node, elements):
    limit = dgrd.max_packet_bytes(elements)
    step = current_step(node)
    body = assert_error(submit(node, b"\x00" * limit), 400, "magic")
    assert body["server_step"] == step


# ---------------------------------------------------------------------------------------------
# losses and status, once the packets above made updates


def test_losses_and_status(node):
    info = node.get_json("/api/v1/model/info")
    losses = node.get_json("/api/v1/server/losses")
    assert isinstance(losses, list) and all(isinstance(x, float) for x in losses)
    assert len(losses) == info["updates"]
    status = node.get_json("/api/v1/swarm/status")
    assert status["step"] == info["step"] and status["updates"] == info["updates"]
    # an open swarm (no --swarm-key), in low-communication rounds with the sparse codec (the defaults): what the
    # dashboard tells its operator
    assert (status["closed"], status["sync"], status["wire_codec"]) == (False, "low-comm", "sparse")
    # where it computes: --device auto, the CPU on a machine without CUDA
    assert status["device"] == resolve("auto").as_dict()
    assert status["torch_threads"] == threads_now()  # no --torch-threads: torch's default, one per core

