"""The AMD SEV-SNP attestation report, byte for byte (AMD's SEV-SNP firmware ABI, "ATTESTATION_REPORT").

A report is 1184 bytes, little-endian: the fields a client checks, then an ECDSA P-384 signature over
the first 0x2A0 bytes by the chip's VCEK (or the platform's VLEK). The simulation writes reports in
this same layout, so one parser and one verifier serve genuine and simulated evidence.
"""

from __future__ import annotations

import struct
import uuid
from dataclasses import dataclass, fields

REPORT_SIZE = 0x4A0
SIGNED_SIZE = 0x2A0  # the signature covers bytes [0, 0x2A0)
# The versions AMD's ABI defines (2 to 5): later ones only fill fields that version 2 left reserved,
# so every field read here sits in the same place.
REPORT_VERSIONS = (2, 3, 4, 5)
SIGNATURE_ECDSA_P384_SHA384 = 1
ECDSA_COMPONENT = 72  # r and s are each stored in 72 little-endian bytes (48 used)
REPORT_DATA_SIZE = 64

# The guest policy the guest was launched with.
POLICY_RESERVED_ONE = 1 << 17  # must be set
POLICY_MIGRATE_MA = 1 << 18  # a migration agent may be bound to the guest and export its memory
POLICY_DEBUG = 1 << 19  # the hypervisor may read and write the guest's memory
POLICY_DEFINED = (1 << 26) - 1  # higher bits are reserved and must be zero

# Which key signed the report (bits 4:2 of the signer info at 0x48); bits 31:5 are reserved.
SIGNING_KEY_VCEK = 0
SIGNING_KEY_VLEK = 1
SIGNER_INFO_DEFINED = (1 << 5) - 1

# AMD's X.509 extensions in a VCEK (AMD's VCEK certificate specification): the TCB it was derived for,
# one INTEGER per component, and the chip it belongs to, whose hwID is the report's chip_id, or
# its first 8 bytes on Turin.
_AMD = "1.3.6.1.4.1.3704.1"
SPL_OIDS = {"bootloader": f"{_AMD}.3.1", "tee": f"{_AMD}.3.2", "snp": f"{_AMD}.3.3", "microcode": f"{_AMD}.3.8",
            "fmc": f"{_AMD}.3.9"}
HWID_OID = f"{_AMD}.4"
HWID_SIZE = {"milan": 64, "genoa": 64, "turin": 8}
TCB_FIELDS = {
    "milan": ("bootloader", "tee", "snp", "microcode"),
    "genoa": ("bootloader", "tee", "snp", "microcode"),
    "turin": ("fmc", "bootloader", "tee", "snp", "microcode"),
}

# Where each field sits: (offset, struct format). Byte strings are given as "Ns".
_LAYOUT: dict[str, tuple[int, str]] = {
    "version": (0x00, "<I"),
    "guest_svn": (0x04, "<I"),
    "policy": (0x08, "<Q"),
    "family_id": (0x10, "16s"),
    "image_id": (0x20, "16s"),
    "vmpl": (0x30, "<I"),
    "signature_algo": (0x34, "<I"),
    "current_tcb": (0x38, "8s"),
    "platform_info": (0x40, "<Q"),
    "signer_info": (0x48, "<I"),
    "report_data": (0x50, "64s"),
    "measurement": (0x90, "48s"),
    "host_data": (0xC0, "32s"),
    "id_key_digest": (0xE0, "48s"),
    "author_key_digest": (0x110, "48s"),
    "report_id": (0x140, "32s"),
    "reported_tcb": (0x180, "8s"),
    "chip_id": (0x1A0, "64s"),
    "signature_r": (0x2A0, "72s"),
    "signature_s": (0x2A0 + ECDSA_COMPONENT, "72s"),
}


@dataclass(frozen=True)
class Tcb:
    """The security patch levels of a TCB_VERSION: firmware components a minimum TCB bounds."""

    bootloader: int
    tee: int
    snp: int
    microcode: int
    fmc: int = 0  # Turin and later only

    @classmethod
    def parse(cls, raw: bytes, product: str) -> Tcb:
        """Turin moved the fields (FMC first); Milan and Genoa share one layout."""
        if product == "turin":
            return cls(bootloader=raw[1], tee=raw[2], snp=raw[3], microcode=raw[7], fmc=raw[0])
        return cls(bootloader=raw[0], tee=raw[1], snp=raw[6], microcode=raw[7])

    def pack(self, product: str) -> bytes:
        raw = bytearray(8)
        if product == "turin":
            raw[0], raw[1], raw[2], raw[3] = self.fmc, self.bootloader, self.tee, self.snp
        else:
            raw[0], raw[1], raw[6] = self.bootloader, self.tee, self.snp
        raw[7] = self.microcode
        return bytes(raw)

    def below(self, minimum: Tcb) -> list[str]:
        """The components under `minimum`'s levels (empty: this TCB meets it)."""
        return [f.name for f in fields(self) if getattr(self, f.name) < getattr(minimum, f.name)]


@dataclass(frozen=True)
class SnpReport:
    """A parsed report; `raw` keeps the exact bytes, since the signature covers them and not the fields."""

    raw: bytes
    version: int
    guest_svn: int
    policy: int
    family_id: bytes
    image_id: bytes
    vmpl: int
    signature_algo: int
    current_tcb: bytes
    platform_info: int
    signer_info: int
    report_data: bytes
    measurement: bytes
    host_data: bytes
    id_key_digest: bytes
    author_key_digest: bytes
    report_id: bytes
    reported_tcb: bytes
    chip_id: bytes
    signature_r: bytes
    signature_s: bytes

    @classmethod
    def parse(cls, raw: bytes) -> SnpReport:
        if len(raw) != REPORT_SIZE:
            raise ValueError(f"an SEV-SNP report is {REPORT_SIZE} bytes, got {len(raw)}")
        values = {name: struct.unpack_from(fmt, raw, offset)[0] for name, (offset, fmt) in _LAYOUT.items()}
        return cls(raw=bytes(raw), **values)

    @property
    def signed(self) -> bytes:
        return self.raw[:SIGNED_SIZE]

    @property
    def debug(self) -> bool:
        return bool(self.policy & POLICY_DEBUG)

    @property
    def migration_agent(self) -> bool:
        return bool(self.policy & POLICY_MIGRATE_MA)

    @property
    def signing_key(self) -> int:
        return (self.signer_info >> 2) & 0b111

    def signature(self) -> tuple[int, int]:
        """The ECDSA (r, s) as integers (stored little-endian)."""
        return int.from_bytes(self.signature_r, "little"), int.from_bytes(self.signature_s, "little")


def pack_report(signature: tuple[int, int] | None = None, **values: object) -> bytes:
    """A report's 1184 bytes from field values (others zero), with `signature` (r, s) if given.

    What a simulated attester signs: `pack_report(**fields)[:SIGNED_SIZE]`.
    """
    raw = bytearray(REPORT_SIZE)
    for name, value in values.items():
        offset, fmt = _LAYOUT[name]
        struct.pack_into(fmt, raw, offset, value)
    if signature is not None:
        r, s = signature
        raw[0x2A0 : 0x2A0 + ECDSA_COMPONENT] = r.to_bytes(ECDSA_COMPONENT, "little")
        raw[0x2A0 + ECDSA_COMPONENT : 0x2A0 + 2 * ECDSA_COMPONENT] = s.to_bytes(ECDSA_COMPONENT, "little")
    return bytes(raw)


# The certificate table of an extended report (SNP_GET_EXT_REPORT, configfs-tsm's auxblob): entries of
# a GUID, an offset and a length, ended by an all-zero entry; the offsets count from the table's start.
CERT_GUIDS = {
    uuid.UUID("c0b406a4-a803-4952-9743-3fb6014cd0ae"): "ark",
    uuid.UUID("4ab7b379-bbac-4fe4-a02f-05aef327c782"): "ask",
    uuid.UUID("63da758d-e664-4564-adc5-f4b93be8accd"): "vcek",
    uuid.UUID("a8074bc2-a25a-483e-aae6-39c045a0b8a1"): "vlek",
}
_ENTRY = struct.Struct("<16sII")


def parse_cert_table(table: bytes) -> dict[str, bytes]:
    """The certificates (DER) of an extended report's table, by role: ark, ask, vcek or vlek."""
    certs: dict[str, bytes] = {}
    for start in range(0, len(table) - _ENTRY.size + 1, _ENTRY.size):
        guid, offset, length = _ENTRY.unpack_from(table, start)
        if guid == bytes(16):
            return certs
        if offset + length > len(table):
            raise ValueError("the certificate table points past its end")
        role = CERT_GUIDS.get(uuid.UUID(bytes_le=guid))
        if role is not None:
            certs[role] = table[offset : offset + length]
    raise ValueError("the certificate table has no terminating entry")
