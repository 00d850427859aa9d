"""`--device`: its spelling, its resolution before the node starts (auto is the CPU on a machine without CUDA), and
the CPU path of node.train.compute, which must give the very bytes the node computed before devices existed."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from dtrain.flags import parse_config
from dtrain.node.config import ConfigError, ModelConfig, NodeConfig, TrainConfig, parse_device
from dtrain.node.corpus import load_corpus
from dtrain.node.device import CPU, resolve
from dtrain.node.model import build_model
from dtrain.node.train import reference
from dtrain.node.train.compute import Compute
from dtrain.node.train.trainer import TrainingNode
from tests.nodeproc import REPO, TINY_CONFIG

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


@pytest.mark.parametrize("text, parsed", [("auto", ("auto", None)), ("cpu", ("cpu", None)), ("cuda", ("cuda", None)),
                                          ("cuda:0", ("cuda", 0)), ("cuda:7", ("cuda", 7)), (" CUDA:1 ", ("cuda", 1))])
def test_device_spellings(text, parsed):
    assert parse_device(text) == parsed


@pytest.mark.parametrize("text", ["gpu", "cuda:", "cuda:-1", "cuda:x", "cpu:0", "auto:1", "cuda0", "", "mps"])
def test_a_malformed_device_is_a_config_error_naming_the_forms(text):
    with pytest.raises(ConfigError, match=r"auto, cpu, cuda or cuda:N"):
        NodeConfig(device=text)
    with pytest.raises(ConfigError, match=r"auto, cpu, cuda or cuda:N"):
        parse_config(["--device", text])


def test_the_flag_and_the_default():
    assert NodeConfig().device == "auto"
    assert parse_config(["--device", "cuda:1"]).device == "cuda:1"


def test_the_thread_budget_flag_and_its_checks():
    assert NodeConfig().torch_threads == 0  # torch's default: one thread per core it sees
    assert parse_config(["--torch-threads", "1"]).torch_threads == 1
    with pytest.raises(ConfigError, match=r"torch_threads must be an integer >= 0"):
        parse_config(["--torch-threads", "-1"])


THREADS_PROBE = """
import json, threading, torch
from dtrain.node.device import threads_now, use_threads
default = threads_now()
set_to = use_threads(int(__import__("sys").argv[1]))
seen = {}
worker = threading.Thread(target=lambda: seen.update(threads_now()))  # as the serving engines' threads run ops
worker.start(); worker.join()
print(json.dumps([default, set_to, seen]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 0])
def test_the_thread_budget_reaches_torch_in_every_thread_of_the_process(threads):
    # a process of its own: torch takes the inter-op count once per process
    out = subprocess.run([sys.executable, "-c", THREADS_PROBE, str(threads)], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    default, set_to, seen = json.loads(out.stdout)
    expected = {"intra_op": threads, "inter_op": threads} if threads else default
    assert set_to == seen == expected


def test_auto_is_cuda_where_torch_sees_it_and_the_cpu_elsewhere():
    expected = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert str(resolve("auto").torch_device) == expected
    assert resolve("auto", cuda_available=lambda: False) == CPU
    assert resolve("cpu") == CPU and CPU.precision == "fp32" and CPU.as_dict() == {
        "device": "cpu", "name": "cpu", "precision": "fp32"}


def test_cuda_without_a_gpu_or_past_the_last_one_is_refused():
    with pytest.raises(ConfigError, match=r"--device cuda: torch sees no CUDA device.*--device cpu or auto"):
        resolve("cuda", cuda_available=lambda: False)
    with pytest.raises(ConfigError, match=r"--device cuda:2: this machine has 2 CUDA device\(s\), cuda:0 to cuda:1"):
        resolve("cuda:2", cuda_available=lambda: True, cuda_count=lambda: 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_a_node_asked_for_cuda_on_a_machine_without_one_stops_before_it_builds_anything():
    with pytest.raises(ConfigError, match="torch sees no CUDA device"):
        TrainingNode(NodeConfig(device="cuda"), ModelConfig.load(TINY_CONFIG), TrainConfig())


def test_the_cpu_pass_is_the_plain_autograd_pass_bit_for_bit():
    """What the node computed before `--device`: the model's loss and torch.autograd.grad on the master itself."""
    model = build_model(ModelConfig.load(TINY_CONFIG))
    tokens = load_corpus().batch(3, 32, np.random.default_rng(5))
    x = torch.from_numpy(tokens.astype(np.int64))
    want_loss = model(input_ids=x, labels=x).loss
    want = torch.autograd.grad(want_loss, list(model.parameters()))
    loss, grads = Compute(model).loss_and_grads(tokens)
    assert loss.item() == want_loss.item()
    assert len(grads) == len(want)
    for g, w in zip(grads, want):
        assert g.device.type == "cpu" and g.dtype == torch.float32
        assert torch.equal(g, w)
    _, sums = Compute(model).loss_and_grads(tokens, scale=3)  # the node's local batch: the sum over 3 samples
    for g, w in zip(sums, want):
        assert torch.equal(g, w.detach() * 3)
    ref = reference.compute(Compute(model), tokens, step=4)
    assert ref.step == 4 and ref.loss == want_loss.item()
    for g, w in zip(ref.gradient, want):
        assert np.array_equal(g, w.reshape(-1).numpy())
