"""The serving engine on the tiny model: the batch's KV cache (rows joining and leaving) gives each row the logits
it has alone, continuous batching gives the tokens transformers' own `generate` gives each prompt alone, seeds
reproduce, the queue is bounded, and a new step is served only after the running rows drained."""
from __future__ import annotations

import threading

import pytest
import torch
from transformers import DynamicCache

from dtrain.node.config import DEFAULT_STATIC_DIR, ModelConfig
from dtrain.node.model import build_model
from dtrain.node.serve.batch import KVBatch
from dtrain.node.serve.config import ServeConfig
from dtrain.node.serve.engine import Delta, Done, Finish, Generation, QueueFullError, ServeEngine
from dtrain.node.serve.sampling import SamplingParams
from dtrain.node.serve.weights import FixedWeights, ServedWeights
from dtrain.node.tokenizer import load_tokenizer
from tests.nodeproc import TINY_CONFIG

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

PROMPTS = ["To be, or not to be", "Hello", "The quick brown fox jumps over the lazy dog and", "1 2 3",
           "Once upon a time there", "A"]


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig.load(TINY_CONFIG))


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DEFAULT_STATIC_DIR)


def _engine(weights, tok, **config) -> ServeEngine:
    engine = ServeEngine(weights, lambda ids: tok.decode(list(ids)), ServeConfig(**config), eos_token_id=50256)
    engine.start()
    return engine


def _greedy_reference(model, ids: list[int], n_new: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n_new, do_sample=False, pad_token_id=50256)
    generated = out[0, len(ids):].tolist()
    return generated[:generated.index(50256)] if 50256 in generated else generated


def _logits(model, hidden):
    return model.get_output_embeddings()(hidden)


def test_batched_rows_get_the_logits_each_gets_alone(model):
    seqs = [[464, 2068, 7586, 21831], [15496], [16, 362, 513, 604, 642, 718, 767]]
    steps = 5
    alone = []  # per sequence: logits of each decode step, with its own cache
    for s in seqs:
        cache = DynamicCache()
        with torch.no_grad():
            h = model.transformer(input_ids=torch.tensor([s]), past_key_values=cache, use_cache=True).last_hidden_state
            feed, got = int(_logits(model, h[0, -1]).argmax()), []
            for i in range(steps):
                h = model.transformer(input_ids=torch.tensor([[feed]]), past_key_values=cache,
                                      use_cache=True).last_hidden_state
                got.append(_logits(model, h[0, -1]))
                feed = int(got[-1].argmax())
        alone.append(got)

    batch, rows = KVBatch(), []  # rows: [sequence index, next token, next position, decode step]

    def join(i):
        cache = DynamicCache()
        with torch.no_grad():
            h = model.transformer(input_ids=torch.tensor([seqs[i]]), past_key_values=cache, use_cache=True).last_hidden_state
        batch.add(cache, 1)
        rows.append([i, int(_logits(model, h[0, -1]).argmax()), len(seqs[i]), 0])

    join(0)
    for tick in range(12):
        if tick == 1:
            join(2)  # longer than the batch: the batch is padded
        if tick == 3:
            join(1)  # shorter: it is padded
        mask = batch.extended_mask()
        with torch.no_grad():
            h = model.transformer(input_ids=torch.tensor([[r[1]] for r in rows]),
                                  position_ids=torch.tensor([[r[2]] for r in rows]), attention_mask=mask,
                                  past_key_values=batch.cache, use_cache=True).last_hidden_state
        batch.mask = mask
        for r, logits in zip(rows, _logits(model, h[:, -1])):
            torch.testing.assert_close(logits, alone[r[0]][r[3]], rtol=1e-4, atol=1e-4)
            r[1], r[2], r[3] = int(logits.argmax()), r[2] + 1, r[3] + 1
        keep = [k for k, r in enumerate(rows) if r[3] < steps]
        if len(keep) < len(rows):
            batch.keep(keep)
            rows[:] = [rows[k] for k in keep]
            assert batch.length == max(len(seqs[r[0]]) + r[3] for r in rows) if rows else batch.length == 0
        if not rows:
            break
    assert not rows and len(batch) == 0


def test_continuous_batching_writes_what_generate_writes_alone(model, tok):
    engine = _engine(FixedWeights(model, step=7), tok, max_batch=8)
    try:
        tickets, running = [], threading.Event()
        for i, prompt in enumerate(PROMPTS):
            if i == 2:
                assert running.wait(60)  # the rest join a batch that is decoding
            ids = tuple(tok.encode(prompt).ids)
            tickets.append(engine.submit(Generation(ids, SamplingParams(max_tokens=30 - 4 * i, temperature=0.0)),
                                         lambda e: running.set() if isinstance(e, Delta) else None))
        for t in tickets:
            assert t.done.wait(60)
        for prompt, t in zip(PROMPTS, tickets):
            ids = tok.encode(prompt).ids
            assert t.token_ids[0] == _greedy_reference(model, ids, t.generation.params.max_tokens), prompt
            assert t.step == 7 and t.finish_reasons == ["length"]
            assert t.texts[0] == tok.decode(t.token_ids[0])
    finally:
        engine.stop()


def test_seeds_reproduce_and_choices_differ(model, tok):
    engine = _engine(FixedWeights(model), tok)
    try:
        params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=11)
        ids = tuple(tok.encode("Once upon a time").ids)
        a = engine.submit(Generation(ids, params, n=3), lambda e: None)
        b = engine.submit(Generation(ids, params, n=3), lambda e: None)
        assert a.done.wait(60) and b.done.wait(60)
        assert a.token_ids == b.token_ids  # same seed, same weights: same choices
        assert len({tuple(t) for t in a.token_ids}) == 3  # choice i draws with seed + i
    finally:
        engine.stop()


def test_events_carry_the_text_and_end_with_done(model, tok):
    engine = _engine(FixedWeights(model), tok)
    events = []
    try:
        ids = tuple(tok.encode("Hello").ids)
        t = engine.submit(Generation(ids, SamplingParams(max_tokens=5, temperature=0.0, logprobs=2), n=2), events.append)
        assert t.done.wait(60)
    finally:
        engine.stop()
    assert isinstance(events[-1], Done)
    for choice in range(2):
        deltas = [e for e in events if isinstance(e, Delta) and e.choice == choice]
        assert "".join(d.text for d in deltas) == t.texts[choice]
        logprobs = [lp for d in deltas for lp in d.logprobs]
        assert [lp.token_id for lp in logprobs] == t.token_ids[choice]
        assert all(lp.logprob <= 0 and len(lp.top) == 2 and lp.top[0][2] >= lp.logprob for lp in logprobs)
        assert [e.reason for e in events if isinstance(e, Finish) and e.choice == choice] == ["length"]


class _GatedWeights(FixedWeights):
    """A fixed model that the engine can load only once the test opens the gate: requests wait meanwhile."""

    def __init__(self, model):
        super().__init__(model)
        self.gate = threading.Event()

    def load(self) -> ServedWeights:
        self.gate.wait(30)
        return super().load()


def test_past_the_batch_and_the_queue_requests_are_refused(model, tok):
    weights = _GatedWeights(model)
    engine = _engine(weights, tok, max_batch=2, max_n=2, queue_size=1)
    try:
        ids = tuple(tok.encode("Hello").ids)
        params = SamplingParams(max_tokens=3, temperature=0.0)
        running = engine.submit(Generation(ids, params, n=2), lambda e: None)  # fits the batch
        queued = engine.submit(Generation(ids, params), lambda e: None)  # waits: the one place in the queue
        with pytest.raises(QueueFullError, match="--serve-queue 1"):
            engine.submit(Generation(ids, params), lambda e: None)
        weights.gate.set()
        assert running.done.wait(60) and queued.done.wait(60)
        assert engine.submit(Generation(ids, params), lambda e: None).done.wait(60)  # room again
    finally:
        engine.stop()


class _Steps:
    """Two models, as a node serves one step and then the next."""

    def __init__(self, first, second):
        self.models = {1: FixedWeights(first, 1), 2: FixedWeights(second, 2)}
        self.current = 1
        self.max_seq_len, self.vocab_size = first.config.n_positions, first.config.vocab_size

    def step(self) -> int:
        return self.current

    def load(self) -> ServedWeights:
        return self.models[self.current].load()


def test_a_new_step_is_served_once_the_running_rows_drained(model, tok):
    second = build_model(ModelConfig.load(TINY_CONFIG))
    with torch.no_grad():
        for p in second.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    weights = _Steps(model, second)
    engine = _engine(weights, tok)
    first_text = threading.Event()
    try:
        ids = tok.encode("To be, or not to be").ids
        a = engine.submit(Generation(tuple(ids), SamplingParams(max_tokens=40, temperature=0.0)),
                          lambda e: first_text.set() if isinstance(e, Delta) else None)
        assert first_text.wait(60)
        weights.current = 2  # the node published a new step while `a` runs
        b = engine.submit(Generation(tuple(ids), SamplingParams(max_tokens=40, temperature=0.0)), lambda e: None)
        assert a.done.wait(60) and b.done.wait(60)
    finally:
        engine.stop()
    assert (a.step, b.step) == (1, 2)
    assert a.token_ids[0] == _greedy_reference(model, ids, 40)  # all of `a` from step 1's weights
    assert b.token_ids[0] == _greedy_reference(second, ids, 40)
    assert a.token_ids[0] != b.token_ids[0]


def test_a_lora_expert_by_name_adds_its_delta_to_the_final_hidden_state(model, tok):
    import numpy as np

    from dtrain.node.split.experts import ExpertRegistry, LoraExpert

    rng = np.random.default_rng(3)
    d = model.config.n_embd
    expert = LoraExpert.from_matrices("banking", rng.normal(scale=0.5, size=(4, d)), rng.normal(scale=0.5, size=(d, 4)), 4.0)
    registry = ExpertRegistry()
    registry.add(expert)
    engine = ServeEngine(FixedWeights(model), lambda ids: tok.decode(list(ids)), ServeConfig(), experts=registry,
                         eos_token_id=50256)
    engine.start()
    ids = tok.encode("To be, or not to be").ids
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0)
        with_expert = engine.submit(Generation(tuple(ids), params, expert="banking"), lambda e: None)
        bare = engine.submit(Generation(tuple(ids), params), lambda e: None)  # the same batch, rows apart
        assert with_expert.done.wait(60) and bare.done.wait(60)
    finally:
        engine.stop()
    seq = list(ids)  # the reference: the whole sequence recomputed each token, the expert's delta on ln_f's output
    with torch.no_grad():
        for _ in range(6):
            h = model.transformer(input_ids=torch.tensor([seq])).last_hidden_state[0, -1]
            seq.append(int(_logits(model, h + expert.delta(h)).argmax()))
    assert with_expert.token_ids[0] == seq[len(ids):]
    assert bare.token_ids[0] == _greedy_reference(model, ids, 6) != with_expert.token_ids[0]


def _expert_greedy(model, ids: list[int], expert, n_new: int) -> list[int]:
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n_new):
            h = model.transformer(input_ids=torch.tensor([seq])).last_hidden_state[0, -1]
            seq.append(int(_logits(model, h + expert.delta(h)).argmax()))
    return seq[len(ids):]


def test_a_hot_swapped_expert_serves_the_rows_admitted_after_it(model, tok):
    """--feedback-lora replaces an adapter by name while completions run: one in flight keeps its version."""
    import numpy as np

    from dtrain.node.split.experts import ExpertRegistry, LoraExpert

    d = model.config.n_embd
    rngs = (np.random.default_rng(1), np.random.default_rng(2))
    old, new = (LoraExpert.from_matrices("agent", r.normal(scale=0.5, size=(4, d)), r.normal(scale=0.5, size=(d, 4)),
                                         4.0) for r in rngs)
    ids = tok.encode("To be, or not to be").ids
    old_ref, new_ref = _expert_greedy(model, ids, old, 8), _expert_greedy(model, ids, new, 8)
    assert old_ref != new_ref
    registry = ExpertRegistry([old])
    engine = ServeEngine(FixedWeights(model), lambda ids: tok.decode(list(ids)), ServeConfig(), experts=registry,
                         eos_token_id=50256)
    engine.start()
    swapped = threading.Event()
    deltas_after_swap = []

    def swap_after_first_token(event):
        if isinstance(event, Delta) and swapped.is_set():
            deltas_after_swap.append(event)
        if isinstance(event, Delta) and not swapped.is_set():
            registry.add(new)  # on the engine thread, between two decode steps of this completion
            swapped.set()
    try:
        params = SamplingParams(max_tokens=8, temperature=0.0)
        in_flight = engine.submit(Generation(tuple(ids), params, expert="agent"), swap_after_first_token)
        assert in_flight.done.wait(60) and swapped.is_set()
        after = engine.submit(Generation(tuple(ids), params, expert="agent"), lambda e: None)
        assert after.done.wait(60)
    finally:
        engine.stop()
    assert deltas_after_swap  # the completion went on decoding after the swap ...
    assert in_flight.token_ids[0] == old_ref  # ... with the version it was admitted with
    assert after.token_ids[0] == new_ref
