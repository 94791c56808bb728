"""``broker.cluster_server``'s pure parts: the slot split and ``CLUSTER NODES`` parsing,
in redis-server 6.2's format and 7's (with a hostname after the address)."""

from __future__ import annotations

from broker.cluster_server import SLOTS, parse_cluster_nodes, slot_ranges

NODES_62 = (
    "07c3 127.0.0.1:30004@40004 slave e7d1 0 1426238317239 4 connected\n"
    "67ed 127.0.0.1:30002@40002 master - 0 1426238316232 2 connected 5461-10922\n"
    "e7d1 127.0.0.1:30001@40001 myself,master - 0 0 1 connected 0-5460 [5461->-67ed]\n"
    "9e3f 127.0.0.1:30003@40003 master,fail - 1426238316232 0 3 disconnected 10923 10924-16383\n"
)
NODE_7 = "292f 127.0.0.1:30005@40005,node-5 master,fail? - 0 0 5 connected\n"


def test_slots_are_split_into_contiguous_even_ranges_covering_all() -> None:
    assert slot_ranges(3) == [range(0, 5461), range(5461, 10922), range(10922, SLOTS)]
    for masters in (1, 3, 5, 7):
        ranges = slot_ranges(masters)
        assert [s for r in ranges for s in r] == list(range(SLOTS))
        assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


def test_cluster_nodes_lines_become_views() -> None:
    views = {v.node_id: v for v in parse_cluster_nodes(NODES_62 + NODE_7)}
    assert views["07c3"].master_id == "e7d1" and not views["07c3"].is_master
    assert views["07c3"].port == 30004 and views["07c3"].slots == ()
    assert views["e7d1"].slots == (range(0, 5461),)  # a slot on the move is left out
    assert "myself" in views["e7d1"].flags and views["e7d1"].master_id is None
    assert views["9e3f"].slots == (range(10923, 10924), range(10924, SLOTS))
    assert views["9e3f"].failing and not views["9e3f"].connected
    assert views["292f"].port == 30005 and views["292f"].failing
    assert not views["67ed"].failing and views["67ed"].is_master
