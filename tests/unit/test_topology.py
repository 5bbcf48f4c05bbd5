"""Tensor-parallel groups and CPU/NUMA affinity from real `nvidia-smi topo -m` outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

from gemmaserve.plan import plan
from gemmaserve.spec import parse_spec
from gemmaserve.topology import parse_topo_matrix, tensor_parallel_groups, with_topology

RECORDED = Path(__file__).resolve().parents[1] / "roles" / "fixtures" / "recorded"


def topo(name: str):
    return parse_topo_matrix((RECORDED / name).read_text())


def test_parses_links_cpus_and_numa_of_a_real_hgx_h100() -> None:
    h100 = topo("h100_hgx_topo_m.txt")
    assert h100.gpus == list(range(8))
    assert h100.links[(0, 7)] == "NV18"
    assert h100.cpu_affinity[0] == "0-51,104-155" and h100.cpu_affinity[7] == "52-103,156-207"
    assert h100.numa_node == {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 1, 7: 1}


def test_pcie_pairs_share_a_switch_and_a_numa_node() -> None:
    pcie = topo("pcie8_topo_m.txt")
    assert tensor_parallel_groups(pcie, 2, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # TP4 never mixes the two sockets (SYS) while a socket-local group exists.
    assert tensor_parallel_groups(pcie, 4, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_nvswitch_groups_stay_on_one_numa_node() -> None:
    h100 = topo("h100_hgx_topo_m.txt")
    assert tensor_parallel_groups(h100, 4, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_groups_follow_the_topology_not_the_index() -> None:
    """The same real matrix with its GPU rows listed in another bus order (what a different PCIe slot
    population looks like to nvidia-smi): the PIX partner of GPU0 is now GPU2, and the plan follows."""
    text = (RECORDED / "pcie8_topo_m.txt").read_text()
    swapped = text.replace("GPU1", "GPUX").replace("GPU2", "GPU1").replace("GPUX", "GPU2")
    groups = tensor_parallel_groups(parse_topo_matrix(swapped), 2, 4)
    assert [0, 2] in groups and [1, 3] in groups


def test_plan_takes_devices_and_affinity_from_the_topology() -> None:
    host_plan = plan(
        parse_spec(
            {
                "model": "31b",
                "accelerator": {"kind": "h100-80gb", "count": 8},
                "serving": {"tensor_parallel_size": 4, "replicas": 2},
            }
        )
    ).require_ok()
    placed = with_topology(host_plan, topo("h100_hgx_topo_m.txt"))
    assert [r.devices for r in placed.replicas] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in placed.replicas] == ["0,1,2,3", "4,5,6,7"]
    assert [(r.cpu_affinity, r.numa_node) for r in placed.replicas] == [("0-51,104-155", 0), ("52-103,156-207", 1)]
    assert all(r.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" for r in placed.replicas)


def test_refuses_what_the_topology_cannot_hold() -> None:
    with pytest.raises(ValueError, match="need 16 GPUs, the topology shows 8"):
        tensor_parallel_groups(topo("h100_hgx_topo_m.txt"), 8, 2)
    with pytest.raises(ValueError, match="no GPU0 header"):
        parse_topo_matrix((RECORDED / "mi300x_rocm_smi.txt").read_text())
