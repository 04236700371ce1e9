"""The embedded broker is real Apache Kafka, loopback-only, and fails clearly."""

from __future__ import annotations

import dataclasses
import ipaddress
from pathlib import Path

import pytest

from backfill_assets.errors import BrokerError, SettingsError
from backfill_assets.stack.broker import LocalBroker, LocalKafkaCluster, new_cluster_id
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support.services import free_port


def _listening_addresses(port: int) -> set[str]:
    """IPv4 addresses in LISTEN state on ``port``, from /proc/net/tcp{,6}.

    Java listens on IPv4-mapped IPv6 sockets (::ffff:127.0.0.1); those are decoded to IPv4,
    any other IPv6 address is returned as ``ipv6:<hex>`` so the assertion fails on it.
    """
    found: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if int(hex_port, 16) != port or fields[3] != "0A":
                continue
            if len(address) == 32 and address.startswith("0000000000000000FFFF0000"):
                address = address[24:]
            if len(address) == 8:
                found.add(str(ipaddress.IPv4Address(bytes.fromhex(address)[::-1])))
            else:
                found.add(f"ipv6:{address}")
    return found


def test_broker_is_real_kafka_4_on_loopback(stack_settings: Settings) -> None:
    broker = LocalBroker(stack_settings)
    status = broker.status()
    assert status.running and status.responding
    assert status.cluster_id
    # metadata.version comes from DescribeFeatures (the admin API): the Kafka 4.1 release line.
    assert status.version is not None and status.version.startswith("4.1-")
    for port in (stack_settings.kafka.local_port, stack_settings.kafka.local_controller_port):
        assert _listening_addresses(port) == {"127.0.0.1"}, "must listen on 127.0.0.1 only"


def test_start_is_idempotent(stack_settings: Settings) -> None:
    broker = LocalBroker(stack_settings)
    before = broker.status().pid
    assert broker.start().pid == before


def test_taken_port_is_named(stack_settings: Settings, tmp_path: Path) -> None:
    other = dataclasses.replace(stack_settings, home=tmp_path)
    with pytest.raises(BrokerError, match=rf"127\.0\.0\.1:{stack_settings.kafka.local_port}"):
        LocalBroker(other).start()


def test_missing_jars_say_which_command_to_run(stack_settings: Settings, tmp_path: Path) -> None:
    other = dataclasses.replace(stack_settings, home=tmp_path, jar_cache=tmp_path / "no-jars")
    with pytest.raises(BrokerError, match="backfill-assets jars resolve"):
        LocalBroker(other).start()


def test_stop_without_a_broker_is_harmless(tmp_path: Path) -> None:
    settings = Settings.from_env({"BACKFILL_HOME": str(tmp_path)})
    assert LocalBroker(settings).stop() is False


def test_cluster_ids_never_look_like_options() -> None:
    ids = [new_cluster_id() for _ in range(2000)]
    assert not any(i.startswith("-") for i in ids)
    assert all(len(i) == 22 for i in ids) and len(set(ids)) == len(ids)


def _sasl_ssl_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {
        "BACKFILL_HOME": str(tmp_path),
        "BACKFILL_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "BACKFILL_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "BACKFILL_KAFKA_SASL_USERNAME": "backfill",
        "BACKFILL_KAFKA_SASL_PASSWORD": "p@ss:w/rd#1",
        **extra,
    }


def test_a_sasl_ssl_local_broker_names_its_missing_tls_files(tmp_path: Path) -> None:
    settings = Settings.from_env(_sasl_ssl_env(tmp_path))
    with pytest.raises(BrokerError, match=r"BACKFILL_KAFKA_SSL_KEYSTORE.*SSL_CA_LOCATION"):
        LocalBroker(settings)._write_config()


def test_a_keystore_that_is_not_a_file_names_its_variable(tmp_path: Path) -> None:
    env = _sasl_ssl_env(tmp_path, BACKFILL_KAFKA_SSL_KEYSTORE=str(tmp_path / "nope.pem"))
    with pytest.raises(SettingsError, match="BACKFILL_KAFKA_SSL_KEYSTORE"):
        Settings.from_env(env)


def test_cluster_nodes_get_own_dirs_ports_and_replicated_secure_config(tmp_path: Path) -> None:
    (tmp_path / "ks.pem").write_text("x")
    env = _sasl_ssl_env(
        tmp_path,
        BACKFILL_KAFKA_SSL_KEYSTORE=str(tmp_path / "ks.pem"),
        BACKFILL_KAFKA_SSL_CA_LOCATION=str(tmp_path / "ks.pem"),
    )
    cluster = LocalKafkaCluster(Settings.from_env(env), [(30001, 30101), (30002, 30102)])
    for node in cluster.nodes:
        node._write_config()
    one, two = (
        dict(line.split("=", 1) for line in n.config_path.read_text().splitlines())
        for n in cluster.nodes
    )
    assert cluster.nodes[1].dir == tmp_path / "kafka" / "node2"
    assert two["node.id"] == "2" and two["listeners"].startswith("SASL_SSL://127.0.0.1:30002,")
    assert one["controller.quorum.voters"] == "1@127.0.0.1:30101,2@127.0.0.1:30102"
    assert (one["default.replication.factor"], one["min.insync.replicas"]) == ("2", "2")
    assert one["listener.security.protocol.map"] == "SASL_SSL:SASL_SSL,CONTROLLER:SSL"
    assert one["allow.everyone.if.no.acl.found"] == "false"
    assert "p@ss" not in one["listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config"]
    assert cluster.bootstrap == "127.0.0.1:30001,127.0.0.1:30002"


def test_a_port_given_to_two_cluster_nodes_is_refused_before_any_starts(tmp_path: Path) -> None:
    """Two nodes on one client port: the second cannot bind, and the first answers its
    readiness check for it (a CI run's 3-node cluster ran on two nodes that way)."""
    settings = Settings.from_env({"BACKFILL_HOME": str(tmp_path)})
    with pytest.raises(BrokerError, match=r"distinct ports.*\(30001, 30101\), \(30001, 30102\)"):
        LocalKafkaCluster(settings, [(30001, 30101), (30001, 30102)])
    assert not (tmp_path / "kafka").exists()


def test_free_ports_are_never_handed_out_twice() -> None:
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
