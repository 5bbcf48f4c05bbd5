"""pyinfra deploy file for dry runs against sandbox hosts that play a GPU box.

Loads the real deploy.py after overriding the GPU facts a sandbox cannot have (from the host data key
`gemmaserve_gpu_facts`); every other fact (distro, packages, files, services) is read from the host.
Used only with `pyinfra --dry`.
"""

from pathlib import Path

from pyinfra import host
from pyinfra.api.host import Host

from roles.nvidia import NvidiaCdiDevices, NvidiaKernelModule, NvidiaPciDevices, NvidiaTopology

# RTX PRO 6000 Blackwell Server Edition's PCI id (10de:2bb5, pci.ids 2026.10.24); a PCIe box has no NVSwitch.
_gpus = [(f"0000:{0x18 + i:02x}:00.0", "2bb5") for i in range(host.data.gemmaserve_gpu_facts["gpu_count"])]
FAKE = {
    NvidiaPciDevices: {"gpus": _gpus, "nvswitches": []},
    NvidiaTopology: None,
    NvidiaKernelModule: host.data.gemmaserve_gpu_facts.get("kernel_module"),
    NvidiaCdiDevices: host.data.gemmaserve_gpu_facts.get("cdi_devices", []),
}
_real_get_fact = Host.get_fact


def _get_fact(self, cls, *args, **kwargs):
    return FAKE[cls] if cls in FAKE else _real_get_fact(self, cls, *args, **kwargs)


Host.get_fact = _get_fact
exec(compile((Path(__file__).resolve().parents[3] / "deploy.py").read_text(), "deploy.py", "exec"))
