"""Configuration: files and flags map onto the dataclasses; bad values are clear errors."""
import dataclasses
import json

import pytest

from dtrain.flags import parse_config
from dtrain.node.config import ConfigError, ModelConfig, SwarmConfig, TrainConfig
from dtrain.node.model import build_model, embedding_tensor_id, tensor_infos
from tests.nodeproc import REPO, TINY_CONFIG

pytestmark = pytest.mark.unit


def test_static_configs_load():
    model = ModelConfig.load(REPO / "dtrain" / "static" / "model_config.json")
    train = TrainConfig.load(REPO / "dtrain" / "static" / "train_config.json")
    assert model.vocab_size == 50257 and model.d_model % model.n_heads == 0
    assert set(dataclasses.asdict(train)) == {"learning_rate", "beta1", "beta2", "eps", "weight_decay", "min_nodes_for_update"}


def test_default_model_is_browser_sized():
    model = build_model(ModelConfig.load(REPO / "dtrain" / "static" / "model_config.json"))
    assert sum(p.numel() for p in model.parameters()) <= 20_000_000


def test_seeded_model_is_identical_and_tied_weight_listed_once():
    config = ModelConfig.load(TINY_CONFIG)
    a, b = build_model(config), build_model(config)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert pa.detach().numpy().tobytes() == pb.detach().numpy().tobytes(), name
    infos = tensor_infos(a)
    names = [t.name for t in infos]
    assert len(names) == len(set(names)) and "lm_head.weight" not in names
    assert infos[embedding_tensor_id(a)].shape == (config.vocab_size, config.d_model)
    assert [t.id for t in infos] == list(range(len(infos)))


def test_bad_model_config_names_the_field(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"d_model": 30, "n_heads": 4}))
    with pytest.raises(ConfigError, match="not divisible"):
        ModelConfig.load(path)
    path.write_text(json.dumps({"d_modle": 32}))
    with pytest.raises(ConfigError, match="unknown field"):
        ModelConfig.load(path)


def test_matchmaking_must_exceed_request_timeout():
    with pytest.raises(ConfigError, match="must exceed request_timeout"):
        SwarmConfig(matchmaking_time_s=3.0, request_timeout_s=3.0)


def test_flags_override_yaml_file(tmp_path):
    path = tmp_path / "node.yaml"
    path.write_text("port: 9000\ntarget-batch-size: 32\ninitial-peers: /ip4/1.2.3.4/tcp/5/p2p/X\nrun-id: demo\n")
    config = parse_config(["--config", str(path), "--port", "9100"])
    assert config.port == 9100
    assert config.swarm.target_batch_size == 32
    assert config.swarm.initial_peers == ("/ip4/1.2.3.4/tcp/5/p2p/X",)
    assert config.swarm.run_id == "demo"


def test_unknown_yaml_option_is_refused(tmp_path):
    path = tmp_path / "node.yaml"
    path.write_text("prot: 9000\n")
    with pytest.raises(ConfigError, match="unknown option"):
        parse_config(["--config", str(path)])


def test_documented_flag_table_is_the_dataclasses():
    from dtrain.flags import markdown_table

    doc = (REPO / "docs" / "configuration.md").read_text()
    table = doc.split("<!-- flags -->\n", 1)[1].split("\n<!-- /flags -->", 1)[0]
    assert table == markdown_table()


def test_every_flag_reaches_its_field():
    config = parse_config(["--settle-time", "4", "--matchmaking-time", "6", "--no-he", "--expert", "x=/tmp/x",
                           "--local-samples-per-update", "3", "--dp-epsilon", "2"])
    assert config.swarm.settle_s == 4.0 and config.swarm.matchmaking_time_s == 6.0
    assert config.split.he is False and config.split.experts == (("x", "/tmp/x"),)
    assert config.local_samples_per_update == 3 and config.split.dp_epsilon == 2.0


def test_serving_flags_reach_their_fields_and_are_checked():
    config = parse_config(["--serve-max-tokens", "64", "--serve-queue", "0", "--capture-db", "/tmp/x.sqlite",
                           "--feedback-train", "--feedback-interval", "2.5"])
    assert (config.serve.max_tokens, config.serve.queue_size, config.serve.capture_db) == (64, 0, "/tmp/x.sqlite")
    assert config.serve.capture and config.serve.feedback_train and config.serve.feedback_interval_s == 2.5
    assert not parse_config([]).serve.capture and parse_config([]).serve.capture_db is None  # recording is opt-in
    with pytest.raises(ConfigError, match="--capture-db"):
        parse_config(["--feedback-train"])
    with pytest.raises(ConfigError, match="--capture-db"):
        parse_config(["--capture-db", " "])
    with pytest.raises(ConfigError, match="max_n"):
        parse_config(["--serve-max-batch", "2", "--serve-max-n", "3"])


@pytest.mark.parametrize("argv, message", [
    (["--feedback-lora", "a b"], "adapter name"),
    (["--feedback-lora", "_x"], "adapter name"),
    (["--feedback-lora", "x" * 65], "adapter name"),
    (["--feedback-lora", "x", "--feedback-train", "--capture-db", "c.sqlite"], "choose one"),
    (["--feedback-lora", "x"], "--capture-db"),
    (["--feedback-lora", "x", "--capture-db", "c.sqlite", "--feedback-lora-rank", "0"], "feedback_lora_rank"),
    (["--feedback-lora", "x", "--capture-db", "c.sqlite", "--feedback-lora-lr", "0"], "feedback_lora_lr"),
    (["--sync", "per-step", "--inner-copy"], "no inner loop"),
])
def test_bad_option_combinations_are_config_errors(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(argv)


@pytest.mark.parametrize("name,params", [("gpt2-small", 124_046_592), ("gpt2-medium", 354_298_880)])
def test_shipped_gpt2_configs_have_gpt2s_sizes(name, params):
    """configs/gpt2-*.json are GPT-2's shapes at 512 positions: built on the meta device, no memory allocated."""
    import torch
    from transformers import GPT2LMHeadModel

    from dtrain.node.model import hf_config
    with torch.device("meta"):
        model = GPT2LMHeadModel(hf_config(ModelConfig.load(REPO / "configs" / f"{name}.json")))
    assert sum(p.numel() for p in model.parameters()) == params


def test_meta_template_holds_no_parameter_memory_and_materializes_tied():
    """The engines' template is shapes only; a materialized copy has the built model's parameters, tied as they are."""
    from dtrain.node.model import materialize, meta_template
    config = ModelConfig.load(TINY_CONFIG)
    template = meta_template(config)
    assert all(p.is_meta for p in template.parameters())
    built, copy_ = build_model(config), materialize(template)
    assert not any(p.is_meta for p in copy_.parameters())
    assert copy_.lm_head.weight is copy_.transformer.wte.weight
    assert [(n, p.shape) for n, p in copy_.named_parameters()] == [(n, p.shape) for n, p in built.named_parameters()]


@pytest.mark.parametrize("name,parameters", [("gpt2-small", 124_046_592), ("gpt2-medium", 354_298_880),
                                             ("gpt2-xl", 1_557_611_200)])
def test_the_packaged_gpt2_configs_build_their_sizes(name, parameters):
    """GPT-2's sizes as OpenAI published them (tied embeddings): built on the meta device, no memory taken."""
    from dtrain.node.model import meta_template

    model = meta_template(ModelConfig.load(REPO / "configs" / f"{name}.json"))
    assert sum(p.numel() for p in model.parameters()) == parameters
