"""The broker a fault test stops and starts again, on either stack.

Locally it is the session's single broker; on the cluster stack (support/cluster_stack.py) it
is the node leading partition 0 of the run's topic, so the run loses the leader it reads from
(the other two nodes keep the topic available, RF 3). :meth:`Victim.reading` tells when a run's
Spark read holds a connection to that node: locally from the run's own JVM (its process group);
on the cluster the read runs in the standalone cluster's executors, so it is a connection to
the node from a JVM that is not a broker, new since the victim was chosen.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backfill_assets.stack.broker import BrokerStatus, LocalBroker, LocalKafkaCluster


@dataclass
class Victim:
    node: LocalBroker
    cluster: LocalKafkaCluster | None = None  # the cluster stack's Kafka, else None
    _before: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.cluster is not None:
            self._before = _java_sockets_to(self.node.node.port, self._not_brokers())

    @property
    def bootstrap(self) -> str:
        return self.node.bootstrap

    def status(self) -> BrokerStatus:
        return self.node.status()

    def stop(self) -> bool:
        return self.node.stop()

    def start(self) -> BrokerStatus:
        if self.cluster is None:
            return self.node.start()
        self.cluster.restart(self.node.node.node_id)
        return self.node.status()

    def reading(self, run_pgid: int) -> bool:
        """Whether the run (process group ``run_pgid``) reads from this node now."""
        port = self.node.node.port
        if self.cluster is None:
            return bool(_java_sockets_to(port, lambda pid: os.getpgid(pid) == run_pgid))
        return bool(_java_sockets_to(port, self._not_brokers()) - self._before)

    def _not_brokers(self) -> Callable[[int], bool]:
        assert self.cluster is not None
        brokers = {b.running_pid() for b in self.cluster.nodes}
        return lambda pid: pid not in brokers


def victim(settings_or_cluster: object, topic: str) -> Victim:
    """The broker to stop: the local one, or the cluster node leading ``topic``'s partition 0."""
    from confluent_kafka.admin import AdminClient

    from backfill_assets.stack.broker import LocalBroker, LocalKafkaCluster

    if not isinstance(settings_or_cluster, LocalKafkaCluster):
        return Victim(LocalBroker(settings_or_cluster))  # type: ignore[arg-type]
    cluster = settings_or_cluster
    admin = AdminClient({**cluster.settings.kafka.client_config(), "log_level": 0})
    leader = admin.list_topics(topic=topic, timeout=30).topics[topic].partitions[0].leader
    (node,) = [b for b in cluster.nodes if b.node.node_id == leader]
    return Victim(node, cluster)


def _java_sockets_to(port: int, which: Callable[[int], bool]) -> set[str]:
    """Socket inodes of Java processes accepted by ``which`` (a PID test) with an established
    TCP connection to ``port`` on this host (from /proc: their sockets, matched in the TCP
    tables)."""
    inodes: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if not which(int(proc.name)):
                continue
            if not (proc / "cmdline").read_bytes().split(b"\0")[0].endswith(b"java"):
                continue
            for fd in (proc / "fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    inodes.add(link.removeprefix("socket:[").removesuffix("]"))
        except OSError:
            continue
    found: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            if fields[3] == "01" and remote_port == port and fields[9] in inodes:
                found.add(fields[9])
    return found
