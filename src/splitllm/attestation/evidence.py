"""Where a confidential server's evidence comes from: the guest's firmware, or the simulation.

On a confidential VM the report comes through Linux's configfs-tsm interface (the kernel's common
path for SEV-SNP and TDX guests since 6.7), else through `/dev/sev-guest`'s extended-report ioctl.
Neither runs on the machines this project is tested on; the code follows the kernel's ABI
(Documentation/ABI/testing/configfs-tsm, include/uapi/linux/sev-guest.h), and docs/confidential.md
says what was not run.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import tempfile
from pathlib import Path
from typing import Protocol

from splitllm.attestation.simulation import SimulatedSnp
from splitllm.attestation.snp import REPORT_DATA_SIZE, REPORT_SIZE, parse_cert_table
from splitllm.attestation.tdx import INTEL_PCS, TdxAttester
from splitllm.attestation.tdx_simulation import SimulatedTdx, is_tdx_simulation

TSM_REPORTS = Path("/sys/kernel/config/tsm/report")
SEV_GUEST = Path("/dev/sev-guest")
ATTESTATION_KINDS = ("none", "sev-snp", "tdx", "simulated")
_PROVIDERS = {"sev-snp": "sev_guest", "tdx": "tdx_guest"}


class Attester(Protocol):
    """Makes evidence whose report_data is the given 64 bytes."""

    platform: str

    def report(self, report_data: bytes) -> tuple[bytes, dict[str, bytes]]:
        """The report (SNP) or quote (TDX), and the certificates by role (ark, ask, vcek or vlek; for TDX,
        the quote's collateral)."""
        ...


class AttestationUnavailable(OSError):
    """The asked-for evidence cannot be had on this machine (a server with it refuses to start)."""


class ConfigfsTsm:
    """A report through configfs-tsm: make an entry, write report_data to inblob, read outblob and auxblob."""

    def __init__(self, platform: str) -> None:
        self.platform = platform
        provider = _PROVIDERS[platform]
        if not TSM_REPORTS.is_dir():
            raise AttestationUnavailable(
                f"{TSM_REPORTS} does not exist: this is not a confidential VM, or configfs is not mounted"
            )
        probe = Path(tempfile.mkdtemp(dir=TSM_REPORTS))  # the kernel fills a new entry with its attributes
        try:
            found = (probe / "provider").read_text().strip()
        finally:
            probe.rmdir()  # an entry's attributes go with it; they cannot be unlinked one by one
        if found != provider:
            raise AttestationUnavailable(f"the guest's attestation provider is {found}, not {provider} ({platform})")

    def report(self, report_data: bytes) -> tuple[bytes, dict[str, bytes]]:
        entry = Path(tempfile.mkdtemp(dir=TSM_REPORTS))
        try:
            (entry / "inblob").write_bytes(report_data)
            generation = (entry / "generation").read_text().strip()
            report = (entry / "outblob").read_bytes()
            aux = entry / "auxblob"
            certs = parse_cert_table(aux.read_bytes()) if self.platform == "sev-snp" and aux.exists() else {}
            if (entry / "generation").read_text().strip() != generation:
                raise RuntimeError("another writer changed the report entry while it was read")
            return report, certs
        finally:
            entry.rmdir()


class _GuestRequest(ctypes.Structure):
    _fields_ = [("msg_version", ctypes.c_uint8), ("req_data", ctypes.c_uint64), ("resp_data", ctypes.c_uint64),
                ("exitinfo2", ctypes.c_uint64)]


class _ExtReportRequest(ctypes.Structure):
    _fields_ = [("user_data", ctypes.c_uint8 * 64), ("vmpl", ctypes.c_uint32), ("reserved", ctypes.c_uint8 * 28),
                ("certs_address", ctypes.c_uint64), ("certs_len", ctypes.c_uint32)]


_SNP_GET_EXT_REPORT = (3 << 30) | (ctypes.sizeof(_GuestRequest) << 16) | (ord("S") << 8) | 0x2
_RESPONSE_SIZE = 4000
_CERT_PAGES = 4


class SevGuestDevice:
    """A report through `/dev/sev-guest` (SNP_GET_EXT_REPORT): the fallback for kernels before configfs-tsm."""

    platform = "sev-snp"

    def __init__(self) -> None:
        if not SEV_GUEST.exists():
            raise AttestationUnavailable(f"neither {TSM_REPORTS} nor {SEV_GUEST} exists: this is not an SEV-SNP guest")

    def report(self, report_data: bytes) -> tuple[bytes, dict[str, bytes]]:
        certs = mmap.mmap(-1, _CERT_PAGES * mmap.PAGESIZE)  # page-aligned, as the kernel requires
        request = _ExtReportRequest()
        ctypes.memmove(request.user_data, report_data, REPORT_DATA_SIZE)
        buffer = ctypes.c_char.from_buffer(certs)
        request.certs_address = ctypes.addressof(buffer)
        request.certs_len = len(certs)
        response = ctypes.create_string_buffer(_RESPONSE_SIZE)
        ioctl = _GuestRequest(1, ctypes.addressof(request), ctypes.addressof(response), 0)
        try:
            with open(SEV_GUEST, "rb", buffering=0) as device:
                fcntl.ioctl(device, _SNP_GET_EXT_REPORT, ioctl)
        finally:
            del buffer
        status = int.from_bytes(response.raw[0:4], "little")
        size = int.from_bytes(response.raw[4:8], "little")
        if status != 0 or size != REPORT_SIZE:
            raise RuntimeError(f"the SEV firmware answered status {status:#x} with a {size}-byte report")
        table = certs[: request.certs_len]
        certs.close()
        return response.raw[32 : 32 + REPORT_SIZE], parse_cert_table(table)


def load_attester(kind: str, simulation: str | None = None, collateral_url: str = INTEL_PCS) -> Attester | None:
    """The attester `serve --attestation KIND` runs with (None for none), checked by one report now,
    so a server that cannot attest never starts. A TDX server fetches its collateral from
    `collateral_url` (Intel's PCS, or a PCCS)."""
    if kind not in ATTESTATION_KINDS:
        raise ValueError(f"--attestation must be one of {', '.join(ATTESTATION_KINDS)}")
    if (kind == "simulated") != (simulation is not None):
        raise ValueError("--attestation simulated needs --attestation-sim DIR, and --attestation-sim needs it")
    if kind == "none":
        return None
    attester: Attester
    if kind == "simulated":
        attester = SimulatedTdx(simulation) if is_tdx_simulation(simulation) else SimulatedSnp(simulation)  # type: ignore[arg-type]
    elif kind == "tdx":
        attester = TdxAttester(ConfigfsTsm(kind), collateral_url)
    elif TSM_REPORTS.is_dir():
        attester = ConfigfsTsm(kind)
    else:
        attester = SevGuestDevice()
    report, certs = attester.report(bytes(REPORT_DATA_SIZE))
    if attester.platform == "sev-snp" and "vcek" not in certs:
        raise AttestationUnavailable("the host supplies no VCEK with the report (load it into the host's firmware "
                                     "with `snphost import`), so no client could verify this server")
    del report
    return attester

