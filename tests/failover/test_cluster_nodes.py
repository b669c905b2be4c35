"""The test Cluster itself: a node restarted after its bus port was taken comes back.

Each node's cluster bus port is chosen free once per session; a node restarted later (a
test that kills a master) can find it taken by any other process. A CI rehearsal beside a
soak saw six Cluster tests error at setup that way ("Address already in use").
"""

from __future__ import annotations

import socket

from tests.support.cluster_topology import ClusterTopology


def test_a_node_whose_bus_port_was_taken_restarts_on_another(cluster: ClusterTopology) -> None:
    cluster.wait_healthy()
    node = cluster.replica_of(cluster.masters()[0])
    node.stop()
    taken = node.bus_port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        # (the stopped node's own connections may leave the port in TIME_WAIT)
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        node.start()
    assert node.bus_port != taken
    cluster.wait_healthy()  # the other nodes reach it on its new bus port
