"""A peer's state read from hivemind's download stream into the node's tensors as it arrives (node.swarm.download):
the messages here are made exactly as a donor's `rpc_download_state` makes them (hivemind's serializer, codec and
chunking), and every check refuses the peer before a number of it is written where it must not be."""
from __future__ import annotations

import asyncio
import math

import pytest
import torch
from hivemind.compression import NoCompression
from hivemind.optim.state_averager import dump_optimizer_state
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import split_for_streaming

from dtrain.node.swarm.download import BadState, Layout, Received, receive_into

pytestmark = pytest.mark.unit

CHUNK_BYTES = 64  # small, so that every tensor comes in several chunks


def node_state(seed: int):
    """Parameters and a stepped AdamW's state: (flat optimizer metadata, the tensors in download order)."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(5, 7, generator=gen)), torch.nn.Parameter(torch.randn(7, generator=gen))]
    opt = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    flat, opt_tensors = dump_optimizer_state(opt)
    return flat, [p.detach() for p in params] + list(opt_tensors)


def stream_of(metadata: dict, tensors, chunk_bytes: int = CHUNK_BYTES) -> list:
    """The messages a donor sends (DecentralizedAverager.rpc_download_state)."""
    messages, packed = [], MSGPackSerializer.dumps(metadata)
    for tensor in tensors:
        for part in split_for_streaming(NoCompression().compress(tensor, None, allow_inplace=False), chunk_bytes):
            if packed is not None:
                messages.append(averaging_pb2.DownloadData(tensor_part=part, metadata=packed))
                packed = None
            else:
                messages.append(averaging_pb2.DownloadData(tensor_part=part))
    return messages


async def _aiter(items):
    for item in items:
        yield item


def receive(messages, layout: Layout, targets, min_epoch: int = 0):
    """Run receive_into on `messages`, writing into `targets`; (metadata or the error, how many were written)."""
    received = Received()

    async def write(index, tensor):
        targets[index].copy_(tensor)

    async def run():
        return await receive_into(_aiter(messages), layout, MSGPackSerializer.loads, min_epoch, write, received,
                                  timeout=5.0)
    try:
        return asyncio.run(run()), received.written
    except BadState as e:
        return e, received.written


@pytest.fixture
def joiner():
    flat, tensors = node_state(seed=1)
    return flat, [t.clone() for t in tensors], Layout.of(flat, tensors)


@pytest.fixture
def donor():
    flat, tensors = node_state(seed=2)
    return dict(epoch=7, group_bits="", optimizer_metadata=flat), tensors


def test_a_whole_state_is_written_into_the_tensors_in_place(joiner, donor):
    _, targets, layout = joiner
    metadata, tensors = donor
    before = [t.data_ptr() for t in targets]
    got, written = receive(stream_of(metadata, tensors), layout, targets)
    assert got == metadata and written == len(tensors) == len(targets)
    assert all(torch.equal(t, d) for t, d in zip(targets, tensors))
    assert [t.data_ptr() for t in targets] == before


def test_a_non_finite_number_fails_the_download_at_its_tensor(joiner, donor):
    _, targets, layout = joiner
    metadata, tensors = donor
    kept = [t.clone() for t in targets]
    bad = [t.clone() for t in tensors]
    bad[3].view(-1)[4] = math.inf  # the first parameter's exp_avg_sq (a state's keys come sorted)
    error, written = receive(stream_of(metadata, bad), layout, targets)
    assert isinstance(error, BadState) and "tensor 3" in str(error) and "finite" in str(error)
    assert written == 3  # the three before it are the peer's now: the caller marks the state torn
    assert all(torch.equal(targets[i], tensors[i]) for i in range(3))
    assert all(torch.equal(targets[i], kept[i]) for i in range(3, len(targets)))


@pytest.mark.parametrize("change, words", [
    (lambda ts: ts.__setitem__(1, torch.zeros(8)), "tensor 1: (8,)"),  # another shape
    (lambda ts: ts.__setitem__(1, ts[1].double()), "torch.float64"),  # another dtype
    (lambda ts: ts.pop(), "tensors, this node's state has"),  # one missing
    (lambda ts: ts.append(torch.zeros(3)), "more than the"),  # one too many
])
def test_a_state_of_another_layout_fails(joiner, donor, change, words):
    _, targets, layout = joiner
    metadata, tensors = donor
    tensors = list(tensors)
    change(tensors)
    error, _ = receive(stream_of(metadata, tensors), layout, targets)
    assert isinstance(error, BadState) and words in str(error), error


def test_a_tensor_larger_than_its_place_is_refused_before_it_is_all_held(joiner, donor):
    _, targets, layout = joiner
    metadata, tensors = donor
    huge = torch.zeros(1 << 20)  # 4 MiB where 140 bytes belong
    messages = stream_of(metadata, [huge, *tensors[1:]], chunk_bytes=1 << 16)
    held = []

    async def counting():
        for m in messages:
            held.append(m)
            yield m
    received = Received()
    with pytest.raises(BadState, match="tensor 0: more than its"):
        asyncio.run(receive_into(counting(), layout, MSGPackSerializer.loads, 0, None, received))
    assert len(held) < 20 and received.written == 0  # about 1 MiB of the 4 were read


@pytest.mark.parametrize("change, words", [
    (lambda m: m.update(epoch=2), "behind"),
    (lambda m: m.update(epoch="7"), "not an integer"),
    (lambda m: m["optimizer_metadata"].pop(), "entries"),
    (lambda m: m["optimizer_metadata"].__setitem__(
        next(i for i, e in enumerate(m["optimizer_metadata"]) if e["type"] == "value"),
        dict(type="value", value=float("nan"))), "not a finite scalar"),
    (lambda m: m["optimizer_metadata"].__setitem__(
        next(i for i, e in enumerate(m["optimizer_metadata"]) if e["type"] == "tensor"),
        dict(type="tensor", index=99)), "this node's is a tensor"),
])
def test_metadata_that_does_not_fit_fails_before_anything_is_written(joiner, donor, change, words):
    _, targets, layout = joiner
    metadata, tensors = donor
    kept = [t.clone() for t in targets]
    change(metadata)
    error, written = receive(stream_of(metadata, tensors), layout, targets, min_epoch=5)
    assert isinstance(error, BadState) and words in str(error), error
    assert written == 0 and all(torch.equal(t, k) for t, k in zip(targets, kept))


def test_a_peer_that_shares_nothing_sends_no_state(joiner):
    _, targets, layout = joiner
    error, written = receive([], layout, targets)
    assert isinstance(error, BadState) and "no state" in str(error) and written == 0
