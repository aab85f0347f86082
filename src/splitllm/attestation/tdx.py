"""Intel TDX evidence: a DCAP quote (version 4) and the collateral Intel publishes for its platform.

The server sends the quote with its collateral (TCB info, QE identity, CRLs and their issuer chains),
fetched where it runs; the client verifies offline. dcap-qvl (Phala Network's verifier, MIT; why this
library: docs/confidential.md) checks the PCK chain up to Intel's SGX root pinned in this package and
the CRLs, the QE report's signature by the PCK key and its binding to the attestation key, the quote's
signature by that key, the TCB info and QE identity (signed by Intel's TCB signing key, current at
the given time), the TD's attributes, and the platform's TCB status. This module then checks what a
generic verifier cannot: that status against the policy's floor, report_data against the handshake,
and the TD's measurements against the policy. The first failure raises one `AttestationError`
naming its check; genuine and simulated evidence go through the same code.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import threading
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

import dcap_qvl
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from splitllm.attestation.policy import PolicyError, _hex_set
from splitllm.attestation.verify import AttestationError

PLATFORM = "tdx"
QUOTE_VERSION = 4
TEE_TYPE_TDX = 0x81
COLLATERAL = "collateral"  # the evidence's `certs` entry that carries the collateral (dcap-qvl's JSON)
INTEL_ROOT = "intel-sgx-root"
INTEL_PCS = "https://api.trustedservices.intel.com"
# Intel's TCB statuses a policy may accept; "Revoked" is never accepted.
STATUSES = ("UpToDate", "SWHardeningNeeded", "ConfigurationNeeded", "ConfigurationAndSWHardeningNeeded",
            "OutOfDate", "OutOfDateConfigurationNeeded")
_MEASUREMENT_SIZE = 48
_REGISTERS = ("mrtd", "rtmr0", "rtmr1", "rtmr2", "rtmr3")
_POLICY_KEYS = {"trust_anchor", "measurements", "tcb_statuses", "mr_config_ids"}

# dcap-qvl reports a refusal as one message; the check it belongs to, by the first of these words it
# contains (lower case; the most specific first). A message none of them names is still a refusal.
_LIBRARY_CHECKS = (
    ("qe isvsvn", "qe"), ("certrevoked", "chain"), ("crl", "collateral"), ("revocation", "collateral"),
    ("quote_collateral", "collateral"), ("tcbinfo", "collateral"), ("tcb info", "collateral"),
    ("qe identity", "collateral"), ("fmspc", "collateral"),
    ("certificate chain", "chain"), ("pck certificate", "chain"), ("root ca", "chain"),
    ("isv enclave report signature", "signature"), ("qe report", "qe"), ("qe_report", "qe"), ("qe ", "qe"),
    ("debug mode", "debug"), ("td attributes", "td_attributes"), ("sept_ve_disable", "td_attributes"),
    ("td profiling", "td_attributes"), ("td migration", "td_attributes"), ("servtd", "td_attributes"),
    ("tcb level", "tcb"), ("tcb status", "tcb"), ("tdx module", "tcb"),
)


@cache
def intel_root() -> x509.Certificate:
    """Intel's SGX Root CA, which signs every PCK, TCB-signing and CRL-issuing chain (a copy in
    splitllm/attestation/intel, its fingerprint in the NOTICE there)."""
    pem = (resources.files("splitllm.attestation") / "intel" / "sgx_root_ca.pem").read_bytes()
    return x509.load_pem_x509_certificate(pem)


def _hex(value: Any, name: str, size: int) -> bytes:
    if not isinstance(value, str):
        raise PolicyError(f"'{name}' must be a hex string")
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raise PolicyError(f"'{name}': {value!r} is not hex") from None
    if len(raw) != size:
        raise PolicyError(f"'{name}': {value!r} is {len(raw)} bytes, expected {size}")
    return raw


@dataclass(frozen=True)
class TdImage:
    """One trusted TD: MRTD (its firmware, measured at build) and RTMR0-2 (what the firmware measured at
    boot: its configuration, the kernel, the command line and initrd). RTMR3, which the guest extends at
    run time, is bound only when given."""

    mrtd: bytes
    rtmr0: bytes
    rtmr1: bytes
    rtmr2: bytes
    rtmr3: bytes | None = None

    @classmethod
    def from_dict(cls, data: Any) -> TdImage:
        if not isinstance(data, dict) or set(data) - set(_REGISTERS) or not set(_REGISTERS[:4]) <= set(data):
            raise PolicyError("each of 'measurements' is {\"mrtd\", \"rtmr0\", \"rtmr1\", \"rtmr2\": 96 hex each, "
                              "\"rtmr3\" optional}")
        return cls(**{k: _hex(v, k, _MEASUREMENT_SIZE) for k, v in data.items()})

    def matches(self, report: TdReport) -> bool:
        mine = (self.mrtd, self.rtmr0, self.rtmr1, self.rtmr2)
        if mine != (report.mr_td, report.rt_mr0, report.rt_mr1, report.rt_mr2):
            return False
        return self.rtmr3 is None or self.rtmr3 == report.rt_mr3


@dataclass(frozen=True)
class TdxPolicy:
    """The `tdx` section of a policy: Intel's root (or a simulated one), the trusted images, the TCB
    statuses accepted, and optionally the MRCONFIGIDs accepted."""

    root: x509.Certificate
    pinned: bool
    images: tuple[TdImage, ...]
    tcb_statuses: frozenset[str] = frozenset({"UpToDate"})
    mr_config_ids: frozenset[bytes] | None = None

    @classmethod
    def from_dict(cls, data: Any, base: Path) -> TdxPolicy:
        if not isinstance(data, dict):
            raise PolicyError("'tdx' must be a JSON object")
        unknown = sorted(set(data) - _POLICY_KEYS)
        if unknown:
            raise PolicyError(f"unknown keys in 'tdx': {', '.join(unknown)} (known: {', '.join(sorted(_POLICY_KEYS))})")
        root, pinned = _anchor(data.get("trust_anchor", INTEL_ROOT), base)
        images = data.get("measurements")
        if not isinstance(images, list) or not images:
            raise PolicyError("'tdx' needs 'measurements': the MRTD and RTMR0-2 of each server image to trust")
        statuses = data.get("tcb_statuses", ["UpToDate"])
        if (not isinstance(statuses, list) or not all(isinstance(s, str) for s in statuses)
                or not set(statuses) <= set(STATUSES) or "UpToDate" not in statuses):
            raise PolicyError(f"'tcb_statuses' lists the TCB statuses accepted: UpToDate and any of "
                              f"{', '.join(STATUSES[1:])}")
        configs = _hex_set(data["mr_config_ids"], "mr_config_ids",
                           _MEASUREMENT_SIZE) if "mr_config_ids" in data else None
        return cls(root=root, pinned=pinned, images=tuple(TdImage.from_dict(i) for i in images),
                   tcb_statuses=frozenset(statuses), mr_config_ids=configs)


def _anchor(spec: Any, base: Path) -> tuple[x509.Certificate, bool]:
    """Intel's pinned root by name, or a root from a file: Intel's own, or a simulated vendor that does not
    bear the name of Intel's root."""
    if spec == INTEL_ROOT:
        return intel_root(), True
    if not isinstance(spec, dict) or set(spec) != {"root"} or not isinstance(spec["root"], str):
        raise PolicyError(f"'trust_anchor' is \"{INTEL_ROOT}\" or {{\"root\": PEM path}}")
    try:
        root = x509.load_pem_x509_certificate((base / spec["root"]).read_bytes())
    except (OSError, ValueError) as exc:
        raise PolicyError(f"trust anchor {spec}: {exc}") from None
    if root.subject == intel_root().subject and root != intel_root():
        raise PolicyError(f"trust anchor {spec['root']}: it bears the name of Intel's SGX root but is not that root")
    return root, root == intel_root()


@dataclass(frozen=True)
class TdReport:
    """The TD report body of a quote: what the TD module measured and the 64 bytes the guest chose."""

    mr_td: bytes
    rt_mr0: bytes
    rt_mr1: bytes
    rt_mr2: bytes
    rt_mr3: bytes
    mr_config_id: bytes
    mr_owner: bytes
    mr_owner_config: bytes
    td_attributes: bytes
    mr_seam: bytes
    tee_tcb_svn: bytes
    report_data: bytes

    @property
    def measurement(self) -> bytes:
        """MRTD: the launch measurement, as `measurement` is for SEV-SNP."""
        return self.mr_td


@dataclass(frozen=True)
class TdxVerified:
    """A quote that passed every check: its TD report, the platform's FMSPC and its TCB status."""

    report: TdReport
    product: str  # the FMSPC: the platform's family, model, stepping and SKU
    status: str
    advisory_ids: tuple[str, ...]
    simulated: bool


def parse_quote(quote: bytes) -> tuple[TdReport, str]:
    """The TD report and FMSPC of a TDX quote of version 4; `evidence` error for anything else."""
    try:
        parsed = dcap_qvl.parse_quote(quote)
        fmspc = parsed.fmspc()
    except ValueError as exc:
        raise AttestationError("evidence", f"the TDX quote cannot be parsed ({exc})") from None
    header = parsed.header
    if header.tee_type != TEE_TYPE_TDX or header.version != QUOTE_VERSION:
        raise AttestationError("evidence", f"not a TDX quote of version {QUOTE_VERSION} (version {header.version}, "
                                           f"TEE type {header.tee_type:#x})")
    body = parsed.report
    report = TdReport(**{name: getattr(body, name) for name in TdReport.__dataclass_fields__})
    return report, fmspc


def _refusal(message: str) -> AttestationError:
    """The library's refusal as the check it failed, its message on one line."""
    message = message.removeprefix("Verification failed: ").replace("\n\nCaused by:\n    ", ": ")
    lower = message.lower()
    check = next((check for words, check in _LIBRARY_CHECKS if words in lower), "quote")
    return AttestationError(check, f"Intel's verification refused the quote or its collateral ({message})")


def verify_quote(quote: bytes, collateral: bytes, root: x509.Certificate, now: datetime.datetime) -> tuple[str,
                                                                                                           tuple[str,
                                                                                                                 ...]]:
    """Intel's verification of the quote with its collateral at `now`, chaining to `root`: the platform's
    TCB status and the advisories that apply. An `AttestationError` naming the step that failed."""
    try:
        collateral_v3 = dcap_qvl.QuoteCollateralV3.from_json(collateral.decode())
    except (ValueError, UnicodeDecodeError) as exc:
        raise AttestationError("evidence", f"the quote's collateral is malformed ({exc})") from None
    chain = dcap_qvl.parse_quote(quote).cert_chain_pem_bytes()
    try:
        pck_root = x509.load_pem_x509_certificates(chain)[-1] if chain else None
    except ValueError:
        pck_root = None
    if pck_root != root:
        raise AttestationError("chain",
                               "the quote's PCK chain does not end at the trusted root "
                               f"({root.subject.rfc4514_string()})")
    root_der = root.public_bytes(serialization.Encoding.DER)
    try:
        verified = dcap_qvl.verify_with_root_ca(quote, collateral_v3, root_der, int(now.timestamp()))
    except ValueError as exc:
        raise _refusal(str(exc)) from None
    return verified.status, tuple(verified.advisory_ids)


def verify_tdx(
    quote: bytes, collateral: bytes | None, policy: TdxPolicy, expected_report_data: bytes,
    now: datetime.datetime | None = None,
) -> TdxVerified:
    """Every check of a TDX quote, in order: Intel's verification (chain, QE, signature, collateral, TD
    attributes), the TCB status floor, the handshake binding, then the policy's measurements. The
    caller checks what the binding covers (model, split) against its own."""
    now = now or datetime.datetime.now(datetime.UTC)
    if collateral is None:
        raise AttestationError("evidence", "the TDX evidence carries no collateral")
    report, fmspc = parse_quote(quote)
    status, advisories = verify_quote(quote, collateral, policy.root, now)
    if status not in policy.tcb_statuses:
        listed = f" ({', '.join(advisories)})" if advisories else ""
        raise AttestationError("tcb", f"the platform's TCB status is {status}{listed}; the policy accepts "
                                      f"{', '.join(sorted(policy.tcb_statuses))}")
    check_td(report, policy, expected_report_data)
    return TdxVerified(report, fmspc, status, advisories, not policy.pinned)


def check_td(report: TdReport, policy: TdxPolicy, expected_report_data: bytes) -> None:
    """The TD report of a verified quote against the handshake and the policy."""
    if report.report_data != expected_report_data:
        raise AttestationError(
            "binding", "the quote was not made for this handshake (its report_data does not match the nonce and "
                       "the server's key): replayed, or relayed under another key"
        )
    if not any(image.matches(report) for image in policy.images):
        raise AttestationError("measurement", f"the TD's MRTD {report.mr_td.hex()[:16]}... and RTMRs are not one of "
                                              f"the policy's images")
    if policy.mr_config_ids is not None and report.mr_config_id not in policy.mr_config_ids:
        raise AttestationError("mr_config_id", f"MRCONFIGID {report.mr_config_id.hex()} is not in the policy's list")


class QuoteSource(Protocol):
    """Where quotes come from: configfs-tsm in a TD, or the simulation."""

    def report(self, report_data: bytes) -> tuple[bytes, dict[str, bytes]]: ...


def _expiry(collateral: str) -> datetime.datetime:
    """When the first part of the collateral (TCB info, QE identity or a CRL) expires."""
    data = json.loads(collateral)
    dates: list[datetime.datetime | None] = [
        datetime.datetime.fromisoformat(json.loads(data[k])["nextUpdate"]) for k in ("tcb_info", "qe_identity")
    ]
    dates += [x509.load_der_x509_crl(bytes.fromhex(data[k])).next_update_utc for k in ("pck_crl", "root_ca_crl")]
    return min(d for d in dates if d is not None)


class TdxAttester:
    """A TDX quote with the collateral a client needs to verify it offline, fetched from Intel's PCS (or a
    PCCS) once and again when any part of it expires."""

    platform = PLATFORM

    def __init__(self, source: QuoteSource, collateral_url: str = INTEL_PCS) -> None:
        self.source = source
        self.collateral_url = collateral_url
        self._lock = threading.Lock()
        self._collateral: str | None = None
        self._expires = datetime.datetime.min.replace(tzinfo=datetime.UTC)

    def report(self, report_data: bytes) -> tuple[bytes, dict[str, bytes]]:
        quote, _ = self.source.report(report_data)
        with self._lock:
            if self._collateral is None or datetime.datetime.now(datetime.UTC) >= self._expires:
                collateral = _fetch_collateral(self.collateral_url, quote)
                self._collateral, self._expires = collateral, _expiry(collateral)
            return quote, {COLLATERAL: self._collateral.encode()}


def _fetch_collateral(url: str, quote: bytes) -> str:
    """The collateral of this platform (its FMSPC and PCK CA, read from the quote) as dcap-qvl's JSON."""
    async def fetch() -> str:
        return (await dcap_qvl.get_collateral(url, quote)).to_json()

    try:
        return asyncio.run(fetch())
    except (ValueError, RuntimeError) as exc:
        raise OSError(f"no TDX collateral from {url}: {exc}") from None
