"""The sparse swarm's round log (node.lowcomm.roundlog): what a node keeps, the wire format and its checks, the
answer over a real libp2p stream, and a replay that gives the same bits as the updates it replays."""
from __future__ import annotations

import os

import pytest
import torch

from dtrain.node.lowcomm import roundlog, sparse
from dtrain.node.lowcomm.outer import OuterNesterov

pytestmark = pytest.mark.unit

TOTAL = 1000


def payload(seed: int, count: int = 30, total: int = TOTAL) -> bytes:
    g = torch.Generator().manual_seed(seed)
    flat = torch.zeros(total)
    flat[torch.randperm(total, generator=g)[:count]] = torch.randn(count, generator=g)
    return sparse.encode(flat)


def test_the_log_keeps_the_last_rounds_and_answers_without_gaps():
    log = roundlog.RoundLog(max_rounds=4)
    for epoch in range(1, 7):
        log.add(epoch, payload(epoch))
    assert len(log) == 4
    assert [e for e, _ in log.after(2, 10)] == [3, 4, 5, 6]  # 1 and 2 are gone: 3.. is what it holds
    assert [e for e, _ in log.after(1, 10)] == []  # round 2 is not held: nothing after 1 without a gap
    assert [e for e, _ in log.after(3, 2)] == [4, 5]
    assert log.after(6, 3) == []
    log.add(9, payload(9))  # a node that skipped rounds 7-8 (a download) keeps on from there
    assert [e for e, _ in log.after(5, 10)] == [6]
    log.add(4, payload(4))  # went back: the log starts again
    assert [e for e, _ in log.after(3, 10)] == [4] and len(log) == 1
    log.clear()
    assert len(log) == 0 and log.after(3, 10) == []


def test_the_log_keeps_its_rounds_in_unlinked_files_and_reads_them_back_exactly():
    log = roundlog.RoundLog()
    data = {epoch: payload(epoch) for epoch in (1, 2)}
    for epoch, d in data.items():
        log.add(epoch, d)
    held = log.after(0, 2)
    for (epoch, entry), expected in zip(held, data.values()):
        st = os.fstat(entry._file.fileno())
        assert st.st_size == len(entry) == len(expected) and st.st_nlink == 0  # on disk, no name left behind
        assert bytes(entry) == expected and entry[5:17] == expected[5:17]
    assert roundlog.frame(held) == roundlog.frame(list(data.items()))  # the answer's bytes, as from memory
    log.clear()
    assert bytes(held[1][1]) == data[2]  # an answer under way keeps reading what the log dropped meanwhile


def test_the_log_keeps_no_more_bytes_of_rounds_than_it_is_given():
    # a replay of more bytes than the state's is never asked for: the log holds the newest rounds within the bound
    size = len(payload(1))
    log = roundlog.RoundLog(max_rounds=16, max_bytes=3 * size)
    for epoch in range(1, 6):
        log.add(epoch, payload(epoch))
    assert [e for e, _ in log.after(2, 10)] == [3, 4, 5] and log.bytes == 3 * size
    log.add(2, payload(2))  # went back: the count starts again too
    assert len(log) == 1 and log.bytes == size


def test_an_answer_goes_out_in_bounded_pieces_that_join_to_the_frame():
    rounds = [(5, payload(5, count=200)), (6, payload(6, count=200))]
    pieces = list(roundlog.frames(rounds, chunk=100))
    assert b"".join(pieces) == roundlog.frame(rounds) and max(map(len, pieces)) == 100


def test_frames_round_trip_and_every_malformed_answer_is_refused():
    rounds = [(5, payload(5)), (6, payload(6)), (7, payload(7))]
    data = roundlog.frame(rounds)
    decoded = roundlog.unframe(data, 4, 3, TOTAL, 100)
    assert [r.epoch for r in decoded] == [5, 6, 7]
    for (_, raw), r in zip(rounds, decoded):
        ref_idx, ref_values = sparse.decode(raw, TOTAL, 100)
        assert torch.equal(r.indices, ref_idx) and torch.equal(r.values, ref_values) and r.payload == raw
    assert roundlog.unframe(b"", 4, 3, TOTAL, 100) == []  # a peer that holds none of them

    bad = {
        "another epoch first": (roundlog.frame(rounds), 3, 3),
        "more rounds than asked": (roundlog.frame(rounds), 4, 2),
        "a gap": (roundlog.frame([rounds[0], rounds[2]]), 4, 3),
        "truncated header": (data[:-len(rounds[2][1]) - 3], 4, 3),
        "truncated payload": (data[:-1], 4, 3),
        "too many elements": (roundlog.frame(rounds), 4, 3, 29),
        "not a payload": (roundlog.FRAME.pack(5, 8) + b"XXXXXXXX", 4, 1),
    }
    for what, (raw, after, count, *limit) in bad.items():
        with pytest.raises(roundlog.BadRoundLog):
            roundlog.unframe(raw, after, count, TOTAL, limit[0] if limit else 100)
            pytest.fail(what)


def test_an_entry_bound_allows_a_groups_average_and_no_more_than_the_model():
    sizes = [600, 400]
    assert roundlog.entry_limit(sizes, 0.01) == roundlog.MAX_GROUP * (6 + 4)
    assert roundlog.entry_limit(sizes, 0.5) == 1000


def test_a_replay_gives_the_bits_of_the_updates_it_replays():
    torch.manual_seed(0)
    shapes = [(20, 30), (400,)]
    live = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    again = [torch.nn.Parameter(p.detach().clone()) for p in live]
    for p in live + again:
        p.grad = torch.zeros_like(p)
    live_opt, again_opt = OuterNesterov(live, lr=0.7, momentum=0.9), OuterNesterov(again, lr=0.7, momentum=0.9)
    again_opt.passthrough = True  # replay never uses the passthrough of a node alone
    rounds = []
    for epoch in range(1, 5):
        payloads = [sparse.decode(payload(10 * epoch + m), TOTAL, 100) for m in range(3)]
        average = sparse.average(payloads, [8.0, 8.0, 16.0], TOTAL)
        offset = 0
        for p in live:  # the swarm's update: the average in .grad, one outer step
            p.grad.copy_(average[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        live_opt.step()
        rounds.append((epoch, sparse.encode(average)))
    roundlog.replay(again, again_opt, roundlog.unframe(roundlog.frame(rounds), 0, 4, TOTAL, TOTAL))
    for a, b in zip(live, again):
        assert torch.equal(a, b)
        assert torch.equal(live_opt.state[a]["momentum_buffer"], again_opt.state[b]["momentum_buffer"])
    assert again_opt.passthrough


def test_a_node_replays_only_while_the_rounds_cost_less_than_the_state():
    # three peers at top-20%: an average marks up to 60% of the model (a bitmask) in f32, 2.525 bytes per element
    per_round = roundlog.replay_bytes_per_element(3, 0.2)
    assert per_round == pytest.approx(1 / 8 + 4 * 0.6)
    assert 3 * per_round < roundlog.STATE_BYTES_PER_ELEMENT <= 4 * per_round
    assert roundlog.replay_bytes_per_element(10, 0.2) == pytest.approx(1 / 8 + 4.0)  # never more than dense


def test_an_answer_may_take_what_its_rounds_need_at_the_link():
    gpt2_small = 124_046_592
    one_round = roundlog.fetch_timeout(1, 2, 0.2, gpt2_small, link_mbit=20.0)
    # 214 MB (two members' top-20% union: 1/8 + 4 x 0.4 bytes per element) at 20 Mbit/s, x3
    assert one_round.seconds == pytest.approx(3 * 1.725 * gpt2_small * 8 / 20e6)
    assert roundlog.fetch_timeout(2, 2, 0.2, gpt2_small, 20.0).seconds == pytest.approx(2 * one_round.seconds)
    assert roundlog.fetch_timeout(1, 2, 0.2, 1_600_000, 20.0).seconds == roundlog.FETCH_TIMEOUT_S  # the floor
    assert roundlog.fetch_timeout(1, 2, 0.2, gpt2_small, 0.0).seconds == roundlog.FETCH_TIMEOUT_S  # no rate known
