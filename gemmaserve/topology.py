"""GPU topology (`nvidia-smi topo -m`) -> tensor-parallel groups that share the fastest links and one NUMA
node, with each replica's CPU and NUMA affinity. Pure: the host's output comes in as text."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from itertools import combinations

# The legend `nvidia-smi topo -m` prints, fastest first: NV# (bonded NVLinks), PIX (at most one PCIe
# bridge), PXB (several bridges, no host bridge), PHB (through a host bridge), NODE (between host bridges
# of one NUMA node), SYS (across the SMP interconnect between NUMA nodes).
PCIE_RANK = {"PIX": 4, "PXB": 3, "PHB": 2, "NODE": 1, "SYS": 0}


@dataclass(frozen=True)
class GpuTopology:
    """Link kinds between GPUs (by nvidia-smi index, which is PCI bus order) and each GPU's CPUs/NUMA node."""

    links: dict[tuple[int, int], str]
    cpu_affinity: dict[int, str]
    numa_node: dict[int, int | None]

    @property
    def gpus(self) -> list[int]:
        return sorted(self.cpu_affinity)

    def score(self, a: int, b: int) -> int:
        """Higher is faster: any NVLink beats PCIe; more bonded links beat fewer."""
        kind = self.links[(a, b)]
        if kind.startswith("NV"):
            return 100 + int(kind[2:])
        return PCIE_RANK.get(kind, -1)


def parse_topo_matrix(text: str) -> GpuTopology:
    """Parse `nvidia-smi topo -m` (GPU rows only; NIC/NVMe columns and the legend are ignored)."""
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    header_at = next((i for i, line in enumerate(lines) if re.match(r"^\s*GPU0\s", line)), None)
    if header_at is None:
        raise ValueError("not `nvidia-smi topo -m` output: no GPU0 header")
    header = lines[header_at].split()
    devices = [c for c in header if re.fullmatch(r"(GPU|NIC|NVMe)\d+", c)]
    links: dict[tuple[int, int], str] = {}
    cpus: dict[int, str] = {}
    numa: dict[int, int | None] = {}
    for line in lines[header_at + 1 :]:
        match = re.match(r"^GPU(\d+)\s+(.*)$", line.strip())
        if not match:
            continue
        row = int(match.group(1))
        cells = match.group(2).split()
        for column, cell in zip(devices, cells, strict=False):
            if column.startswith("GPU") and int(column[3:]) != row:
                links[(row, int(column[3:]))] = cell
        # After the device columns: CPU Affinity, NUMA Affinity (and GPU NUMA ID on newer drivers).
        rest = cells[len(devices) :]
        cpus[row] = rest[0] if rest and rest[0] != "N/A" else ""
        numa[row] = int(rest[1]) if len(rest) > 1 and rest[1].isdigit() else None
    if not cpus:
        raise ValueError("not `nvidia-smi topo -m` output: no GPU rows")
    return GpuTopology(links=links, cpu_affinity=cpus, numa_node=numa)


def _group_key(topology: GpuTopology, group: tuple[int, ...]) -> tuple:
    pairs = list(combinations(group, 2))
    worst = min((topology.score(a, b) for a, b in pairs), default=0)
    total = sum(topology.score(a, b) for a, b in pairs)
    one_numa = len({topology.numa_node[g] for g in group}) == 1
    # Best: the slowest pair is as fast as possible, then one NUMA node, then the fastest overall, then the
    # lowest indexes (a stable, predictable choice when the topology does not prefer one).
    return (worst, one_numa, total, tuple(-g for g in group))


def tensor_parallel_groups(topology: GpuTopology, tp: int, replicas: int) -> list[list[int]]:
    """`replicas` disjoint groups of `tp` GPUs, each chosen greedily by its slowest link, then NUMA locality."""
    free = topology.gpus
    if tp * replicas > len(free):
        raise ValueError(f"{replicas} replicas x TP{tp} need {tp * replicas} GPUs, the topology shows {len(free)}")
    groups = []
    for _ in range(replicas):
        best = max(combinations(free, tp), key=lambda g: _group_key(topology, g))
        groups.append(list(best))
        free = [g for g in free if g not in best]
    return sorted(groups)


def with_topology(plan, topology: GpuTopology):
    """The plan with each replica's devices chosen from the topology and its CPU/NUMA affinity set.

    Devices are nvidia-smi indexes, which equal CUDA's only with CUDA_DEVICE_ORDER=PCI_BUS_ID (the plan
    sets it on NVIDIA hosts)."""
    if not plan.replicas:
        return plan
    tp = plan.replicas[0].tensor_parallel_size
    groups = tensor_parallel_groups(topology, tp, len(plan.replicas))
    replicas = []
    for replica, group in zip(plan.replicas, groups, strict=True):
        env = dict(replica.env)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, group))
        nodes = {topology.numa_node[g] for g in group}
        cpus = {topology.cpu_affinity[g] for g in group}
        replicas.append(
            replace(
                replica,
                devices=group,
                env=env,
                cpu_affinity=cpus.pop() if len(cpus) == 1 else "",
                numa_node=nodes.pop() if len(nodes) == 1 else None,
            )
        )
    return replace(plan, replicas=replicas)
