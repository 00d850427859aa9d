"""Hugging Face directories in and out, on real files: a `save_pretrained` GPT-2 read byte for byte, the checkpoints
transformers writes in other layouts, every refused directory with its reason, the node's safetensors checkpoint,
and an export that plain transformers loads and that computes the same logits."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

from dtrain.clients.export import export
from dtrain.node import checkpoint as ckpt
from dtrain.node import hfdir
from dtrain.node.assets import tokenizer_files
from dtrain.node.config import ModelConfig, TrainConfig
from dtrain.node.lowcomm import momentum as momentum8
from dtrain.node.lowcomm.outer import OuterNesterov
from dtrain.node.lowcomm.rounds import InnerRounds
from dtrain.node.model import build_model
from dtrain.node.snapshot import params_digest
from dtrain.node.train.adamw import make_local_optimizer

pytestmark = pytest.mark.unit

SHAPE = dict(vocab_size=50257, n_positions=64, n_embd=32, n_layer=2, n_head=2, n_inner=64)


def _gpt2(seed: int = 0, **overrides) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(**{**SHAPE, **overrides})).eval()  # its config has dropout 0.1


@pytest.fixture()
def saved(tmp_path):
    """A small random GPT-2 as `save_pretrained` writes it, with GPT-2's tokenizer files beside it."""
    model = _gpt2()
    model.save_pretrained(tmp_path / "gpt2")
    files = tokenizer_files()
    for name, path in files.by_name.items():
        shutil.copyfile(path, tmp_path / "gpt2" / name)
    return model, tmp_path / "gpt2"


def test_a_save_pretrained_directory_is_read_byte_for_byte(saved):
    model, directory = saved
    imported = hfdir.read(directory)
    assert imported.config.architecture() == dict(vocab_size=50257, d_model=32, n_heads=2, n_layers=2, d_ff=64,
                                                  max_seq_len=64)
    assert imported.tokenizer_dir == directory
    ours = build_model(imported.config)
    hfdir.load_params(ours, imported.params)
    theirs = dict(model.named_parameters())
    for name, p in ours.named_parameters():
        assert p.dtype == torch.float32 and p.detach().numpy().tobytes() == theirs[name].detach().numpy().tobytes(), name
    ids = torch.tensor([[15496, 995, 11, 428]])
    assert torch.equal(ours(ids).logits, model(ids).logits)


def test_the_original_gpt2_layout_loads_too(tmp_path):
    """pytorch_model.bin with GPT2Model's keys (no `transformer.`), the saved causal masks and a tied lm_head."""
    model = _gpt2(seed=1, n_inner=None)  # n_inner null: 4 * n_embd
    directory = tmp_path / "orig"
    directory.mkdir()
    state = {k[len("transformer."):]: v for k, v in model.state_dict().items() if k.startswith("transformer.")}
    state["h.0.attn.bias"] = torch.ones(1, 1, 64, 64)
    state["lm_head.weight"] = model.lm_head.weight.detach().clone()
    torch.save(state, directory / "pytorch_model.bin")
    (directory / "config.json").write_text(json.dumps({**model.config.to_dict(), "n_inner": None}))
    imported = hfdir.read(directory)
    assert imported.config.d_ff == 128 and imported.tokenizer_dir is None
    assert torch.equal(imported.params["transformer.h.1.mlp.c_fc.weight"], model.transformer.h[1].mlp.c_fc.weight)


@pytest.mark.parametrize("change, message", [
    (lambda d: (d / "config.json").unlink(), "no config.json"),
    (lambda d: _config(d, model_type="llama"), "model_type 'llama'"),
    (lambda d: _config(d, activation_function="relu"), "activation_function"),
    (lambda d: _config(d, tie_word_embeddings=False), "tie_word_embeddings"),
    (lambda d: _config(d, n_embd=33), "d_model 33 is not divisible"),
    (lambda d: _config(d, n_inner=65), "shape"),
    (lambda d: (d / "model.safetensors").unlink(), "neither model.safetensors"),
    (lambda d: (d / "config.json").write_text("{"), "not valid JSON"),
])
def test_other_models_are_refused_with_the_reason(saved, change, message):
    _, directory = saved
    change(directory)
    with pytest.raises(hfdir.HFImportError, match=message):
        hfdir.read(directory)


def _config(directory, **fields) -> None:
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def test_non_finite_or_untied_weights_are_refused(tmp_path):
    from safetensors.torch import save_file

    model = _gpt2()
    base = {k: v.detach().clone() for k, v in model.named_parameters()}
    for name, tensors, message in [
        ("nan", {**base, "transformer.ln_f.weight": torch.full((32,), float("nan"))}, "NaN"),
        ("head", {**base, "lm_head.weight": torch.zeros(50257, 32)}, "lm_head.weight differs"),
        ("extra", {**base, "transformer.h.2.ln_1.weight": torch.ones(32)}, "unexpected tensor"),
    ]:
        directory = tmp_path / name
        directory.mkdir()
        model.config.to_json_file(directory / "config.json")
        save_file(tensors, str(directory / "model.safetensors"))
        with pytest.raises(hfdir.HFImportError, match=message):
            hfdir.read(directory)


def _trained(config: ModelConfig):
    """A model and its AdamW after one step: state worth checkpointing."""
    model = build_model(config)
    opt = make_local_optimizer(model, TrainConfig())
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-2
    opt.step()
    return model, opt


def test_a_checkpoint_round_trips_every_byte_without_pickle(tmp_path):
    config = ModelConfig(vocab_size=50257, d_model=32, n_heads=2, n_layers=2, d_ff=64, max_seq_len=64, name="t")
    model, opt = _trained(config)
    path = ckpt.save(tmp_path, ckpt.Checkpoint(params=dict(model.named_parameters()), optimizer_state=opt.state_dict(),
                                               epoch=7, losses=[3.5, 2.25], model_config=config))
    assert path.name == "state.safetensors" and sorted(p.name for p in tmp_path.iterdir()) == ["state.safetensors"]
    assert b"\x80\x04" not in path.read_bytes()[:4]  # not a pickle: a safetensors header length, then JSON
    back = ckpt.load(tmp_path)
    assert (back.epoch, back.losses, back.model_config) == (7, [3.5, 2.25], config)
    for name, p in model.named_parameters():
        assert torch.equal(back.params[name], p), name
    fresh = build_model(config)
    hfdir.load_params(fresh, back.params)
    restored = make_local_optimizer(fresh, TrainConfig())
    restored.load_state_dict(back.optimizer_state)
    for p, q in zip(model.parameters(), fresh.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], restored.state[q][key]), key
    assert [g["betas"] for g in restored.param_groups] == [g["betas"] for g in opt.param_groups]


TINY = ModelConfig(vocab_size=50257, d_model=32, n_heads=2, n_layers=2, d_ff=64, max_seq_len=64, name="t")


def _low_comm(config: ModelConfig):
    """A low-comm node's parts: its model, inner AdamW, round (sparse, a quarter per round) and outer step."""
    model = build_model(config)
    params = list(model.parameters())
    rounds = InnerRounds(params, make_local_optimizer(model, TrainConfig()), inner_steps=3, fraction=0.25)
    return model, rounds, OuterNesterov(params)


def _inner_step(rounds: InnerRounds, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    rounds.inner_step([torch.randn(p.shape, generator=gen) * 1e-2 for p in rounds.params])


def _saved_round(model, rounds, outer) -> ckpt.Checkpoint:
    return ckpt.Checkpoint(params=dict(zip(dict(model.named_parameters()), rounds.anchor)),
                           optimizer_state=outer.state_dict(), epoch=3, losses=[], model_config=TINY,
                           sync="low-comm", round=ckpt.RoundState(rounds.inner_parameters(), rounds.feedback,
                                                                  rounds.steps, rounds.inner.state_dict()))


def test_a_low_comm_round_round_trips_and_goes_on_bit_for_bit(tmp_path):
    model, rounds, outer = _low_comm(TINY)
    _inner_step(rounds, 1)
    _inner_step(rounds, 2)
    rounds.enter_outer()
    offer = rounds.offer(compress=True)
    with torch.no_grad():
        for p, o in zip(rounds.params, offer):
            p.sub_(o)  # an outer step that applied exactly the offer: the rest is error feedback now
    rounds.settle()
    _inner_step(rounds, 3)
    rounds.enter_outer()  # waiting for the round: the parameters are the anchor, the inner ones set aside
    ckpt.save(tmp_path, _saved_round(model, rounds, outer))

    back = ckpt.load(tmp_path)
    assert back.sync == "low-comm" and back.round.steps == 1
    anchor = [back.params[name] for name, _ in model.named_parameters()]  # the file holds them by name
    model2, rounds2, _ = _low_comm(TINY)
    ckpt.check_fits(back, "it", model2, "low-comm", feedback=True)
    hfdir.load_params(model2, back.params)
    rounds2 = InnerRounds(list(model2.parameters()), rounds2.inner, inner_steps=3, fraction=0.25)
    rounds2.inner.load_state_dict(back.round.inner_optimizer_state)
    rounds2.resume(anchor, back.round.inner_params, back.round.feedback, back.round.steps)
    rounds.leave_outer()
    for r in (rounds, rounds2):  # the same next inner updates and round on both
        _inner_step(r, 4)
        _inner_step(r, 5)
        r.enter_outer()
        r.offer(compress=True)
        r.settle()
    for name, a, b in [("anchor", rounds.anchor, rounds2.anchor), ("feedback", rounds.feedback, rounds2.feedback),
                       ("parameters", rounds.params, rounds2.params)]:
        assert all(torch.equal(x, y) for x, y in zip(a, b)), name
    assert rounds.steps == rounds2.steps == 0
    moments = [r.inner.state[r.params[0]]["exp_avg"] for r in (rounds, rounds2)]
    assert torch.equal(*moments)

    # restarted on another anchor (the swarm's state, downloaded): the saved pseudo-gradient goes on top of it
    model3, rounds3, _ = _low_comm(TINY)
    rounds3.resume(anchor, back.round.inner_params, back.round.feedback, back.round.steps)
    saved = [a - q for a, q in zip(anchor, back.round.inner_params)]
    assert all(torch.allclose(d, s, rtol=0, atol=1e-6) for d, s in zip(rounds3.pseudo_gradient(), saved))
    assert not torch.equal(rounds3.anchor[0], anchor[0]) and rounds3.steps == 1


def test_the_outer_momentum_is_saved_in_its_8_bits_and_an_f32_one_of_an_earlier_version_is_rounded(tmp_path):
    model, rounds, outer = _low_comm(TINY)
    gen = torch.Generator().manual_seed(0)
    for p in rounds.params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-2
    outer.step()
    ckpt.save(tmp_path, _saved_round(model, rounds, outer))
    back = ckpt.load(tmp_path)
    _, _, outer2 = _low_comm(TINY)
    outer2.load_state_dict(back.optimizer_state)
    for p, q in zip(outer.param_groups[0]["params"], outer2.param_groups[0]["params"]):
        for key in ("momentum_codes", "momentum_scales"):
            a, b = outer.state[p][key], outer2.state[q][key]
            assert a.dtype == b.dtype and a.numpy().tobytes() == b.numpy().tobytes(), key
    assert outer.state[p]["momentum_codes"].dtype == torch.int8 and outer.state[p]["momentum_scales"].any()

    # a file of an earlier version: the momentum in f32, the groups without the block
    old = outer.state_dict()
    shapes, buffers = [p.shape for p in outer.param_groups[0]["params"]], {}
    for index, state in old["state"].items():
        flat = momentum8.dequantize(state.pop("momentum_codes"), state.pop("momentum_scales")) * 1.01
        state["momentum_buffer"] = buffers[index] = flat.view(shapes[index])
    for group in old["param_groups"]:
        del group["momentum_block"]
    ckpt.save(tmp_path, ckpt.Checkpoint(params=dict(zip(dict(model.named_parameters()), rounds.anchor)),
                                        optimizer_state=old, epoch=3, losses=[], model_config=TINY, sync="low-comm"))
    back = ckpt.load(tmp_path)
    ckpt.check_fits(back, "it", model, "low-comm", feedback=True)
    assert all(g["momentum_block"] == momentum8.BLOCK for g in back.optimizer_state["param_groups"])
    for index, state in back.optimizer_state["state"].items():
        assert set(state) == {"momentum_codes", "momentum_scales"}
        codes, scales = momentum8.zeros(buffers[index])
        momentum8.quantize_(buffers[index], codes, scales)
        assert torch.equal(state["momentum_codes"], codes) and torch.equal(state["momentum_scales"], scales)
    back.optimizer_state["state"][0]["momentum_scales"] = torch.zeros(3)
    with pytest.raises(ckpt.CheckpointError, match="momentum_scales"):
        ckpt.check_fits(back, "it", model, "low-comm", feedback=True)


def test_a_checkpoint_that_does_not_fit_the_node_is_refused_with_what_differs(tmp_path):
    model, rounds, outer = _low_comm(TINY)
    _inner_step(rounds, 1)
    ckpt.save(tmp_path, _saved_round(model, rounds, outer))
    back = ckpt.load(tmp_path)
    fresh = build_model(TINY)
    with pytest.raises(ckpt.CheckpointError, match="written by a low-comm node and this node syncs per-step"):
        ckpt.check_fits(back, "it", fresh, "per-step", feedback=False)
    with pytest.raises(ckpt.CheckpointError, match="error feedback"):
        ckpt.check_fits(back, "it", fresh, "low-comm", feedback=False)
    other = build_model(ModelConfig(**{**TINY.__dict__, "d_ff": 128}))
    with pytest.raises(ckpt.CheckpointError, match="shape"):
        ckpt.check_fits(back, "it", other, "low-comm", feedback=True)
    back.round.inner_params = back.round.inner_params[:-1]
    with pytest.raises(ckpt.CheckpointError, match="inner parameters"):
        ckpt.check_fits(back, "it", fresh, "low-comm", feedback=True)
    # a file without the sync mode says it by its optimizer's state
    per_step = ckpt.Checkpoint(params=dict(fresh.named_parameters()), epoch=1, losses=[],
                               optimizer_state=make_local_optimizer(fresh, TrainConfig()).state_dict())
    assert per_step.sync_mode() == "per-step" and back.sync_mode() == "low-comm"
    with pytest.raises(ckpt.CheckpointError, match="written by a per-step node"):
        ckpt.check_fits(per_step, "it", fresh, "low-comm", feedback=True)


def test_unreadable_checkpoints_are_errors_and_old_pickles_are_not_opened(tmp_path):
    assert ckpt.load(tmp_path) is None
    (tmp_path / "state.pt").write_bytes(b"\x80\x04not unpickled")
    with pytest.raises(ckpt.CheckpointError, match="pickled checkpoint"):
        ckpt.load(tmp_path)
    (tmp_path / "state.safetensors").write_bytes(b"garbage")
    with pytest.raises(ckpt.CheckpointError, match="cannot be read"):
        ckpt.load(tmp_path)


def test_an_exported_checkpoint_loads_in_plain_transformers_with_the_same_logits(tmp_path):
    config = ModelConfig(vocab_size=50257, d_model=32, n_heads=2, n_layers=2, d_ff=64, max_seq_len=64,
                         name="dtrain-test")
    model, opt = _trained(config)
    ckpt.save(tmp_path / "c", ckpt.Checkpoint(params=dict(model.named_parameters()), optimizer_state=opt.state_dict(),
                                              epoch=4, losses=[1.0], model_config=config))
    exported = export(tmp_path / "out", checkpoint=str(tmp_path / "c"))
    assert exported.step == 5 and exported.sha256 == params_digest(model)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    ids = tokenizer("To be, or not to be", return_tensors="pt").input_ids
    assert ids.tolist() == [[2514, 307, 11, 393, 407, 284, 307]]  # GPT-2's own ids
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    card = (tmp_path / "out" / "README.md").read_text()
    assert "step 5" in card and exported.sha256 in card
    with pytest.raises(FileExistsError):  # never into a directory that holds something
        export(tmp_path / "out", checkpoint=str(tmp_path / "c"))
