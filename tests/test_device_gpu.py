"""A node on a CUDA device: its inner loop trains a resident fp32 copy on the GPU with bf16 autocast and fused AdamW,
its fp32 CPU master weights take those values once per outer round, and it serves exactly those fp32 bytes; its gradient points where the CPU's does; the /v1 engine and the split engine on the GPU give the CPU's
logits for the same weights. Skipped, with the reason, on a machine where torch sees no CUDA device."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from dtrain.node.config import DEFAULT_STATIC_DIR, ModelConfig, NodeConfig, SwarmConfig, TrainConfig
from dtrain.node.corpus import load_corpus
from dtrain.node.device import CPU, resolve
from dtrain.node.frozen import SnapshotModels
from dtrain.node.model import build_model, embedding_tensor_id, meta_template
from dtrain.node.serve.config import ServeConfig
from dtrain.node.serve.engine import Generation, ServeEngine
from dtrain.node.serve.sampling import SamplingParams
from dtrain.node.serve.weights import FixedWeights, SnapshotWeights
from dtrain.node.snapshot import params_digest
from dtrain.node.split.dp import DPConfig
from dtrain.node.split.engine import SplitEngine
from dtrain.node.split.experts import ExpertRegistry
from dtrain.node.split.kv_cache import KVCacheStore
from dtrain.node.tokenizer import load_tokenizer
from dtrain.node.train import reference
from dtrain.node.data import TokenDataset
from dtrain.node.lowcomm.outer import OuterNesterov
from dtrain.node.lowcomm.rounds import InnerRounds
from dtrain.node.train.adamw import make_local_optimizer
from dtrain.node.train.ahead import Ahead
from dtrain.node.train.compute import Compute, OwnBatches
from dtrain.node.train.trainer import TrainingNode
from tests.nodeproc import TINY_CONFIG, new_run_id, wait_until

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(240),
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason=f"torch {torch.__version__} sees no CUDA device on this machine")]

CUDA = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig.load(TINY_CONFIG))


def test_cuda_resolves_to_bf16_autocast_on_the_gpu():
    device = resolve("cuda")
    assert device.torch_device == CUDA and device.name == torch.cuda.get_device_name(0)
    assert device.precision == ("bf16 autocast" if torch.cuda.get_device_capability(0)[0] >= 8 else "fp32")


def test_the_gpu_gradient_points_where_the_cpu_gradient_does(model):
    tokens = load_corpus().batch(8, 64, np.random.default_rng(1))
    cpu_loss, cpu_grads = Compute(model, CPU).loss_and_grads(tokens)
    gpu = Compute(model, resolve("cuda"))
    loss, grads = gpu.loss_and_grads(tokens)
    assert all(g.device.type == "cpu" and g.dtype == torch.float32 for g in grads)  # fp32 on the CPU
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())  # the master
    assert all(r.device == CUDA for r in gpu._replica.parameters())
    assert abs(loss.item() - cpu_loss.item()) < 2e-2 * abs(cpu_loss.item())
    a = torch.cat([g.reshape(-1) for g in grads]).double()
    b = torch.cat([g.reshape(-1) for g in cpu_grads]).double()
    assert torch.dot(a, b) / (a.norm() * b.norm()) > 0.99
    assert abs(a.norm() / b.norm() - 1) < 0.05
    ref = reference.compute(gpu, tokens, step=2)  # the trusted reference, on the GPU: flat fp32 numpy per tensor
    assert all(g.dtype == np.float32 for g in ref.gradient)
    np.testing.assert_allclose(np.concatenate(ref.gradient), a.float().numpy(), rtol=0, atol=1e-6)
    _, sums = gpu.loss_and_grads(tokens, scale=8)  # a local batch's sum over its 8 samples, scaled on the GPU
    np.testing.assert_allclose(torch.cat([g.reshape(-1) for g in sums]).numpy(), 8 * a.float().numpy(), rtol=0,
                               atol=8e-6)
    assert np.isfinite(ref.gradient[0]).all() and ref.gradient[0] is not sums[0]  # the reference kept its own copy


def test_the_gpus_copy_goes_on_with_inner_updates_during_a_round_and_lands_them_on_its_result():
    """With a peer, the inner updates go on on the GPU's copy while the round runs (bf16 autocast, fused AdamW), the
    copy as the round found it is held on the GPU, and the round's end leaves the copy at copy - base + parameters."""
    model = build_model(ModelConfig.load(TINY_CONFIG))
    compute = Compute(model, resolve("cuda"))
    replica = compute.resident()
    params, trained = list(model.parameters()), list(replica.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)  # hivemind's gradient buffers, on the CPU
    data = TokenDataset(np.random.default_rng(0).integers(0, 50257, size=20_000, dtype=np.uint32))
    own = OwnBatches(compute, data, 4, 32, np.random.default_rng(0)).next
    ahead = Ahead(own, 4, step=lambda grads: rounds.step_in_round(grads), max_steps=5)
    rounds = InnerRounds(params, make_local_optimizer(replica, TrainConfig()), 5, trained=trained,
                         before_write=ahead.stop)
    rounds.inner_step([torch.full_like(t, 1e-3) for t in trained])
    outer = OuterNesterov(params, lr=0.7, momentum=0.9)
    outer.source = rounds.begin()
    at_begin = [p.detach().clone() for p in params]
    ahead.start()
    wait_until(lambda: ahead.steps == 5, 120, "five inner updates during the round")
    assert all(b.device == CUDA for b in rounds._round_base)  # held on the GPU, not the host
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, at_begin))  # the round's parameters untouched
    moved = [t.detach().clone() for t in trained]
    assert any(not torch.equal(m.cpu(), b) for m, b in zip(moved, at_begin))
    for p in params:
        p.grad = torch.full_like(p, 3e-3)  # the round's average
    outer.step()
    ahead.stop()
    rounds.applied()
    rounds.settle()
    assert all(t.device == CUDA for t in trained) and rounds._round_base is None
    for t, m, b, p in zip(trained, moved, at_begin, params):
        assert torch.equal(t, (m - b.to(CUDA)) + p.detach().to(CUDA))
    samples, loss = ahead.take_trained()
    assert samples == 20 and loss.device == CUDA and rounds.steps == 5 and not rounds.due


def test_a_node_on_cuda_trains_and_serves_its_fp32_master_bytes():
    config = NodeConfig(device="cuda", local_batch_size=8, local_seq_len=64,
                        swarm=SwarmConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",), run_id=new_run_id()))
    node = TrainingNode(config, ModelConfig.load(TINY_CONFIG), TrainConfig(learning_rate=1e-3), dataset=load_corpus())
    seed = params_digest(node.model)
    node.start()
    try:
        wait_until(lambda: node.step >= 6, 120, "six local updates on the GPU")
    finally:
        node.stop()
    assert node.status().device == {"device": "cuda:0", "name": torch.cuda.get_device_name(0),
                                    "precision": node.device.precision}
    assert all(r.device == CUDA for r in node.compute._replica.parameters())
    # the inner loop lives on the GPU: its parameters, its fused AdamW's state and the pending gradient
    assert node.resident and all(t.device == CUDA for t in node.rounds.trained)
    assert node.rounds.inner.defaults["fused"] is True
    assert all(v.device == CUDA for per in node.rounds.inner.state.values() for v in per.values() if torch.is_tensor(v))
    assert node.gradient.device == CUDA and all(s.device == CUDA for s in node.gradient.sums)
    losses = node.losses()
    assert len(losses) >= 5 and all(np.isfinite(losses))
    snap = node.snapshot()
    # the bytes served for the step are the master's fp32 parameters, nothing the GPU rounded
    params = list(node.model.parameters())
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in params)
    assert len(snap.f32) == len(params)
    for served, p in zip(snap.f32, params):
        assert served.dtype == np.float32 and served.tobytes() == p.detach().numpy().tobytes()
    assert snap.digest == params_digest(node.model) != seed
    assert snap.digest == hashlib.sha256(b"".join(a.tobytes() for a in snap.f32)).hexdigest()

    # the node's engines read the step through its shared models: on the GPU, one copy of the snapshot there
    models = SnapshotModels(node.snapshot, meta_template(node.model_config))
    on_gpu = models.current(CUDA)
    assert on_gpu is models.current(CUDA) and on_gpu.step == snap.step
    for p, served in zip(on_gpu.model.parameters(), snap.f32):
        assert p.device == CUDA and np.array_equal(p.detach().cpu().numpy().reshape(-1), served)
    tok = load_tokenizer(DEFAULT_STATIC_DIR)
    prompts = [tok.encode(text).ids for text in ("To be, or not to be", "Once upon a time there")]
    runs = {}
    for device in (torch.device("cpu"), CUDA):
        runs[device.type] = _greedy(SnapshotWeights(models, device), device, tok, prompts)
        template = meta_template(node.model_config)
        split = SplitEngine(template, lambda: node.step, KVCacheStore(), DPConfig(), ExpertRegistry(), device=device,
                            source=models)
        wte = torch.from_numpy(np.array(snap.f32[embedding_tensor_id(template)])).view(-1, node.model_config.d_model)
        runs[device.type + " split"] = split.forward(wte[torch.tensor(prompts[0])].numpy()).pre_activations
    for (cpu_tokens, cpu_lp), (gpu_tokens, gpu_lp) in zip(runs["cpu"], runs["cuda"]):
        assert gpu_tokens == cpu_tokens and cpu_tokens
        np.testing.assert_allclose(gpu_lp, cpu_lp, atol=1e-3, rtol=0)
    np.testing.assert_allclose(runs["cuda split"], runs["cpu split"], atol=2e-4, rtol=1e-4)


def _greedy(weights, device: torch.device, tok, prompts) -> list[tuple[list[int], list[float]]]:
    """Per prompt, from a /v1 engine on `device` reading `weights`: the greedy tokens and, per token, the logprobs of
    its 3 most likely candidates."""
    engine = ServeEngine(weights, lambda ids: tok.decode(list(ids)), ServeConfig(), eos_token_id=50256, device=device)
    engine.start()
    runs = []
    try:
        for p in prompts:
            logprobs: list[float] = []
            ticket = engine.submit(Generation(tuple(p), SamplingParams(max_tokens=12, temperature=0.0, logprobs=3)),
                                   lambda e: logprobs.extend(lp for t in getattr(e, "logprobs", ())
                                                             for _, _, lp in t.top))
            assert ticket.done.wait(60)
            runs.append((ticket.token_ids[0], logprobs))
    finally:
        engine.stop()
    return runs


def test_the_v1_engine_on_cuda_gives_the_cpus_tokens_and_logprobs(model):
    tok = load_tokenizer(DEFAULT_STATIC_DIR)
    prompts = [tok.encode(text).ids for text in ("To be, or not to be", "Hello", "Once upon a time there")]
    runs = {}
    for device in (torch.device("cpu"), CUDA):
        runs[device.type] = _greedy(FixedWeights(model), device, tok, prompts)
    for (cpu_tokens, cpu_lp), (gpu_tokens, gpu_lp) in zip(runs["cpu"], runs["cuda"]):
        assert gpu_tokens == cpu_tokens and cpu_tokens
        # log-softmax of the logits: the same up to fp32 rounding on another device
        assert len(gpu_lp) == len(cpu_lp) > 0
        np.testing.assert_allclose(gpu_lp, cpu_lp, atol=1e-3, rtol=0)
    assert next(model.parameters()).device.type == "cpu"  # the engine moved its own copy


def test_the_split_engine_on_cuda_gives_the_cpus_pre_activations(model):
    wte = model.get_input_embeddings().weight.detach()
    ids = torch.randint(0, model.config.vocab_size, (20,), generator=torch.Generator().manual_seed(3))
    hidden = wte[ids].numpy().astype(np.float32)
    results = {}
    for device in (torch.device("cpu"), CUDA):
        engine = SplitEngine(model, lambda: 0, KVCacheStore(), DPConfig(), ExpertRegistry(), device=device)
        whole = engine.forward(hidden)
        first = engine.forward(hidden[:12], session_id="s1", incremental=False)
        rest = engine.forward(hidden[12:], session_id="s1", incremental=True)
        results[device.type] = (whole, first, rest)
    for cpu, gpu in zip(results["cpu"], results["cuda"]):
        assert gpu.pre_activations.dtype == np.float32 and gpu.pre_activations.shape == cpu.pre_activations.shape
        np.testing.assert_allclose(gpu.pre_activations, cpu.pre_activations, atol=2e-4, rtol=1e-4)
    whole, first, rest = results["cuda"]
    np.testing.assert_allclose(np.concatenate([first.pre_activations, rest.pre_activations]), whole.pre_activations,
                               atol=2e-4, rtol=1e-4)
    logits_gpu = torch.from_numpy(whole.pre_activations) @ wte.T
    logits_cpu = torch.from_numpy(results["cpu"][0].pre_activations) @ wte.T
    torch.testing.assert_close(logits_gpu, logits_cpu, atol=1e-3, rtol=1e-4)
