"""Per-peer records in the swarm's DHT: one dictionary entry per key, one signed subkey per peer, each with a lifetime.

A peer stores its records under the subkey `[owner:<its RSA public key>]`, and hivemind's `RSASignatureValidator`
on every peer's DHT refuses a value under such a subkey unless the owner's private key signed it: no peer can write
another's record. The key is the peer's libp2p identity, so the subkey also names the peer: its peer id is the hash
of that public key (`peer_of`). Readers keep only signed subkeys and see them by peer id.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

import hivemind
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.logging import get_logger
from multihash import coerce_code, encode as multihash_encode

from dtrain.node.config import ConfigError

logger = get_logger(__name__)

RECORD_TTL_S = 20.0  # a record expires unless its peer refreshes it
TIMEOUT_S = 5.0  # bound on one DHT store or lookup

_OWNER_RE = re.compile(re.escape(RSASignatureValidator.PUBLIC_KEY_FORMAT).replace(b"_key_", rb"(.+?)"))


class IdentityError(ConfigError):
    """The libp2p identity file cannot sign records (unreadable, or not an RSA key)."""


class RecordOwner:
    """A peer's record signer: its libp2p identity key, the validator that signs with it, the subkey it writes."""

    def __init__(self, private_key: RSAPrivateKey):
        self.private_key = private_key
        self.validator = RSASignatureValidator(private_key)
        self.subkey: bytes = self.validator.local_public_key
        self.peer_id: str = peer_of(self.subkey)

    @classmethod
    def generate(cls) -> "RecordOwner":
        return cls(RSAPrivateKey())

    @classmethod
    def from_identity(cls, path: str | os.PathLike) -> "RecordOwner":
        """The key of a libp2p identity file (hivemind's `P2P.generate_identity` writes them)."""
        try:
            proto = crypto_pb2.PrivateKey.FromString(Path(path).read_bytes())
        except OSError as e:
            raise IdentityError(f"--identity-path {path}: cannot read it ({e.strerror})") from None
        except Exception:
            raise IdentityError(f"--identity-path {path}: not a libp2p private key file") from None
        if proto.key_type != crypto_pb2.KeyType.RSA:
            raise IdentityError(f"--identity-path {path}: a {crypto_pb2.KeyType.Name(proto.key_type)} key; peers sign "
                                f"their records with their identity, which must be RSA (delete the file and a new "
                                f"one is generated)")
        key = RSAPrivateKey.__new__(RSAPrivateKey)
        try:
            key.__setstate__({"_private_key": proto.data})  # hivemind's own unpickling path: DER bytes to a key
        except ValueError:
            raise IdentityError(f"--identity-path {path}: not a libp2p private key file") from None
        return cls(key)

    def write_identity(self, path: str | os.PathLike) -> None:
        """This key as a libp2p identity file that p2pd reads (readable by its owner only)."""
        proto = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=self.private_key.to_bytes())
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(proto.SerializeToString())


def peer_of(subkey: Any) -> Optional[str]:
    """The peer id whose identity key a signed subkey names; None for any other subkey.

    libp2p's peer id of an RSA key: the sha2-256 multihash of its protobuf-wrapped DER public key.
    """
    if not isinstance(subkey, bytes):
        return None
    match = _OWNER_RE.fullmatch(subkey)
    if match is None:
        return None
    try:  # the OpenSSH form hivemind's RSAPublicKey.to_bytes writes
        public_key = serialization.load_ssh_public_key(match.group(1))
    except Exception:
        return None
    if not isinstance(public_key, rsa.RSAPublicKey):
        return None
    der = public_key.public_bytes(encoding=serialization.Encoding.DER,
                                  format=serialization.PublicFormat.SubjectPublicKeyInfo)
    wrapped = crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.RSA, data=der).SerializeToString()
    digest = multihash_encode(hashlib.sha256(wrapped).digest(), coerce_code("sha2-256"))
    return PeerID(digest).to_base58()


def by_peer(entries: Mapping[Any, Any]) -> dict[str, Any]:
    """peer id -> value of a DHT dictionary's signed subkeys (the DHT's validator checked their signatures)."""
    found = {}
    for subkey, value in entries.items():
        peer = peer_of(subkey)
        if peer is not None:
            found[peer] = value
    return found


def store(dht: hivemind.DHT, key: str, owner: RecordOwner, value: dict, timeout_s: float = TIMEOUT_S,
          wait: bool = True) -> bool:
    """Store this peer's record under `key` for RECORD_TTL_S; False (logged) when it fails. `wait=False` returns at
    once (True) and logs a failure when the DHT reports it: a refresh nothing waits for, which over an uplink a
    state download fills takes seconds."""
    future = dht.store(key, value, get_dht_time() + RECORD_TTL_S, subkey=owner.subkey, return_future=True)
    if not wait:
        def stored(done) -> None:
            failure = None if done.cancelled() else done.exception()
            if done.cancelled() or failure is not None or not done.result():
                logger.warning(f"Storing {key} in the DHT failed: {failure or 'refused'!r}")

        future.add_done_callback(stored)
        return True
    try:
        return bool(future.result(timeout_s))
    except Exception as e:
        logger.warning(f"Storing {key} in the DHT failed: {e!r}")
        return False


def read(dht: hivemind.DHT, key: str, timeout_s: float = TIMEOUT_S) -> dict[str, dict]:
    """peer id -> dict record under `key`; {} when it is missing or the lookup fails (logged)."""
    found = lookup(dht, key, timeout_s)
    return {} if found is None else found


def lookup(dht: hivemind.DHT, key: str, timeout_s: float = TIMEOUT_S) -> Optional[dict[str, dict]]:
    """`read`, but None (logged) when the lookup fails: no answer is not the answer that no peer has a record."""
    future = dht.get(key, latest=True, return_future=True)
    try:
        found = future.result(timeout_s)
    except Exception as e:
        logger.warning(f"Reading {key} from the DHT failed: {e!r}")
        return None
    if found is None or not isinstance(found.value, dict):
        return {}
    records = by_peer({k: v.value for k, v in found.value.items()})
    return {peer: value for peer, value in records.items() if isinstance(value, dict)}


class ReadAhead:
    """DHT reads made on a thread of their own, one at a time, for a caller that must not wait for them (the training
    thread: behind an uplink that a state download fills, one lookup takes seconds). Each read is bounded
    (TIMEOUT_S) and runs on a daemon thread, which hands what it found to the caller's callback."""

    def __init__(self, dht: hivemind.DHT, name: str):
        self._dht, self._name = dht, name
        self._lock = threading.Lock()
        self._running = False

    def start(self, key: str, then: Callable[[dict[str, dict]], None]) -> bool:
        """Read `key`, then call `then` with what the read found (on the read's thread; not when the lookup
        failed: no answer is not the answer that nobody has a record). False, and nothing started, while a read is
        running."""
        with self._lock:
            if self._running:
                return False
            self._running = True

        def run() -> None:
            try:
                found = lookup(self._dht, key)
                if found is not None:
                    then(found)
            except Exception as e:  # the DHT shut down under it, or the callback failed: the next read may work
                logger.warning(f"Reading {key} from the DHT failed: {e!r}")
            finally:
                with self._lock:
                    self._running = False

        threading.Thread(target=run, name=self._name, daemon=True).start()
        return True


@contextlib.contextmanager
def identity_kwargs(owner: RecordOwner, identity_path: Optional[str] = None, fresh: bool = False) -> Iterator[dict]:
    """hivemind.DHT keyword arguments that start p2pd with `owner`'s key as its libp2p identity, so that the peer
    id is the one its records' subkey names. Without `identity_path` (a file that holds that key already) the key
    is written to a private temporary file for p2pd to read at its start, and removed when the block ends.

    hivemind checks that an identity file's peer is not running already, with a second p2pd that dials the swarm
    for it (seconds of every start). Only a file the node used before can be: a `fresh` one, made for this start,
    and a temporary one are not checked."""
    if identity_path is not None:
        yield dict(identity_path=str(identity_path), **(dict(check_if_identity_free=False) if fresh else {}))
        return
    folder = tempfile.mkdtemp(prefix="dtrain-identity-")  # mode 0700
    try:
        path = os.path.join(folder, "identity.key")
        owner.write_identity(path)
        yield dict(identity_path=path, check_if_identity_free=False)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
