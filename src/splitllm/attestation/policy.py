"""What a client requires of a confidential server before it sends anything: the attestation policy.

A policy is a JSON file:

    {
      "platform": "sev-snp",
      "trust_anchors": ["amd-milan", "amd-genoa", "amd-turin"],
      "measurements": ["<96 hex: the launch digest of the server image>"],
      "min_tcb": {"genoa": {"snp": 27, "microcode": 86}},
      "allow_debug": false,
      "allow_migration_agent": false,
      "host_data": ["<64 hex>"],
      "image_ids": ["<32 hex>"],
      "weights": ["<64 hex: a loaded-weights fingerprint, from `splitllm attest weights`>"]
    }

`trust_anchors` names AMD's roots pinned in this package (`amd-<product>`); a file anchor
(`{"product": "milan", "ark": "ark.pem", "ask": "ask.pem"}`, paths relative to the policy) that is
not one of AMD's roots is a simulated vendor and is accepted only with `"simulated": true`, and then
only without AMD's roots beside it. Each product has a TCB floor (`TCB_FLOORS`) that `min_tcb` may
raise and never lower. `host_data` and `image_ids` are optional: when given, the report's field must
be one of them. `weights`, optional too, lists the loaded-weights fingerprints (weights/loaded.py)
the server's layers may be built from; an image that reads its weights from outside what its
measurement covers needs it. Every other key, at every level, and every key given twice are refused,
so a misspelt or doubled requirement is never silently dropped.

A policy for Intel TDX says `"platform": "tdx"` and has its requirements in a `tdx` section
(splitllm/attestation/tdx.py reads it with the same strictness; docs/confidential.md shows one);
`weights`, which names what the server loaded rather than anything of the platform, stays beside it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography import x509

from splitllm.attestation.snp import TCB_FIELDS, Tcb

if TYPE_CHECKING:
    from splitllm.attestation.tdx import TdxPolicy

PRODUCTS = ("milan", "genoa", "turin")
PLATFORMS = ("sev-snp", "tdx")
_KEYS = {"platform", "trust_anchors", "measurements", "min_tcb", "allow_debug", "allow_migration_agent", "host_data",
         "image_ids", "weights", "simulated", "tdx"}
_ANCHOR_KEYS = {"product", "ark", "ask"}

# The lowest TCB accepted on each product, whatever the policy says: the reported TCB of the genuine
# evidence this release is tested with (docs/confidential.md says where each comes from). Firmware
# below it has known flaws; AMD's security bulletins say when to raise it.
TCB_FLOORS: dict[str, Tcb] = {
    "milan": Tcb(bootloader=4, tee=0, snp=24, microcode=219),
    "genoa": Tcb(bootloader=10, tee=0, snp=23, microcode=84),
    "turin": Tcb(fmc=1, bootloader=1, tee=1, snp=4, microcode=81),
}


class PolicyError(ValueError):
    """A policy file that cannot be used as written."""


@dataclass(frozen=True)
class Anchor:
    """A vendor root (ARK) and the certificate of its signing key (ASK) for one product line."""

    product: str
    ark: x509.Certificate
    ask: x509.Certificate
    pinned: bool  # AMD's own root, shipped in this package


@cache
def pinned_anchor(product: str) -> Anchor:
    """AMD's ARK and ASK for a product line, as AMD publishes them (copies in splitllm/attestation/amd)."""
    folder = resources.files("splitllm.attestation") / "amd" / product
    ark = x509.load_pem_x509_certificate((folder / "ark.pem").read_bytes())
    ask = x509.load_pem_x509_certificate((folder / "ask.pem").read_bytes())
    return Anchor(product, ark, ask, pinned=True)


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are each given once: with a key given twice, which value wins is a parser's accident."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise PolicyError(f"key {key!r} is given twice")
        out[key] = value
    return out


def _hex_set(value: Any, name: str, size: int) -> frozenset[bytes]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise PolicyError(f"'{name}' must be a list of hex strings")
    out = set()
    for v in value:
        try:
            raw = bytes.fromhex(v)
        except ValueError:
            raise PolicyError(f"'{name}': {v!r} is not hex") from None
        if len(raw) != size:
            raise PolicyError(f"'{name}': {v!r} is {len(raw)} bytes, expected {size}")
        out.add(raw)
    return frozenset(out)


def _flag(data: dict[str, Any], name: str) -> bool:
    value = data.get(name, False)
    if not isinstance(value, bool):
        raise PolicyError(f"'{name}' must be true or false")
    return value


def _weights(data: dict[str, Any]) -> frozenset[bytes] | None:
    """The loaded-weights fingerprints a policy names (SHA-256 digests), whatever its platform; None: any."""
    return _hex_set(data["weights"], "weights", 32) if "weights" in data else None


def _min_tcb(value: Any) -> dict[str, Tcb]:
    """Each product's minimum: its floor, with the levels the policy gives in place of the floor's."""
    if not isinstance(value, dict) or set(value) - set(PRODUCTS):
        raise PolicyError(
            f"'min_tcb' maps products ({', '.join(PRODUCTS)}) to levels, e.g. {{\"genoa\": {{\"snp\": 27}}}}"
        )
    out = dict(TCB_FLOORS)
    for product, levels in value.items():
        names = TCB_FIELDS[product]
        if not isinstance(levels, dict) or set(levels) - set(names) or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 256 for v in levels.values()
        ):
            raise PolicyError(f"'min_tcb' {product}: maps some of {', '.join(names)} to levels 0-255")
        out[product] = dataclasses.replace(TCB_FLOORS[product], **levels)
    return out


@dataclass(frozen=True)
class AttestationPolicy:
    anchors: tuple[Anchor, ...]
    measurements: frozenset[bytes]
    min_tcb: Mapping[str, Tcb] = field(default_factory=lambda: dict(TCB_FLOORS))
    allow_debug: bool = False
    allow_migration_agent: bool = False
    host_data: frozenset[bytes] | None = None
    image_ids: frozenset[bytes] | None = None
    weights: frozenset[bytes] | None = None
    simulated: bool = False
    source: str = "<policy>"
    tdx: TdxPolicy | None = None  # a TDX policy's requirements (then the SEV-SNP fields are empty)

    @property
    def platform(self) -> str:
        return "sev-snp" if self.tdx is None else "tdx"

    def __post_init__(self) -> None:
        """The floors hold however a policy is made: from a file, or in code."""
        for product, floor in TCB_FLOORS.items():
            minimum = self.min_tcb.get(product)
            low = minimum.below(floor) if minimum is not None else ["every level"]
            if low:
                raise PolicyError(f"'min_tcb' {product}: {', '.join(low)} below this release's floor "
                                  f"({', '.join(f'{n} {getattr(floor, n)}' for n in TCB_FIELDS[product])}); "
                                  f"a policy may raise the floor, never lower it")

    @classmethod
    def load(cls, path: str | os.PathLike) -> AttestationPolicy:
        path = Path(path).expanduser()
        try:
            data = json.loads(path.read_text(), object_pairs_hook=_unique)
            return cls.from_dict(data, path.parent, str(path))
        except (OSError, json.JSONDecodeError, PolicyError) as exc:
            raise PolicyError(f"attestation policy {path}: {exc}") from None

    @classmethod
    def from_dict(cls, data: Any, base: Path, source: str = "<policy>") -> AttestationPolicy:
        if not isinstance(data, dict):
            raise PolicyError("must be a JSON object")
        unknown = sorted(set(data) - _KEYS)
        if unknown:
            raise PolicyError(f"unknown keys {', '.join(unknown)} (known: {', '.join(sorted(_KEYS))})")
        platform = data.get("platform", "sev-snp")
        if platform not in PLATFORMS:
            raise PolicyError(f"platform {platform!r}: one of {', '.join(PLATFORMS)}")
        simulated = _flag(data, "simulated")
        if platform == "tdx" or "tdx" in data:
            return cls._tdx(data, base, source, simulated)
        specs = data.get("trust_anchors", [])
        if not isinstance(specs, list) or not specs:
            raise PolicyError("'trust_anchors' must list at least one root (amd-milan, amd-genoa, amd-turin)")
        anchors = tuple(_anchor(a, base) for a in specs)
        if simulated and any(a.pinned for a in anchors):
            raise PolicyError("\"simulated\": true beside AMD's roots: a policy trusts AMD or a simulated vendor, "
                              "never both")
        if not simulated and not all(a.pinned for a in anchors):
            raise PolicyError(
                "it trusts a root that is not AMD's (a simulated vendor, which protects nothing); "
                "it is accepted only in a policy that says \"simulated\": true"
            )
        if "measurements" not in data:
            raise PolicyError("'measurements' must list the launch digests of the server images to trust")
        measurements = _hex_set(data["measurements"], "measurements", 48)
        if not measurements:
            raise PolicyError("'measurements' is empty: no server image would be trusted")
        return cls(
            anchors=anchors,
            measurements=measurements,
            min_tcb=_min_tcb(data["min_tcb"]) if "min_tcb" in data else dict(TCB_FLOORS),
            allow_debug=_flag(data, "allow_debug"),
            allow_migration_agent=_flag(data, "allow_migration_agent"),
            host_data=_hex_set(data["host_data"], "host_data", 32) if "host_data" in data else None,
            image_ids=_hex_set(data["image_ids"], "image_ids", 16) if "image_ids" in data else None,
            weights=_weights(data),
            simulated=simulated,
            source=source,
        )

    @classmethod
    def _tdx(cls, data: dict, base: Path, source: str, simulated: bool) -> AttestationPolicy:
        from splitllm.attestation.tdx import TdxPolicy  # here, not above: tdx.py builds on this module

        if data.get("platform") != "tdx" or "tdx" not in data:
            raise PolicyError("a TDX policy says \"platform\": \"tdx\" and has its requirements in a 'tdx' section")
        stray = sorted(set(data) - {"platform", "simulated", "tdx", "weights"})
        if stray:
            raise PolicyError(f"{', '.join(stray)} do not apply to platform \"tdx\" (its requirements are in 'tdx')")
        tdx = TdxPolicy.from_dict(data["tdx"], base)
        if simulated and tdx.pinned:
            raise PolicyError("\"simulated\": true with Intel's root: a policy trusts Intel or a simulated vendor, "
                              "never both")
        if not tdx.pinned and not simulated:
            raise PolicyError(
                "it trusts a root that is not Intel's (a simulated vendor, which protects nothing); "
                "it is accepted only in a policy that says \"simulated\": true"
            )
        return cls(anchors=(), measurements=frozenset(), weights=_weights(data), simulated=simulated, source=source,
                   tdx=tdx)


def _anchor(spec: Any, base: Path) -> Anchor:
    if isinstance(spec, str):
        product = spec.removeprefix("amd-")
        if not spec.startswith("amd-") or product not in PRODUCTS:
            raise PolicyError(f"unknown trust anchor {spec!r}; pinned ones: {', '.join('amd-' + p for p in PRODUCTS)}")
        return pinned_anchor(product)
    if (not isinstance(spec, dict) or set(spec) != _ANCHOR_KEYS or spec["product"] not in PRODUCTS
            or not all(isinstance(spec[k], str) for k in ("ark", "ask"))):
        raise PolicyError("a file trust anchor is exactly {\"product\": one of " + ", ".join(PRODUCTS)
                          + ', "ark": PEM path, "ask": PEM path}')
    try:
        ark = x509.load_pem_x509_certificate((base / spec["ark"]).read_bytes())
        ask = x509.load_pem_x509_certificate((base / spec["ask"]).read_bytes())
    except (OSError, ValueError) as exc:
        raise PolicyError(f"trust anchor {spec}: {exc}") from None
    return _placed(spec["product"], ark, ask, spec["ark"])


def _placed(product: str, ark: x509.Certificate, ask: x509.Certificate, where: str) -> Anchor:
    """A file anchor holding one of AMD's roots, or a certificate named like one, must be exactly AMD's
    root and ASK of the product it is labelled with; any other root is a simulated vendor."""
    for name in PRODUCTS:
        amd = pinned_anchor(name)
        if ark.subject != amd.ark.subject:
            continue
        if ark != amd.ark:
            raise PolicyError(f"trust anchor {where}: its ARK bears the name of AMD's {name} root but is not that root")
        if name != product:
            raise PolicyError(f"trust anchor {where}: it is AMD's {name} root, labelled {product}")
        if ask != amd.ask:
            raise PolicyError(f"trust anchor {where}: AMD's {name} root with an ASK that is not AMD's {name} ASK")
        return amd
    return Anchor(product, ark, ask, pinned=False)
