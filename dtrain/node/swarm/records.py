"""Per-peer records in the swarm's DHT: one dictionary entry per key, one subkey per peer, each with a lifetime."""
from __future__ import annotations

import hivemind
from hivemind.utils import get_dht_time
from hivemind.utils.logging import get_logger

logger = get_logger(__name__)

RECORD_TTL_S = 20.0  # a record expires unless its peer refreshes it
TIMEOUT_S = 5.0  # bound on one DHT store or lookup


def store(dht: hivemind.DHT, key: str, subkey: str, value: dict, timeout_s: float = TIMEOUT_S) -> bool:
    """Store one peer's record under `key` for RECORD_TTL_S; False (logged) when it fails."""
    future = dht.store(key, value, get_dht_time() + RECORD_TTL_S, subkey=subkey, return_future=True)
    try:
        return bool(future.result(timeout_s))
    except Exception as e:
        logger.warning(f"Storing {key} in the DHT failed: {e!r}")
        return False


def read(dht: hivemind.DHT, key: str, timeout_s: float = TIMEOUT_S) -> dict[str, dict]:
    """subkey -> dict value of a DHT dictionary entry; {} when it is missing or the lookup fails (logged)."""
    future = dht.get(key, latest=True, return_future=True)
    try:
        found = future.result(timeout_s)
    except Exception as e:
        logger.warning(f"Reading {key} from the DHT failed: {e!r}")
        return {}
    if found is None or not isinstance(found.value, dict):
        return {}
    return {str(k): v.value for k, v in found.value.items() if isinstance(v.value, dict)}
