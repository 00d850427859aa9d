"""The node's own AdamW: GPT-2's weight-decay grouping, and its state laid out for checkpoints and hivemind.

It is the inner optimizer of a low-comm node (node.lowcomm.rounds) and the optimizer hivemind.Optimizer wraps in
per-step mode; its parameters and state live on the training device.
"""
from __future__ import annotations

import torch

from dtrain.node import memory
from dtrain.node.config import TrainConfig


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW parameter groups as GPT-2 is trained (nanoGPT's rule): weight decay on the matrices (embeddings,
    attention and MLP weights), none on biases and LayerNorm weights (every tensor of fewer than 2 dimensions).

    The groups are runs of consecutive parameters, so flattening them gives `model.parameters()`'s order: the order
    of the manifest, of the gradients the node computes, and of hivemind's averaged tensors."""
    groups: list[dict] = []
    for param in model.parameters():
        decay = weight_decay if param.dim() >= 2 else 0.0
        if groups and groups[-1]["weight_decay"] == decay:
            groups[-1]["params"].append(param)
        else:
            groups.append({"params": [param], "weight_decay": decay})
    return groups


def regroup_state_dict(saved: dict, optimizer: torch.optim.Optimizer) -> dict:
    """An optimizer state_dict saved with other parameter groups (a checkpoint from before decay_groups), laid out
    as `optimizer`'s: per-parameter state is keyed by the flat parameter index, which the layouts share."""
    flat = [i for group in saved["param_groups"] for i in group["params"]]
    ours = [p for group in optimizer.param_groups for p in group["params"]]
    if len(flat) != len(ours):
        raise ValueError(f"the saved optimizer state holds {len(flat)} parameters, the model {len(ours)}")
    groups, start = [], 0
    for group in optimizer.param_groups:
        end = start + len(group["params"])
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": flat[start:end]})
        start = end
    return {"state": saved["state"], "param_groups": groups}


def make_local_optimizer(model: torch.nn.Module, train: TrainConfig) -> torch.optim.AdamW:
    """AdamW over `model`'s parameters, where they are: on a GPU the fused kernel (one launch for every tensor)."""
    cuda = next(model.parameters()).device.type == "cuda"
    optimizer = torch.optim.AdamW(
        decay_groups(model, train.weight_decay),
        lr=train.learning_rate,
        betas=(train.beta1, train.beta2),
        eps=train.eps,
        fused=True if cuda else None,
    )
    # Give AdamW its (empty) state now. hivemind otherwise creates it with a zero-gradient optimizer step, which
    # applies weight decay to the seeded weights and starts Adam's bias correction one step late. In shared memory
    # from the start (node.memory): no page is taken until the first update, or a download, writes it.
    for group in optimizer.param_groups:
        for p in group["params"]:
            zeros = (lambda: memory.shared_zeros(p.numel()).view_as(p)) if p.device.type == "cpu" and \
                p.dtype == torch.float32 else (lambda: torch.zeros_like(p, memory_format=torch.preserve_format))
            # the fused kernel reads its step count on the parameter's device
            step = torch.zeros((), dtype=torch.float32, device=p.device) if cuda else torch.tensor(0.0)
            optimizer.state[p] = {"step": step, "exp_avg": zeros(), "exp_avg_sq": zeros()}
    return optimizer
