"""The weights disk: formatted once if it holds nothing, mounted at the plan's state directory at every boot."""

from __future__ import annotations

import shlex
from typing import Literal, TypedDict

from pyinfra import host
from pyinfra.api import FactBase, OperationError, operation

FSTAB = "/etc/fstab"
# The GPU VM's data disk is attached with device_name "weights" (infra/gpu_vm.py); Compute Engine links
# a disk with a custom device name as /dev/disk/by-id/google-DEVICE_NAME
# (https://cloud.google.com/compute/docs/disks/disk-symlinks).
GCE_WEIGHTS_DEVICE = "/dev/disk/by-id/google-weights"
# A TPU VM's data disk (the node's dataDisks) carries no device name: the TPU API's AttachedDisk has only
# sourceDisk, mode and workerIds (tpu v2alpha1 discovery document), and without one Compute Engine names a
# disk "persistent-disk-x" (compute v1 AttachedDisk.deviceName), the boot disk being persistent-disk-0.
# Google's TPU page (https://cloud.google.com/tpu/docs/attach-durable-block-storage) finds the disk with
# lsblk and names no by-id link; this default is not checked on a real TPU VM. base_weights_device overrides it.
TPU_WEIGHTS_DEVICE = "/dev/disk/by-id/google-persistent-disk-1"
# Google's format and mount options for a Persistent Disk or Hyperdisk volume
# (https://cloud.google.com/compute/docs/disks/format-mount-disk-linux): no reserved blocks, inode tables and
# journal initialised now rather than lazily in the background, discard; mounted with discard, and nofail so
# a missing disk never stops the VM from booting.
MKFS = "mkfs.ext4 -m 0 -E lazy_itable_init=0,lazy_journal_init=0,discard"
# What writes under the state directory at boot and has no WorkingDirectory= there: nofail mounts are not
# ordered before local-fs.target (systemd.mount(5)), so these units are ordered after the mount explicitly.
# vllm@.service sets WorkingDirectory= to the state directory, which already gives it Requires= and After=
# on the mount (systemd.exec(5), "Implicit Dependencies"): a replica never starts on the boot disk's copy.
STATE_DIR_WRITERS = ("gemmaserve-weights.service", "gemmaserve-cache-restore.service")
MOUNT_OPTIONS = ",".join(("discard", "defaults", "nofail", *(f"x-systemd.before={u}" for u in STATE_DIR_WRITERS)))
# Where a fresh file system is mounted for a moment to take what the state directory already holds.
STAGING = "/run/gemmaserve-weights-disk"
FILESYSTEMS = ("ext4", "xfs")


class DataDiskState(TypedDict):
    """What DataDisk reads (see its docstring)."""

    kind: Literal["absent", "not-a-block-device", "unreadable", "block"]
    device: str
    probe: int
    type: str
    pttype: str
    uuid: str
    children: int
    mounted: list[str]
    source_at_mount_point: str
    fstab: list[str]
    entries: int | None


class DataDisk(FactBase[DataDiskState]):
    """A data disk and the mount point it should have, in one command: the device the stable name resolves
    to, blkid's low-level probe of it (exit status 2 is "nothing found"; a device that cannot be read is
    reported as such, never probed, because blkid answers 2 for it too), its partitions, where it is
    mounted, what is mounted at the mount point, the mount point's /etc/fstab lines and how many entries
    the mount point directory holds (None: no such directory):

    .. code:: python

        {"kind": "block", "device": "/dev/sdb", "probe": 0, "type": "ext4", "pttype": "",
         "uuid": "3f0c4bd5-5b7e-4b8e-9a39-5f0f6f1e2a77", "children": 0, "mounted": ["/var/lib/gemmaserve"],
         "source_at_mount_point": "/dev/sdb",
         "fstab": ["UUID=3f0c4bd5-5b7e-4b8e-9a39-5f0f6f1e2a77 /var/lib/gemmaserve ext4 discard,... 0 2"],
         "entries": 3}
    """

    def command(self, device: str, mount_point: str) -> str:
        dev, mp = shlex.quote(device), shlex.quote(mount_point)
        return (
            f"dev={dev}; mp={mp}; "
            'if [ ! -e "$dev" ]; then echo absent; else real=$(readlink -f "$dev"); '
            'if [ ! -b "$real" ]; then echo "not-a-block-device $real"; '
            'elif [ ! -r "$real" ]; then echo "unreadable $real"; '
            'else echo "block $real"; '
            'out=$(blkid -p -o export "$real" 2>/dev/null); echo "probe $?"; '
            "printf '%s\\n' \"$out\" | sed -n 's/^\\(TYPE\\|PTTYPE\\|UUID\\)=/\\1 /p'; "
            'echo "children $(lsblk -nr -o NAME "$real" 2>/dev/null | tail -n +2 | wc -l)"; '
            "findmnt -rn -o TARGET --source \"$real\" | sed 's/^/mounted /'; fi; fi; "
            "findmnt -rn -o SOURCE --mountpoint \"$mp\" | sed 's/^/at /'; "
            f'awk -v mp="$mp" \'$1 !~ /^#/ && $2 == mp {{print "fstab " $0}}\' {FSTAB} 2>/dev/null; '
            'if [ -d "$mp" ]; then echo "entries $(ls -A "$mp" | wc -l)"; fi'
        )

    def process(self, output: list[str]) -> DataDiskState:
        state: DataDiskState = {
            "kind": "absent",
            "device": "",
            "probe": -1,
            "type": "",
            "pttype": "",
            "uuid": "",
            "children": 0,
            "mounted": [],
            "source_at_mount_point": "",
            "fstab": [],
            "entries": None,
        }
        for line in output:
            key, _, value = line.strip().partition(" ")
            if key in ("absent", "not-a-block-device", "unreadable", "block"):
                state["kind"], state["device"] = key, value
            elif key in ("probe", "children", "entries"):
                state[key] = int(value)
            elif key in ("TYPE", "PTTYPE", "UUID"):
                state[key.lower()] = value
            elif key == "mounted":
                state["mounted"].append(value)
            elif key == "at":
                state["source_at_mount_point"] = value
            elif key == "fstab":
                state["fstab"].append(value)
        return state


def fstab_line(uuid: str, mount_point: str, fs_type: str) -> str:
    """The mount point's /etc/fstab line: by UUID, Google's options; ext4 is checked at boot (pass 2),
    XFS has no boot-time check (fsck.xfs does nothing)."""
    return f"UUID={uuid} {mount_point} {fs_type} {MOUNT_OPTIONS} 0 {2 if fs_type == 'ext4' else 0}"


def _refuse(device: str, state: DataDiskState) -> str | None:
    """Why the disk must be left alone (a reason), or None when it is blank or holds a file system we mount."""
    if state["kind"] == "not-a-block-device":
        return f"{device} resolves to {state['device']}, which is not a block device"
    if state["kind"] == "unreadable":
        return f"{device} ({state['device']}) cannot be read: its contents cannot be checked (is the deploy root?)"
    if state["children"]:
        return f"{device} ({state['device']}) holds {state['children']} partition(s) or other block devices"
    if state["probe"] == 0 and state["pttype"]:
        return f"{device} ({state['device']}) holds a {state['pttype']} partition table"
    if state["probe"] == 0 and state["type"] not in FILESYSTEMS:
        return f"{device} ({state['device']}) holds {state['type'] or 'an unknown signature'}"
    if state["probe"] not in (0, 2):
        return f"{device} ({state['device']}): blkid's probe ended with status {state['probe']} (ambivalent or failed)"
    return None


@operation()
def weights_disk(device: str | None, mount_point: str, required: bool = False):
    """Mount the weights disk at `mount_point` now and at every boot (an /etc/fstab line by UUID), making an
    ext4 file system on it first only when it holds nothing at all. With no device, or no disk at the
    device's path (not `required`), nothing changes: weights stay on the boot disk."""
    if device is None:
        host.noop("no weights disk on this host: weights stay on the boot disk")
        return
    state = host.get_fact(DataDisk, device=device, mount_point=mount_point)
    if not state:
        raise OperationError(f"{device}: the disk's state could not be read, so it is left alone")
    if state["kind"] == "absent":
        if required:
            raise OperationError(f"base_weights_device = {device!r}: no such device on this host")
        host.noop(f"no disk at {device}: weights stay on the boot disk")
        return
    reason = _refuse(device, state)
    if reason:
        raise OperationError(
            f"{reason}. gemmaserve formats only a disk that holds nothing ({', '.join(FILESYSTEMS)} are mounted "
            "as they are): wipe it yourself if it is yours to erase, or set base_weights_device: none"
        )
    elsewhere = [m for m in state["mounted"] if m != mount_point]
    if elsewhere:
        raise OperationError(f"{device} ({state['device']}) is mounted at {', '.join(elsewhere)}, not {mount_point}")
    if state["source_at_mount_point"] and state["source_at_mount_point"] != state["device"]:
        raise OperationError(
            f"{mount_point} is already a mount of {state['source_at_mount_point']}, not of {device} ({state['device']})"
        )
    dev, mp = shlex.quote(device), shlex.quote(mount_point)
    escaped = mount_point.replace(".", "\\.")
    drop_other_lines = f"sed -i -E '\\#^\\s*[^#[:space:]]\\S*\\s+{escaped}\\s#d' {FSTAB}"
    if state["probe"] == 2:
        # Blank: blkid found no file system, partition table or other signature. It probes again right before
        # mkfs, so a disk that gained one since the fact was read fails here instead of being formatted.
        yield f"blkid -p {dev} >/dev/null 2>&1; [ $? -eq 2 ] && {MKFS} {dev}"
        if state["entries"] is not None:
            # What the state directory already holds (a host deployed before it had this disk) moves with it,
            # owner and mode included, so later roles find what they read before the mount.
            yield (
                f"mkdir -p {STAGING} && mount -o discard {dev} {STAGING} && "
                f"{{ cp -a {mp}/. {STAGING}/; copied=$?; umount {STAGING} && rmdir {STAGING} && [ $copied -eq 0 ]; }}"
            )
        line = fstab_line("$uuid", mount_point, "ext4")
        yield (
            f'uuid=$(blkid -p -s UUID -o value {dev}) && [ -n "$uuid" ] && {drop_other_lines} && '
            f'echo "{line}" >> {FSTAB}'
        )
        yield "systemctl daemon-reload"
        # udev links the new UUID (/dev/disk/by-uuid) once mkfs closes the device: wait for it before mounting.
        yield f"udevadm settle; mkdir -p {mp} && mount {mp}"
        return
    wanted = fstab_line(state["uuid"], mount_point, state["type"])
    mounted = state["source_at_mount_point"] == state["device"]
    if state["fstab"] == [wanted] and mounted:
        host.noop(f"{device} ({state['type']}, UUID={state['uuid']}) is mounted at {mount_point}, in {FSTAB}")
        return
    if state["fstab"] != [wanted]:
        yield f"{drop_other_lines} && echo {shlex.quote(wanted)} >> {FSTAB}"
        yield "systemctl daemon-reload"
    if not mounted:
        yield f"mkdir -p {mp} && mount {mp}"
