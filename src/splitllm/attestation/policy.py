"""What a client requires of a confidential server before it sends anything: the attestation policy.

A policy is a JSON file:

    {
      "platform": "sev-snp",
      "trust_anchors": ["amd-milan", "amd-genoa", "amd-turin"],
      "measurements": ["<96 hex: the launch digest of the server image>"],
      "min_tcb": {"bootloader": 3, "tee": 0, "snp": 8, "microcode": 115},
      "allow_debug": false,
      "host_data": ["<64 hex>"],
      "image_ids": ["<32 hex>"],
      "weights": ["<64 hex: a loaded-weights fingerprint, from `splitllm attest weights`>"]
    }

`trust_anchors` names AMD's roots pinned in this package (`amd-<product>`); a file anchor
(`{"product": "milan", "ark": "ark.pem", "ask": "ask.pem"}`, paths relative to the policy) that is
not one of AMD's roots is a simulated vendor and is accepted only with `"simulated": true`.
`host_data` and `image_ids` are optional: when given, the report's field must be one of them.
`weights`, optional too, lists the loaded-weights fingerprints (weights/loaded.py) the server's layers
may be built from; an image that reads its weights from outside what its measurement covers needs it.
Every other key is refused, so a misspelt requirement is never silently dropped.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from cryptography import x509

from splitllm.attestation.snp import Tcb

PRODUCTS = ("milan", "genoa", "turin")
_KEYS = {"platform", "trust_anchors", "measurements", "min_tcb", "allow_debug", "host_data", "image_ids", "weights", "simulated"}


class PolicyError(ValueError):
    """A policy file that cannot be used as written."""


@dataclass(frozen=True)
class Anchor:
    """A vendor root (ARK) and, optionally, its signing key's certificate (ASK) for one product line."""

    product: str
    ark: x509.Certificate
    ask: x509.Certificate | None
    pinned: bool  # AMD's own root, shipped in this package


@cache
def pinned_anchor(product: str) -> Anchor:
    """AMD's ARK and ASK for a product line, as AMD publishes them (copies in splitllm/attestation/amd)."""
    folder = resources.files("splitllm.attestation") / "amd" / product
    ark = x509.load_pem_x509_certificate((folder / "ark.pem").read_bytes())
    ask = x509.load_pem_x509_certificate((folder / "ask.pem").read_bytes())
    return Anchor(product, ark, ask, pinned=True)


def _is_pinned_root(cert: x509.Certificate) -> bool:
    return any(cert == pinned_anchor(p).ark for p in PRODUCTS)


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


@dataclass(frozen=True)
class AttestationPolicy:
    anchors: tuple[Anchor, ...]
    measurements: frozenset[bytes]
    min_tcb: Tcb | None = None
    allow_debug: bool = False
    host_data: frozenset[bytes] | None = None
    image_ids: frozenset[bytes] | None = None
    weights: frozenset[bytes] | None = None
    simulated: bool = False
    source: str = "<policy>"

    @classmethod
    def load(cls, path: str | os.PathLike) -> AttestationPolicy:
        path = Path(path).expanduser()
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise PolicyError(f"attestation policy {path}: {exc}") from None
        try:
            return cls.from_dict(data, path.parent, str(path))
        except PolicyError as exc:
            raise PolicyError(f"attestation policy {path}: {exc}") from None

    @classmethod
    def from_dict(cls, data: Any, base: Path, source: str = "<policy>") -> AttestationPolicy:
        if not isinstance(data, dict):
            raise PolicyError("must be a JSON object")
        unknown = sorted(set(data) - _KEYS)
        if unknown:
            raise PolicyError(f"unknown keys {', '.join(unknown)} (known: {', '.join(sorted(_KEYS))})")
        platform = data.get("platform", "sev-snp")
        if platform != "sev-snp":
            raise PolicyError(
                f"platform {platform!r}: this release verifies AMD SEV-SNP evidence only (TDX: docs/confidential.md)"
            )
        simulated = data.get("simulated", False)
        if not isinstance(simulated, bool):
            raise PolicyError("'simulated' must be true or false")
        anchors = tuple(_anchor(a, base) for a in data.get("trust_anchors", []))
        if not anchors:
            raise PolicyError("'trust_anchors' must name at least one root (amd-milan, amd-genoa, amd-turin)")
        foreign = [a.product for a in anchors if not a.pinned]
        if foreign and not simulated:
            raise PolicyError(
                "it trusts a root that is not AMD's (a simulated vendor, which protects nothing); "
                "it is accepted only in a policy that says \"simulated\": true"
            )
        if "measurements" not in data:
            raise PolicyError("'measurements' must list the launch digests of the server images to trust")
        measurements = _hex_set(data["measurements"], "measurements", 48)
        if not measurements:
            raise PolicyError("'measurements' is empty: no server image would be trusted")
        min_tcb = None
        if "min_tcb" in data:
            tcb = data["min_tcb"]
            names = {"bootloader", "tee", "snp", "microcode", "fmc"}
            if not isinstance(tcb, dict) or set(tcb) - names or not all(
                isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 256 for v in tcb.values()
            ):
                raise PolicyError(f"'min_tcb' must map some of {', '.join(sorted(names))} to levels 0-255")
            min_tcb = Tcb(**{k: tcb.get(k, 0) for k in ("bootloader", "tee", "snp", "microcode", "fmc")})
        allow_debug = data.get("allow_debug", False)
        if not isinstance(allow_debug, bool):
            raise PolicyError("'allow_debug' must be true or false")
        return cls(
            anchors=anchors,
            measurements=measurements,
            min_tcb=min_tcb,
            allow_debug=allow_debug,
            host_data=_hex_set(data["host_data"], "host_data", 32) if "host_data" in data else None,
            image_ids=_hex_set(data["image_ids"], "image_ids", 16) if "image_ids" in data else None,
            weights=_hex_set(data["weights"], "weights", 32) if "weights" in data else None,
            simulated=simulated,
            source=source,
        )


def _anchor(spec: Any, base: Path) -> Anchor:
    if isinstance(spec, str):
        product = spec.removeprefix("amd-")
        if not spec.startswith("amd-") or product not in PRODUCTS:
            raise PolicyError(f"unknown trust anchor {spec!r}; pinned ones: {', '.join('amd-' + p for p in PRODUCTS)}")
        return pinned_anchor(product)
    if not isinstance(spec, dict) or not isinstance(spec.get("ark"), str) or spec.get("product") not in PRODUCTS:
        raise PolicyError("a file trust anchor is {\"product\": one of " + ", ".join(PRODUCTS) + ', "ark": PEM path, "ask": PEM path}')
    try:
        ark = x509.load_pem_x509_certificate((base / spec["ark"]).read_bytes())
        ask = x509.load_pem_x509_certificate((base / spec["ask"]).read_bytes()) if "ask" in spec else None
    except (OSError, ValueError) as exc:
        raise PolicyError(f"trust anchor {spec}: {exc}") from None
    return Anchor(spec["product"], ark, ask, pinned=_is_pinned_root(ark))
