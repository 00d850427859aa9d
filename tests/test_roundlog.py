"""The sparse swarm's round log (node.lowcomm.roundlog): what a node keeps, the wire format and its checks, the
answer over a real libp2p stream, and a replay that gives the same bits as the updates it replays."""
from __future__ import annotations

import os

import pytest
import torch

from dtrain.node.lowcomm import record, roundlog, sparse
from dtrain.node.lowcomm.outer import OuterNesterov

pytestmark = pytest.mark.unit

TOTAL = 1000


def payload(seed: int, count: int = 30, total: int = TOTAL) -> bytes:
    """A member's payload as a node sends it: top-k values, 8-bit."""
    g = torch.Generator().manual_seed(seed)
    flat = torch.zeros(total)
    flat[torch.randperm(total, generator=g)[:count]] = torch.randn(count, generator=g)
    return sparse.encode(sparse.quantize([flat])[0], quantized=True)


def entry(seed: int, members: int = 2, count: int = 30, total: int = TOTAL) -> bytes:
    """The record of a round of `members`, as the log keeps it."""
    return record.encode([(float(8 * (m + 1)), payload(10 * seed + m, count, total)) for m in range(members)])


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
    rounds = [(5, entry(5)), (6, entry(6, members=3)), (7, entry(7, members=1))]
    data = roundlog.frame(rounds)
    decoded = roundlog.unframe(data, 4, 3, TOTAL, 100)
    assert [r.epoch for r in decoded] == [5, 6, 7]
    for (_, raw), r in zip(rounds, decoded):
        assert r.record == raw and r.members == record.parse(raw, TOTAL, 100)
    assert roundlog.unframe(b"", 4, 3, TOTAL, 100) == []  # a peer that holds none of them

    bad = {
        "another epoch first": (roundlog.frame(rounds), 3, 3),
        "more rounds than asked": (roundlog.frame(rounds), 4, 2),
        "a gap": (roundlog.frame([rounds[0], rounds[2]]), 4, 3),
        "truncated header": (data[:-len(rounds[2][1]) - 3], 4, 3),
        "truncated payload": (data[:-1], 4, 3),
        "too many elements": (roundlog.frame(rounds), 4, 3, 29),
        "not a record": (roundlog.FRAME.pack(5, 8) + b"XXXXXXXX", 4, 1),
    }
    for what, (raw, after, count, *limit) in bad.items():
        with pytest.raises(roundlog.BadRoundLog):
            roundlog.unframe(raw, after, count, TOTAL, limit[0] if limit else 100)
            pytest.fail(what)


def test_an_answer_is_bounded_by_records_of_the_largest_group_of_top_k_members():
    sizes = [600, 400]
    assert roundlog.member_limit(sizes, 0.01) == 6 + 4  # at least one element of every tensor
    limit = roundlog.member_limit(sizes, 0.2)
    one = record.max_bytes(record.MAX_MEMBERS, 1000, limit)
    assert roundlog.max_answer_bytes(3, 1000, limit) == 3 * (roundlog.FRAME.size + one)
    assert one == 4 + record.MAX_MEMBERS * (12 + sparse.payload_bytes(limit, 1000, quantized=True))


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
        members = [(w, payload(10 * epoch + m)) for m, w in enumerate([8.0, 8.0, 16.0])]
        # the swarm's update: each member's average of the payloads in .grad (node.lowcomm.gather), one outer step
        sparse.average_into((sparse.decode(p, TOTAL, 100, quantized=True) for _, p in members),
                            [w for w, _ in members], [p.grad for p in live])
        live_opt.step()
        rounds.append((epoch, record.encode(members)))
    roundlog.replay(again, again_opt, roundlog.unframe(roundlog.frame(rounds), 0, 4, TOTAL, 100), 100)
    for a, b in zip(live, again):
        assert torch.equal(a, b)
        for key in ("momentum_codes", "momentum_scales"):
            assert torch.equal(live_opt.state[a][key], again_opt.state[b][key])
    assert again_opt.passthrough


def test_a_node_replays_only_while_the_rounds_cost_less_than_the_state():
    # three peers at top-20%: a round's record is their three payloads, 8-bit values and a bitmask each
    per_round = record.bytes_per_element(3, 0.2)
    assert per_round == pytest.approx(3 * (1 / 8 + 0.2 * (1 + 1 / 64)))
    # the state: f32 parameters and the momentum's 8-bit codes and scales, 5.02 bytes per parameter
    assert roundlog.STATE_BYTES_PER_ELEMENT == 4 + 1 + 4 / 256
    assert 5 * per_round < roundlog.STATE_BYTES_PER_ELEMENT <= 6 * per_round


def test_an_answer_may_take_what_its_rounds_need_at_the_link():
    gpt2_small = 124_046_592
    three = roundlog.fetch_timeout(3, 2, 0.2, gpt2_small, link_mbit=20.0)
    # 81 MB a round (two members' top-20% payloads: 1/8 + 0.2 x (1 + 1/64) bytes per element each) at 20 Mbit/s, x3
    assert three.seconds == pytest.approx(3 * 3 * 2 * 0.328125 * gpt2_small * 8 / 20e6)
    assert roundlog.fetch_timeout(6, 2, 0.2, gpt2_small, 20.0).seconds == pytest.approx(2 * three.seconds)
    assert roundlog.fetch_timeout(1, 2, 0.2, gpt2_small, 20.0).seconds == roundlog.FETCH_TIMEOUT_S  # the floor
    assert roundlog.fetch_timeout(1, 2, 0.2, gpt2_small, 0.0).seconds == roundlog.FETCH_TIMEOUT_S  # no rate known


def test_a_replay_asks_a_log_only_for_the_rounds_it_did_not_collect():
    # rounds collected while the node downloaded fill the replay; only the runs between them are asked for, each as
    # (after, count)
    assert roundlog.missing(3, 7, []) == [(3, 4)]
    assert roundlog.missing(3, 7, [4, 5, 6, 7, 8]) == []  # later ones wait for the next replay
    assert roundlog.missing(3, 7, [6, 7]) == [(3, 2)]  # collected from the swarm's epoch after the download began
    assert roundlog.missing(3, 7, [5]) == [(3, 1), (5, 2)]
    assert roundlog.missing(3, 7, [1, 2, 4, 7]) == [(4, 2)]
    assert roundlog.missing(5, 5, [6]) == []
