"""CURVE: only senders whose public key the receiver lists can move blocks; keys load from files or env."""

from __future__ import annotations

import pytest
import zmq
import zmq.auth

from kvtransfer import CurveConfig
from tests.kvtransfer.conftest import poll_until
from tests.kvtransfer.peer_client import PeerProcess
from tests.kvtransfer.test_transfer import make_receiver, send, start_sender

pytestmark = pytest.mark.timeout(60)


def _keys() -> tuple[str, str]:
    public, secret = zmq.curve_keypair()
    return public.decode(), secret.decode()


def test_only_senders_with_an_admitted_key_can_transfer(peer: PeerProcess) -> None:
    server, good, stranger = _keys(), _keys(), _keys()
    curve = CurveConfig(server[0].encode(), server[1].encode(), authorized_keys=frozenset({good[0].encode()}))
    receiver, _, pool = make_receiver(curve=curve)
    with receiver:
        start_sender(peer, "curve-good", curve={"public": good[0], "secret": good[1], "server": server[0]})
        send(peer, "curve-good", "admitted", receiver.address, [1, 2], 8)
        [result] = poll_until(receiver)
        assert result.ok and peer.wait_results("curve-good")[0]["ok"]
        pool.finish(result.request_id, result.block_hashes)

        start_sender(
            peer,
            "curve-stranger",
            timeout_s=1.0,
            curve={"public": stranger[0], "secret": stranger[1], "server": server[0]},
        )
        send(peer, "curve-stranger", "stranger", receiver.address, [1, 2], 8)
        [refused] = peer.wait_results("curve-stranger")
        assert not refused["ok"] and "authentication failed" in refused["reason"]

        start_sender(peer, "curve-none", timeout_s=1.0)  # no CURVE at all
        send(peer, "curve-none", "plain", receiver.address, [1, 2], 8)
        [refused] = peer.wait_results("curve-none")
        assert not refused["ok"]
        assert receiver.poll() == [] and receiver.stats.num_failed_handshakes >= 1
        assert pool.is_clean() and pool.calls == ["allocate admitted"]
    for name in ("curve-good", "curve-stranger", "curve-none"):
        peer.call("close", name=name)


def test_keys_load_from_certificate_files(tmp_path) -> None:
    server_public_file, server_secret_file = zmq.auth.create_certificates(tmp_path, "server")
    clients = tmp_path / "clients"
    clients.mkdir()
    client_public_file, client_secret_file = zmq.auth.create_certificates(clients, "client")
    receiver_side = CurveConfig.from_files(server_secret_file, authorized_keys_dir=clients)
    sender_side = CurveConfig.from_files(client_secret_file, server_cert_file=server_public_file)
    assert sender_side.public_key in receiver_side.authorized_keys
    assert sender_side.server_public_key == receiver_side.public_key
    with pytest.raises(ValueError, match="no secret key"):
        CurveConfig.from_files(server_public_file)


def test_keys_load_from_the_environment(tmp_path) -> None:
    (public, secret), (other, _) = _keys(), _keys()
    env = {
        "PDSERVE_KV_CURVE_PUBLIC_KEY": public,
        "PDSERVE_KV_CURVE_SECRET_KEY": secret,
        "PDSERVE_KV_CURVE_SERVER_KEY": other,
        "PDSERVE_KV_CURVE_AUTHORIZED_KEYS": f"{other}, {public}",
    }
    config = CurveConfig.from_env(env)
    assert config is not None and config.server_public_key == other.encode()
    assert config.authorized_keys == frozenset({public.encode(), other.encode()})
    assert CurveConfig.from_env({}) is None
    with pytest.raises(ValueError, match="not a CURVE key"):
        CurveConfig.from_env({**env, "PDSERVE_KV_CURVE_SECRET_KEY": "short"})


def test_one_cluster_secret_admits_every_holder_and_nobody_else(peer: PeerProcess) -> None:
    """The cluster-key deployment: the receiver and its senders share one pair; another cluster's
    pair, even knowing this receiver's public key, is refused, and so is a sender without CURVE."""
    secret, other = _keys()[1], _keys()[1]
    curve = CurveConfig.for_cluster(secret)
    public = curve.public_key.decode()
    assert curve.server_public_key == curve.public_key and curve.authorized_keys == {curve.public_key}
    receiver, _, pool = make_receiver(curve=curve)
    with receiver:
        start_sender(peer, "cluster-member", curve={"public": public, "secret": secret, "server": public})
        send(peer, "cluster-member", "member", receiver.address, [1, 2], 8)
        [result] = poll_until(receiver)
        assert result.ok and peer.wait_results("cluster-member")[0]["ok"]
        pool.finish(result.request_id, result.block_hashes)
        stranger = CurveConfig.for_cluster(other)
        start_sender(peer, "cluster-stranger", timeout_s=1.0, curve={
            "public": stranger.public_key.decode(), "secret": other, "server": public,
        })
        send(peer, "cluster-stranger", "stranger", receiver.address, [1, 2], 8)
        [refused] = peer.wait_results("cluster-stranger")
        assert not refused["ok"] and "authentication failed" in refused["reason"]
        start_sender(peer, "cluster-none", timeout_s=1.0)
        send(peer, "cluster-none", "plain", receiver.address, [1, 2], 8)
        assert not peer.wait_results("cluster-none")[0]["ok"]
        assert receiver.poll() == [] and pool.is_clean() and pool.calls == ["allocate member"]
    for name in ("cluster-member", "cluster-stranger", "cluster-none"):
        peer.call("close", name=name)
