"""The alpha-beta model against the ring formulas and Megatron's TP volume (shared/reference/formulas.md)."""
import math

import pytest

from cost_models.collectives import collective_time, tp_layer_collectives, wire_bytes
from cost_models.hardware import Link, load_hardware
from cost_models.topology import crosses_nodes, mesh_links

ALPHA, W = 7e-6, 123e9
LINK = Link("test", bandwidth=W, latency=ALPHA)


@pytest.mark.parametrize("n", [2, 3, 4, 8, 64])
@pytest.mark.parametrize("S", [1.0, 4096.0, 3e8])
def test_ring_formulas(n, S):
    ar = 2 * (n - 1) / n * S / W + 2 * (n - 1) * ALPHA
    ag = (n - 1) / n * S / W + (n - 1) * ALPHA
    assert collective_time("all_reduce", S, n, LINK) == pytest.approx(ar, rel=1e-12)
    assert collective_time("all_gather", S, n, LINK) == pytest.approx(ag, rel=1e-12)
    assert collective_time("reduce_scatter", S, n, LINK) == pytest.approx(ag, rel=1e-12)
    zero_alpha = Link("bw", bandwidth=W, latency=0.0)
    assert collective_time("all_to_all", S, n, zero_alpha) == pytest.approx((n - 1) / n * S / W, rel=1e-12)
    assert collective_time("send_recv", S, n, LINK) == pytest.approx(S / W + ALPHA, rel=1e-12)


def test_tree_all_reduce_has_log_latency_and_auto_picks_the_faster():
    n, small, big = 64, 8.0, 1e9
    tree_small = collective_time("all_reduce", small, n, LINK, "tree")
    assert tree_small == pytest.approx(2 * math.log2(n) * ALPHA + 2 * small / W)
    assert collective_time("all_reduce", small, n, LINK, "auto") == tree_small
    # at two ranks the ring moves half the bytes of the tree: ring wins for big messages
    assert collective_time("all_reduce", big, 2, LINK, "auto") == collective_time("all_reduce", big, 2, LINK, "ring")


def test_group_of_one_costs_nothing():
    assert collective_time("all_reduce", 1e9, 1, LINK) == 0.0


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("t", [2, 4, 8])
def test_megatron_tp_volume_per_layer(t, sp):
    b, s, h = 2, 2048, 4096
    colls = tp_layer_collectives(b, s, h, t, sequence_parallel=sp, dtype_bytes=1)
    volume = sum(wire_bytes(kind, nbytes, n) for kind, nbytes, n in colls)
    assert volume == pytest.approx(8 * b * s * h * (t - 1) / t)
    kinds = {k for k, _, _ in colls}
    assert kinds == ({"all_gather", "reduce_scatter"} if sp else {"all_reduce"})
    assert len(colls) == (8 if sp else 4)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="kind"):
        collective_time("gossip", 1.0, 2, LINK)
    with pytest.raises(ValueError, match="group_size"):
        collective_time("all_reduce", 1.0, 0, LINK)


def test_mesh_links_keeps_inner_dims_in_node():
    h100 = load_hardware("h100_sxm")
    topo = mesh_links((4, 2, 8), ("pp", "dp", "tp"), h100)
    assert [d.inter_node for d in topo.dims] == [True, True, False]
    assert topo["tp"].link == h100.intra_node and topo["dp"].link == h100.inter_node
    topo = mesh_links((16, 2, 4), ("dp", "pp", "tp"), h100)
    assert [d.inter_node for d in topo.dims] == [True, False, False]
    # an intra-node dim is faster than the same collective across nodes
    assert topo["tp"].time("all_reduce", 1e8) < mesh_links((4,), ("dp",), h100, devices_per_node=1).dims[0].time("all_reduce", 1e8)


def test_crosses_nodes_when_blocks_do_not_tile_a_node():
    assert crosses_nodes((3,), 0, 8)       # 3 ranks per group: some groups straddle two nodes
    assert not crosses_nodes((2, 4), 1, 8)
    assert not crosses_nodes((2, 4), 0, 8)
    assert crosses_nodes((4, 4), 0, 8)
    assert not crosses_nodes((16, 1), 1, 8)


def test_cross_node_rings_spread_over_the_nics_of_the_members_in_each_node():
    """One NIC per GPU (DGX): a dp group with k members per node rings over k NICs at once
    (NCCL channels), up to the intra-node link; a group with one member per node, and
    point-to-point traffic, keep one NIC."""
    a100 = load_hardware("a100_80gb")
    nic, nvl = a100.inter_node.bandwidth, a100.intra_node.bandwidth
    tp1 = mesh_links((32, 1), ("dp", "tp"), a100)["dp"]       # 8 members per node
    tp2 = mesh_links((32, 2), ("dp", "tp"), a100)["dp"]       # 4
    tp8 = mesh_links((32, 8), ("dp", "tp"), a100)["dp"]       # 1
    assert (tp1.rails, tp2.rails, tp8.rails) == (8, 4, 1)
    assert tp1.link_for("all_reduce").bandwidth == min(8 * nic, nvl)
    assert tp2.link_for("reduce_scatter").bandwidth == 4 * nic
    assert tp8.link_for("all_reduce") == a100.inter_node
    assert tp1.link_for("send_recv") == a100.inter_node and tp1.link_for("all_to_all") == a100.inter_node
    assert tp1.time("all_reduce", 1e9) < tp2.time("all_reduce", 1e9) < tp8.time("all_reduce", 1e9)
    # inside a node nothing changes
    assert mesh_links((8,), ("dp",), a100)["dp"].rails == 1


def test_a_measured_bus_bandwidth_curve_prices_ring_collectives_by_message_size():
    """A100 NVLink, nccl-tests all-reduce busbw (Azure ND A100 v4): mid-size messages run far
    below the asymptote, which the datasheet alpha-beta misses; point-to-point keeps alpha-beta."""
    from cost_models.collectives import bus_bandwidth

    a100 = load_hardware("a100_80gb")
    tp = mesh_links((8,), ("tp",), a100)["tp"]
    link = a100.intra_node
    assert bus_bandwidth(link, 2**25) == pytest.approx(132.77e9)        # a measured point
    assert bus_bandwidth(link, 2**26 * 1.5) == pytest.approx(
        166.63e9 + (174.18e9 - 166.63e9) * math.log(1.5) / math.log(2))   # between points: log-linear
    assert bus_bandwidth(link, 2**40) == pytest.approx(231.58e9)         # held beyond the last point
    s = 50e6   # one Megatron-175B all-reduce (b=1, s=2048, h=12288, fp16)
    want = 2 * 7 / 8 * s / bus_bandwidth(link, s)
    assert tp.time("all_reduce", s) == pytest.approx(want)
    assert want > 1.4 * collective_time("all_reduce", s, 8, Link("plain", link.bandwidth, link.latency), "ring", 0.8)
    assert tp.time("send_recv", s) == pytest.approx(s / (link.bandwidth * 0.8) + link.latency)
    with pytest.raises(ValueError, match="busbw"):
        Link("bad", 1e9, 1e-6, busbw=((2e6, 1e9), (1e6, 2e9)))
