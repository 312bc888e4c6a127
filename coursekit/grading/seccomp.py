"""The seccomp filter every sandboxed kernel runs under: a classic-BPF program,
assembled here with :mod:`struct` (no libseccomp), that bubblewrap loads with
``--seccomp FD`` just before it starts the kernel.

It refuses (``EPERM``) the system calls a kernel has no business making and that an
escape would start from: mounting and the new mount API, namespaces (``unshare``,
``setns``, ``clone`` with a namespace flag), ``ptrace`` and ``process_vm_*``, the
keyring, ``bpf``, ``perf_event_open``, ``userfaultfd``, ``io_uring``, kernel modules,
``kexec``, ``reboot``, swap, ``acct``, ``syslog``, ``chroot``, file handles. ``clone3``
gets ``ENOSYS`` (its flags sit in memory a filter cannot read; C libraries then fall
back to ``clone``, whose flags it can). A call of another architecture (32-bit
``int 0x80`` on x86-64) or of the x32 ABI is refused whole: the table of numbers
below would not apply to it.

x86-64 and AArch64 have a table; elsewhere :func:`program` returns None and the
sandbox runs without the filter (``sandbox.describe`` says so).
"""

from __future__ import annotations

import errno
import platform
import struct

# struct sock_filter {u16 code; u8 jt; u8 jf; u32 k}
LD_ABS, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
RET_ALLOW = 0x7FFF0000
RET_ERRNO = 0x00050000
NR, ARCH, ARG0 = 0, 4, 16  # offsets in struct seccomp_data (arg0: its low 32 bits)
X32_BIT = 0x40000000
CLONE_NS_FLAGS = (
    0x00000080  # CLONE_NEWTIME
    | 0x00020000  # CLONE_NEWNS
    | 0x02000000  # CLONE_NEWCGROUP
    | 0x04000000  # CLONE_NEWUTS
    | 0x08000000  # CLONE_NEWIPC
    | 0x10000000  # CLONE_NEWUSER
    | 0x20000000  # CLONE_NEWPID
    | 0x40000000  # CLONE_NEWNET
)

DENIED = (
    "mount umount2 pivot_root chroot open_tree move_mount fsopen fsconfig fsmount "
    "fspick mount_setattr unshare setns ptrace process_vm_readv process_vm_writev "
    "keyctl add_key request_key bpf perf_event_open userfaultfd io_uring_setup "
    "io_uring_enter io_uring_register init_module finit_module delete_module "
    "kexec_load kexec_file_load reboot swapon swapoff acct syslog name_to_handle_at "
    "open_by_handle_at iopl ioperm quotactl lookup_dcookie"
).split()

# Calls added since Linux 5.1 share one number on every architecture (the kernel's
# unified syscall table, scripts/syscall.tbl), so both tables below take them from here.
UNIFIED = dict(
    io_uring_setup=425,
    io_uring_enter=426,
    io_uring_register=427,
    open_tree=428,
    move_mount=429,
    fsopen=430,
    fsconfig=431,
    fsmount=432,
    fspick=433,
    clone3=435,
    mount_setattr=442,
)

# (AUDIT_ARCH_*, {name: number}) from the kernel's syscall tables
TABLES = {
    "x86_64": (
        0xC000003E,
        dict(
            **UNIFIED,
            mount=165,
            umount2=166,
            pivot_root=155,
            chroot=161,
            unshare=272,
            setns=308,
            ptrace=101,
            process_vm_readv=310,
            process_vm_writev=311,
            keyctl=250,
            add_key=248,
            request_key=249,
            bpf=321,
            perf_event_open=298,
            userfaultfd=323,
            init_module=175,
            finit_module=313,
            delete_module=176,
            kexec_load=246,
            kexec_file_load=320,
            reboot=169,
            swapon=167,
            swapoff=168,
            acct=163,
            syslog=103,
            name_to_handle_at=303,
            open_by_handle_at=304,
            iopl=172,
            ioperm=173,
            quotactl=179,
            lookup_dcookie=212,
            clone=56,
        ),
    ),  # fmt: skip
    "aarch64": (
        0xC00000B7,
        dict(
            **UNIFIED,
            mount=40,
            umount2=39,
            pivot_root=41,
            chroot=51,
            unshare=97,
            setns=268,
            ptrace=117,
            process_vm_readv=270,
            process_vm_writev=271,
            keyctl=219,
            add_key=217,
            request_key=218,
            bpf=280,
            perf_event_open=241,
            userfaultfd=282,
            init_module=105,
            finit_module=273,
            delete_module=106,
            kexec_load=104,
            kexec_file_load=294,
            reboot=142,
            swapon=224,
            swapoff=225,
            acct=89,
            syslog=116,
            name_to_handle_at=264,
            open_by_handle_at=265,
            quotactl=60,
            lookup_dcookie=18,
            clone=220,
        ),
    ),  # fmt: skip
}


def _assemble(code: list[tuple]) -> bytes:
    """``code``: (op, k, jt, jf) with jt/jf an int (relative) or a label name; label
    entries are ("label", name)."""
    labels, pos = {}, 0
    for ins in code:
        if ins[0] == "label":
            labels[ins[1]] = pos
        else:
            pos += 1
    out, pos = [], 0
    for ins in code:
        if ins[0] == "label":
            continue
        op, k, jt, jf = ins
        jt = labels[jt] - pos - 1 if isinstance(jt, str) else jt
        jf = labels[jf] - pos - 1 if isinstance(jf, str) else jf
        if not (0 <= jt < 256 and 0 <= jf < 256):
            raise ValueError("seccomp program: jump out of range")
        out.append(struct.pack("=HBBI", op, jt, jf, k))
        pos += 1
    return b"".join(out)


def program(machine: str | None = None) -> bytes | None:
    """The filter for this machine's architecture (``platform.machine()``), or None
    where there is no table for it."""
    machine = machine or platform.machine()
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine.lower(), machine)
    if machine not in TABLES:
        return None
    arch, nrs = TABLES[machine]
    code: list[tuple] = [
        (LD_ABS, ARCH, 0, 0),
        (JEQ, arch, 1, 0),
        (RET, RET_ERRNO | errno.EPERM, 0, 0),  # another architecture's calls
        (LD_ABS, NR, 0, 0),
    ]
    if machine == "x86_64":
        code.append((JGE, X32_BIT, "deny", 0))
    for name in DENIED:
        if name in nrs:
            code.append((JEQ, nrs[name], "deny", 0))
    code += [
        (JEQ, nrs["clone3"], "nosys", 0),
        (JEQ, nrs["clone"], 0, "allow"),
        (LD_ABS, ARG0, 0, 0),
        (JSET, CLONE_NS_FLAGS, "deny", "allow"),
        ("label", "allow"),
        (RET, RET_ALLOW, 0, 0),
        ("label", "deny"),
        (RET, RET_ERRNO | errno.EPERM, 0, 0),
        ("label", "nosys"),
        (RET, RET_ERRNO | errno.ENOSYS, 0, 0),
    ]
    return _assemble(code)
