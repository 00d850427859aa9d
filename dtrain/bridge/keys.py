"""Typed application keys shared by the bridge's routes."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
from aiohttp import web

from dtrain.bridge.gate import Gate
from dtrain.node.train.ledger import ContributorLedger
from dtrain.node.config import NodeConfig
from dtrain.node.data import TokenDataset
from dtrain.node.train.trainer import TrainingNode


@dataclass
class BridgeState:
    tensor_elements: tuple[int, ...]  # element count per tensor id, for DGRD validation
    max_packet_bytes: int  # 413 above this
    rng: np.random.Generator = field(default_factory=np.random.default_rng)


NODE = web.AppKey("node", TrainingNode)
CONFIG = web.AppKey("config", NodeConfig)
DATASET = web.AppKey("dataset", Optional[TokenDataset])
STATE = web.AppKey("state", BridgeState)
TOKENIZER = web.AppKey("tokenizer", object)
GATE = web.AppKey("gate", Gate)
LEDGER = web.AppKey("ledger", ContributorLedger)
