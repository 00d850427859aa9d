"""The swarm key's pure parts (node.swarm.swarmkey, node.swarm.records): the HMAC authorizer on DHT messages, the
key file, the keyed run name, and the peer id a signed subkey names. No peer is started here (tests/test_swarm_key.py
starts real ones)."""
from __future__ import annotations

import asyncio

import pytest
from hivemind.p2p import PeerID
from hivemind.proto import dht_pb2
from hivemind.utils import get_dht_time

from dtrain.flags import parse_config
from dtrain.node.config import ConfigError, SwarmConfig
from dtrain.node.swarm.records import IdentityError, RecordOwner, by_peer, peer_of
from dtrain.node.swarm.swarmkey import (MIN_KEY_BYTES, NONCE_BYTES, SwarmKeyAuthorizer, SwarmKeyError, keyed_run_id,
                                        load_swarm_key)

pytestmark = pytest.mark.unit

KEY, OTHER_KEY = bytes(range(32)), bytes(range(1, 33))


def run(coro):
    return asyncio.run(coro)


def signed_request(authorizer: SwarmKeyAuthorizer) -> dht_pb2.StoreRequest:
    request = dht_pb2.StoreRequest(keys=[b"k" * 20], subkeys=[b"s"], values=[b"value"], expiration_time=[1e9],
                                   in_cache=[False])
    run(authorizer.sign_request(request, None))
    return request


def signed_response(authorizer: SwarmKeyAuthorizer, request) -> dht_pb2.StoreResponse:
    response = dht_pb2.StoreResponse(store_ok=[True])
    run(authorizer.sign_response(response, request))
    return response


def copy(message):
    duplicate = type(message)()
    duplicate.CopyFrom(message)
    return duplicate


# ---- the authorizer --------------------------------------------------------------------------------------------

def test_a_request_and_its_response_signed_with_the_key_are_accepted_once():
    client, server = SwarmKeyAuthorizer(KEY), SwarmKeyAuthorizer(KEY)
    request = signed_request(client)
    assert len(request.auth.nonce) == NONCE_BYTES and len(request.auth.signature) == 32
    assert run(server.validate_request(copy(request))) is True
    response = signed_response(server, request)
    assert run(client.validate_response(response, request)) is True
    # validating leaves the message as it came: its signature is still there
    assert run(SwarmKeyAuthorizer(KEY).validate_request(request)) is True and request.auth.signature


def test_a_replayed_request_is_refused():
    client, server = SwarmKeyAuthorizer(KEY), SwarmKeyAuthorizer(KEY)
    request = signed_request(client)
    assert run(server.validate_request(copy(request))) is True
    assert run(server.validate_request(copy(request))) is False


@pytest.mark.parametrize("field", ["values", "keys", "time", "nonce"])
def test_a_tampered_request_is_refused(field):
    request = signed_request(SwarmKeyAuthorizer(KEY))
    if field == "values":
        request.values[0] = b"forged"
    elif field == "keys":
        request.keys.append(b"x" * 20)
    elif field == "time":
        request.auth.time += 1.0  # within the window: only the HMAC tells
    else:
        request.auth.nonce = bytes(NONCE_BYTES)
    assert run(SwarmKeyAuthorizer(KEY).validate_request(request)) is False


def test_a_stale_or_future_request_is_refused_even_with_a_valid_hmac():
    server = SwarmKeyAuthorizer(KEY, window_s=60.0)
    late = SwarmKeyAuthorizer(KEY, clock=lambda: get_dht_time() - 61.0)
    early = SwarmKeyAuthorizer(KEY, clock=lambda: get_dht_time() + 61.0)
    in_time = SwarmKeyAuthorizer(KEY, clock=lambda: get_dht_time() - 59.0)
    assert run(server.validate_request(signed_request(late))) is False
    assert run(server.validate_request(signed_request(early))) is False
    assert run(server.validate_request(signed_request(in_time))) is True


def test_messages_of_another_key_or_of_none_are_refused():
    request = signed_request(SwarmKeyAuthorizer(OTHER_KEY))
    assert run(SwarmKeyAuthorizer(KEY).validate_request(request)) is False
    unsigned = dht_pb2.StoreRequest(keys=[b"k" * 20], values=[b"v"], expiration_time=[1e9], in_cache=[False])
    assert run(SwarmKeyAuthorizer(KEY).validate_request(unsigned)) is False
    # a response from a peer with another key, or with none
    client = SwarmKeyAuthorizer(KEY)
    request = signed_request(client)
    assert run(client.validate_response(signed_response(SwarmKeyAuthorizer(OTHER_KEY), request), request)) is False
    assert run(client.validate_response(dht_pb2.StoreResponse(store_ok=[True]), request)) is False


def test_a_response_is_bound_to_its_request_and_is_no_request():
    client, server = SwarmKeyAuthorizer(KEY), SwarmKeyAuthorizer(KEY)
    first, second = signed_request(client), signed_request(client)
    response = signed_response(server, first)
    assert run(client.validate_response(response, second)) is False  # an answer to another request
    tampered = copy(response)
    tampered.store_ok[0] = False
    assert run(client.validate_response(tampered, first)) is False
    # a request's HMAC does not verify as a response's (and the other way round): the domains differ
    as_response = dht_pb2.PingResponse()
    as_response.auth.nonce, as_response.auth.signature = first.auth.nonce, first.auth.signature
    assert run(client.validate_response(as_response, first)) is False


def test_the_authorizer_refuses_a_short_key():
    with pytest.raises(SwarmKeyError, match=f"at least {MIN_KEY_BYTES} bytes"):
        SwarmKeyAuthorizer(b"short")


# ---- the key file and the run's name -------------------------------------------------------------------------

def test_key_file_is_read_as_bytes_and_a_short_or_missing_one_is_a_clear_error(tmp_path):
    path = tmp_path / "swarm.key"
    path.write_bytes(KEY + b"\n")  # every byte counts, a trailing newline too
    assert load_swarm_key(path) == KEY + b"\n"
    path.write_bytes(b"x" * (MIN_KEY_BYTES - 1))
    with pytest.raises(SwarmKeyError, match=r"31 bytes, a key needs at least 32; make one with `head -c 32"):
        load_swarm_key(path)
    with pytest.raises(SwarmKeyError, match="no such file"):
        load_swarm_key(tmp_path / "missing.key")
    assert issubclass(SwarmKeyError, ConfigError)  # dtrain-node prints it and exits 2


def test_the_run_name_is_keyed():
    name = keyed_run_id(KEY, "demo")
    assert name.startswith("demo_") and len(name) == len("demo_") + 16
    assert name == keyed_run_id(KEY, "demo")  # every holder of the key computes the same
    assert name != keyed_run_id(OTHER_KEY, "demo") and keyed_run_id(KEY, "other") != name


def test_the_flag_reaches_its_field_and_the_swarm_is_open_without_it(tmp_path):
    assert SwarmConfig().swarm_key_path is None
    config = parse_config(["--swarm-key", str(tmp_path / "swarm.key")])
    assert config.swarm.swarm_key_path == str(tmp_path / "swarm.key")
    with pytest.raises(ConfigError, match="swarm_key_path is empty"):  # never an open swarm by accident
        parse_config(["--swarm-key", ""])


def test_a_bad_key_stops_the_swarm_before_its_dht_starts(tmp_path):
    from dtrain.node.swarm.swarm import Swarm

    path = tmp_path / "swarm.key"
    path.write_bytes(b"too short")
    config = SwarmConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",), swarm_key_path=str(path))
    with pytest.raises(SwarmKeyError, match="9 bytes"):
        Swarm(config, local_optimizer=None, local_gradients=lambda: [])  # raises before it needs either


# ---- signed subkeys --------------------------------------------------------------------------------------------

def test_a_signed_subkey_names_the_peer_id_of_its_identity(tmp_path):
    owner = RecordOwner.generate()
    path = tmp_path / "identity.key"
    owner.write_identity(path)
    assert owner.peer_id == PeerID.from_identity(path.read_bytes()).to_base58()  # what p2pd runs as
    assert RecordOwner.from_identity(path).subkey == owner.subkey
    assert peer_of(owner.subkey) == owner.peer_id


def test_only_signed_subkeys_are_read_as_peers():
    owner = RecordOwner.generate()
    entries = {owner.subkey: {"step": 1}, owner.peer_id: {"step": 2}, b"[owner:junk]": {"step": 3},
               owner.subkey + b"x": {"step": 4}, None: {"step": 5}}
    assert by_peer(entries) == {owner.peer_id: {"step": 1}}


def test_an_identity_that_is_not_an_rsa_key_is_a_clear_error(tmp_path):
    from hivemind.proto import crypto_pb2

    path = tmp_path / "ed25519.key"
    path.write_bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=b"x" * 64).SerializeToString())
    with pytest.raises(IdentityError, match="Ed25519 key; peers sign their records with their identity"):
        RecordOwner.from_identity(path)
    not_der = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=b"no DER").SerializeToString()
    for junk in (b"\xff\x00junk", not_der):
        (tmp_path / "junk.key").write_bytes(junk)
        with pytest.raises(IdentityError, match="not a libp2p private key"):
            RecordOwner.from_identity(tmp_path / "junk.key")
