"""Feedback that trains, on a TrainingNode in this process (alone in its swarm, tiny model): the loss of one
record against transformers' own loss, and rewarded rows of a real capture db becoming contributions whose
update makes a rewarded completion more likely and a punished one less likely."""
from __future__ import annotations

import pytest
import torch

from dtrain.node.config import ModelConfig, NodeConfig, SwarmConfig, TrainConfig
from dtrain.node.model import build_model
from dtrain.node.serve.capture import CaptureStore, Record, token_hash
from dtrain.node.serve.feedback import CONTRIBUTOR, FeedbackTrainer, record_loss
from dtrain.node.serve.weights import load_snapshot
from dtrain.node.train.trainer import TrainingNode
from tests.nodeproc import TINY_CONFIG, new_run_id, wait_until

pytestmark = [pytest.mark.unit, pytest.mark.timeout(180)]

PROMPT, COMPLETION = (464, 2068, 7586), (21831, 18045, 625, 262)


@pytest.fixture(scope="module")
def node():
    config = NodeConfig(swarm=SwarmConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",), run_id=new_run_id()))
    node = TrainingNode(config, ModelConfig.load(TINY_CONFIG), TrainConfig(learning_rate=1e-3))
    node.start()
    try:
        yield node
    finally:
        node.stop()


def _record(cid: str, reward, prompt=PROMPT, completion=COMPLETION) -> Record:
    return Record(id=cid, choice=0, created=0.0, endpoint="text_completion", model="m", expert=None, step=1,
                  prompt="", prompt_ids=prompt, completion="", completion_ids=completion, finish_reason="length",
                  params={}, reward=reward, feedback_hash=token_hash(cid))  # the id is its token here


def _completion_logprob(node, prompt=PROMPT, completion=COMPLETION) -> float:
    model = load_snapshot(build_model(node.model_config), node.snapshot().f32)
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1)
    return float(logp[torch.arange(len(prompt) - 1, ids.shape[1] - 1), ids[0, len(prompt):]].sum())


def test_record_loss_is_the_reward_weighted_likelihood_term():
    model = build_model(ModelConfig.load(TINY_CONFIG))
    ids = torch.tensor([PROMPT + COMPLETION])
    labels = ids.clone()
    labels[0, :len(PROMPT)] = -100  # transformers' own loss over the completion tokens only
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels)
        torch.testing.assert_close(record_loss(model, _record("a", 0.5)), 0.5 * out.loss)
        p = torch.softmax(out.logits[0, :-1], -1)[torch.arange(len(PROMPT) - 1, ids.shape[1] - 1), ids[0, len(PROMPT):]]
        torch.testing.assert_close(record_loss(model, _record("b", -1.0)), -torch.log(1 - p).mean())
    assert record_loss(model, _record("c", 0.0)) is None
    assert record_loss(model, _record("d", 1.0, completion=())) is None


def test_rewarded_rows_train_the_shared_model(node, tmp_path):
    store = CaptureStore(tmp_path / "c.sqlite", max_rows=100)
    trainer = FeedbackTrainer(node, store, build_model(node.model_config), batch=8, interval_s=60)
    assert trainer.run_once() is None  # nothing recorded
    store.record([_record("bad", None), _record("silent", None, completion=(11,))])
    assert trainer.run_once() is None  # recorded, no reward yet
    store.feedback("bad", -1.0, None, "bad")
    store.feedback("silent", 0.0, None, "silent")
    # punished first, while AdamW has no momentum: the unlikelihood of an already unlikely completion is a small
    # gradient (it stops pushing as p -> 0), which momentum from an earlier update would outweigh
    before, step = _completion_logprob(node), node.step
    done = trainer.run_once()
    assert (done.step, done.records, done.skipped) == (step, 1, 1) and done.loss > 0
    wait_until(lambda: node.step == step + 1, 60, "the feedback update")
    assert _completion_logprob(node) < before  # pushed away from the punished completion
    assert [r.trained_step for r in store.get("bad") + store.get("silent")] == [step, step]
    assert trainer.run_once() is None  # every rewarded row was used once
    credited = node.ledger.get(CONTRIBUTOR)  # in the ledger like any contributor, through the same aggregation
    assert (credited.accepted, credited.samples_claimed, credited.samples_credited) == (1, 1, 1)

    store.record([_record("good", None)])
    store.feedback("good", 1.0, None, "good")
    before = _completion_logprob(node)
    done = trainer.run_once()
    wait_until(lambda: node.step == step + 2, 60, "the second feedback update")
    assert done.records == 1 and _completion_logprob(node) > before  # pulled towards the rewarded one
