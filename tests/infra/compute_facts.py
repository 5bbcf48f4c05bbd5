"""What Compute Engine does by itself, written out from Google's documents (not read from infra/), for the tests
that judge the stacks and for the fake stack the capacity soak runs."""

from __future__ import annotations

# What Compute Engine attaches by itself and the provider reads back into scratch_disks: A2 Ultra, A3 and
# A4 machine types come with a fixed number of 375 GB NVMe Local SSDs; G4 (and G2) come with none unless
# asked (https://cloud.google.com/compute/docs/disks/local-ssd#lssd_disks_fixed,
# https://cloud.google.com/compute/docs/disks/add-local-ssd).
GOOGLE_ATTACHES = {
    "a2-ultragpu-1g": 1,
    "a3-highgpu-8g": 16,
    "a3-ultragpu-8g": 32,
    "a4-highgpu-8g": 32,
    "g4-standard-384": 0,
}


def read_back_scratch_disks(machine_type: str, declared: list[dict]) -> list[tuple[str, int]]:
    """What `pulumi refresh` finds: the bundle on machine types that have one, else what was declared."""
    if GOOGLE_ATTACHES[machine_type]:
        return [("NVME", 375)] * GOOGLE_ATTACHES[machine_type]
    return [(d.get("interface", "SCSI"), d.get("size", 375)) for d in declared]
