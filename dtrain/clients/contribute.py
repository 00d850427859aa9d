"""`dtrain-contribute`: the reference Python contributor, doing over HTTP what a browser does.

One round: make sure the local model is the node's current step (info, manifest, every tensor),
take a batch (the node's /api/v1/data/batch or a local text file), compute the loss and gradients,
keep the top-k fraction with error feedback, send a DGRD packet. A 409 means the model moved on:
refetch it and go on. Only the standard library talks HTTP (urllib), every request has a timeout.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
from hivemind.utils.logging import get_logger, use_hivemind_log_handler

from dtrain.bridge import dgrd
from dtrain.node.config import DEFAULT_STATIC_DIR, ModelConfig
from dtrain.node.model import build_model

logger = get_logger(__name__)

MODES = ("sparse", "compressed", "dense")
FORMATS = {"f16": np.dtype("<f2"), "f32": np.dtype("<f4")}
MAX_DOWNLOAD_TRIES = 5  # the model may move during a download; start over at most this often


class ContributeError(RuntimeError):
    """The node answered something a contributor cannot go on from; the message says what."""


@dataclass(frozen=True)
class ContributeConfig:
    node_url: str  # base URL of the node's bridge, e.g. http://127.0.0.1:8095
    data_path: Optional[str] = None  # local text file; None takes batches from the node
    fmt: str = "f16"  # download format of the parameters: f16 or f32
    topk: float = 0.01  # fraction of each gradient tensor sent (sparse and compressed modes)
    mode: str = "sparse"  # sparse (DGRD Mode 1), compressed (Mode 2) or dense (Mode 3)
    batch_size: int = 4  # sequences per round
    seq_len: int = 32  # tokens per sequence
    node_id: str = ""  # contributor id in packets; empty picks a random one
    timeout_s: float = 60.0  # bound on one HTTP request
    seed: int = 0  # for batches drawn from a local file
    wait_update_s: float = 0.0  # after an accepted packet, wait up to this long for the step to move; 0: don't

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.fmt not in FORMATS:
            raise ValueError(f"format must be f16 or f32, got {self.fmt!r}")
        if not 0 < self.topk <= 1:
            raise ValueError(f"--topk must be in (0, 1], got {self.topk}")
        if self.batch_size < 1 or self.seq_len < 2:
            raise ValueError("--batch-size must be >= 1 and --seq-len >= 2")


class Contributor:
    def __init__(self, config: ContributeConfig):
        self.config = config
        self.base = config.node_url.rstrip("/")
        self.node_id = config.node_id or f"py-{uuid.uuid4().hex[:8]}"
        self.model: Optional[torch.nn.Module] = None
        self.model_config: Optional[ModelConfig] = None
        self.step = 0  # the step of the parameters the local model holds
        self.residual: list[np.ndarray] = []  # error feedback: what top-k left out, per tensor
        self.pending_residual: list[np.ndarray] = []  # the last packet's residual: kept once it is accepted
        self._dataset = None
        self._rng = np.random.default_rng(config.seed)
        if config.data_path:
            from dtrain.node.data import TokenDataset
            from dtrain.node.tokenizer import load_tokenizer
            self._dataset = TokenDataset.from_text_file(config.data_path, load_tokenizer(DEFAULT_STATIC_DIR))

    # ---- HTTP ---------------------------------------------------------------------------------------------

    def _request(self, path: str, body: Optional[bytes] = None) -> tuple[int, dict, bytes]:
        headers = {"Content-Type": "application/octet-stream"} if body is not None else {}
        req = urllib.request.Request(self.base + path, data=body, headers=headers,
                                     method="POST" if body is not None else "GET")
        try:
            with urllib.request.urlopen(req, timeout=self.config.timeout_s) as r:
                return r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()

    def _get(self, path: str) -> tuple[dict, bytes]:
        status, headers, data = self._request(path)
        if status != 200:
            raise ContributeError(f"GET {path}: {status} {data[:200]!r}")
        return headers, data

    def _get_json(self, path: str):
        return json.loads(self._get(path)[1])

    # ---- the model ----------------------------------------------------------------------------------------

    def fetch_model(self) -> int:
        """Download every tensor of one step into the local model; returns that step."""
        info = self._get_json("/api/v1/model/info")
        model_config = ModelConfig(**info["config"])
        if self.model is None or model_config != self.model_config:
            self.model, self.model_config = build_model(model_config), model_config
            self.residual = [np.zeros(p.numel(), np.float32) for p in self.model.parameters()]
        params = list(self.model.named_parameters())
        dtype = FORMATS[self.config.fmt]
        for _ in range(MAX_DOWNLOAD_TRIES):
            manifest = self._get_json("/api/v1/model/manifest")
            step, entries = manifest["step"], manifest["tensors"]
            if len(entries) != len(params):
                raise ContributeError(f"manifest has {len(entries)} tensors, the model {len(params)}")
            arrays = []
            for entry, (name, p) in zip(entries, params):
                if list(p.shape) != entry["shape"]:
                    raise ContributeError(f"tensor {entry['id']} ({name}): shape {entry['shape']} != {list(p.shape)}")
                headers, data = self._get(f"/api/v1/model/tensor/{entry['id']}?format={self.config.fmt}")
                if int(headers["X-Model-Step"]) != step:
                    break  # the model moved during the download: start over
                if len(data) != entry["elements"] * dtype.itemsize:
                    raise ContributeError(f"tensor {entry['id']}: {len(data)} bytes for {entry['elements']} elements")
                arrays.append(np.frombuffer(data, dtype).astype(np.float32))
            else:
                with torch.no_grad():
                    for (_, p), a in zip(params, arrays):
                        p.copy_(torch.from_numpy(a).view_as(p))
                self.step = step
                return step
        raise ContributeError(f"the model moved during {MAX_DOWNLOAD_TRIES} downloads in a row")

    # ---- one round ----------------------------------------------------------------------------------------

    def next_batch(self) -> np.ndarray:
        """[batch_size, seq_len] token ids."""
        bs, seq_len = self.config.batch_size, self.config.seq_len
        if self._dataset is not None:
            return self._dataset.batch(bs, seq_len, self._rng)
        headers, data = self._get(f"/api/v1/data/batch?batch_size={bs}&seq_len={seq_len}")
        rows, cols = int(headers["X-Batch-Size"]), int(headers["X-Seq-Len"])
        if len(data) != rows * cols * 4:
            raise ContributeError(f"data batch: {len(data)} bytes for shape [{rows}, {cols}] of u32")
        return np.frombuffer(data, "<u4").reshape(rows, cols)

    def compute(self, batch: np.ndarray) -> tuple[float, list[np.ndarray]]:
        """Mean loss over the batch and its gradient, one flat float32 array per tensor id."""
        x = torch.from_numpy(np.asarray(batch, np.int64))
        self.model.zero_grad(set_to_none=True)
        loss = self.model(input_ids=x, labels=x).loss
        loss.backward()
        grads = [np.zeros(p.numel(), np.float32) if p.grad is None else p.grad.reshape(-1).numpy().copy()
                 for p in self.model.parameters()]
        return float(loss.item()), grads

    def make_packet(self, step: int, loss: float, grads: Sequence[np.ndarray], samples: int) -> bytes:
        """A DGRD packet of the mode asked for; the part not sent waits in the residual for next round."""
        mode = self.config.mode
        if mode == "dense":
            self.pending_residual = self.residual
            sections = [(tid, None, g) for tid, g in enumerate(grads)]
            return dgrd.encode(step, self.node_id, loss, samples, sections, flags=dgrd.FLAGS_MODE1)
        corrected = [g + r for g, r in zip(grads, self.residual)]
        sections = dgrd.topk_sections(corrected, self.config.topk)
        residual = [c.copy() for c in corrected]
        for tid, idx, values in sections:
            # what the node receives: f16 for Mode 2 and dense sections, f32 for Mode 1
            half = idx is None or mode == "compressed"
            sent = values.astype(np.float16).astype(np.float32) if half else values
            if idx is None:
                residual[tid] -= sent
            else:
                residual[tid][idx] -= sent
        self.pending_residual = residual
        flags = dgrd.FLAGS_MODE2 if mode == "compressed" else dgrd.FLAGS_MODE1
        return dgrd.encode(step, self.node_id, loss, samples, sections, flags=flags)

    def submit(self, packet: bytes) -> dict:
        """POST the packet; the node's JSON answer with its HTTP status under "status"."""
        status, _, data = self._request("/api/v1/train/submit", packet)
        try:
            answer = json.loads(data)
        except ValueError:
            raise ContributeError(f"submit: {status} with a body that is not JSON: {data[:200]!r}") from None
        if status == 200:
            self.residual = self.pending_residual
        elif status != 409:
            raise ContributeError(f"submit: {status} {answer.get('message')}")
        return {**answer, "status": status}

    def _wait_for_update(self) -> None:
        """Bounded wait for the node to apply what it has (the next round is then computed on fresh parameters)."""
        deadline = time.monotonic() + self.config.wait_update_s
        while time.monotonic() < deadline:
            if self._get_json("/api/v1/model/info")["step"] != self.step:
                return
            time.sleep(0.05)

    def run(self, steps: int) -> dict:
        """`steps` rounds; returns counts of accepted and conflicting submissions, bytes and losses."""
        summary = {"accepted": 0, "conflicts": 0, "bytes_sent": 0, "losses": []}
        self.fetch_model()
        for i in range(steps):
            if self._get_json("/api/v1/model/info")["step"] != self.step:
                self.fetch_model()
            batch = self.next_batch()
            loss, grads = self.compute(batch)
            packet = self.make_packet(self.step, loss, grads, samples=batch.shape[0])
            started = time.monotonic()
            answer = self.submit(packet)
            summary["bytes_sent"] += len(packet)
            summary["losses"].append(loss)
            logger.info(f"round {i + 1}/{steps}: loss {loss:.4f} at step {self.step}, {len(packet):,} bytes, "
                        f"{answer['status']} (server step {answer.get('server_step')}) "
                        f"in {time.monotonic() - started:.2f}s")
            if answer["status"] == 409:
                summary["conflicts"] += 1
                self.fetch_model()
            else:
                summary["accepted"] += 1
                self._wait_for_update()
        return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dtrain-contribute",
                                description="Contribute gradients to a dtrain node over Training API v1.")
    p.add_argument("--node", required=True, help="node URL, e.g. http://127.0.0.1:8095")
    p.add_argument("--data", help="local text file to train on (default: batches from the node)")
    p.add_argument("--format", default="f16", choices=sorted(FORMATS), help="parameter download format")
    p.add_argument("--topk", type=float, default=0.01, help="fraction of each gradient sent (default 0.01)")
    p.add_argument("--mode", default="sparse", choices=MODES, help="DGRD mode (default sparse)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per round (default 4)")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sequence (default 32)")
    p.add_argument("--steps", type=int, default=10, help="rounds to run (default 10)")
    p.add_argument("--node-id", default="", help="contributor id (default random)")
    p.add_argument("--timeout", type=float, default=60.0, help="bound on one HTTP request, seconds")
    p.add_argument("--wait-update", type=float, default=0.0,
                   help="after an accepted packet, wait up to this many seconds for the node to update (default 0)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        config = ContributeConfig(node_url=args.node, data_path=args.data, fmt=args.format, topk=args.topk,
                                  mode=args.mode, batch_size=args.batch_size, seq_len=args.seq_len,
                                  node_id=args.node_id, timeout_s=args.timeout,
                                  wait_update_s=args.wait_update)
    except ValueError as e:
        print(f"dtrain-contribute: {e}", file=sys.stderr)
        sys.exit(2)
    use_hivemind_log_handler("in_root_logger")
    logging.getLogger().setLevel("INFO")
    try:
        summary = Contributor(config).run(args.steps)
    except (ContributeError, OSError) as e:
        print(f"dtrain-contribute: {e}", file=sys.stderr)
        sys.exit(1)
    logger.info(f"done: {summary['accepted']} accepted, {summary['conflicts']} conflicts, "
                f"{summary['bytes_sent']:,} bytes sent")


if __name__ == "__main__":
    main()
