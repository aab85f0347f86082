"""The committed report and the docs generated from it.

The tables in docs/privacy.md are generated from a committed report.json, between
`<!-- privacy-audit:NAME -->` and `<!-- /privacy-audit:NAME -->` markers (`update_docs`); a test
fails when they drift from it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from splitllm.lab import CHECKOUT
from splitllm.lab.privacy.report_tables import results, summary_table

PUBLISHED = CHECKOUT / "docs" / "privacy-audit"  # the committed report the docs are generated from
DOCS = ("docs/privacy.md",)


def blocks(r: dict) -> dict[str, str]:
    """The generated parts of the docs, by marker name."""
    return {"summary": summary_table(r), "results": results(r)}


def _marked(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- privacy-audit:{name} -->\n)(.*?)(<!-- /privacy-audit:{name} -->)", re.S)


def render_docs(r: dict, text: str) -> str:
    """`text` with every marked block replaced by its content generated from report `r`."""
    for name, body in blocks(r).items():
        text = _marked(name).sub(lambda m, b=body: m.group(1) + b + "\n" + m.group(3), text)
    return text


def load(report_json: Path) -> dict:
    """A report, with the private-first-stage run beside it (private_first_stage.json, run separately)
    merged in."""
    r = json.loads(report_json.read_text())
    extra = report_json.parent / "private_first_stage.json"
    if "private_first_stage" not in r and extra.is_file():
        side = json.loads(extra.read_text())
        r["private_first_stage"] = side["private_first_stage"]
        r["private_first_stage_provenance"] = side["provenance"]
    return r


def update_docs(report_json: Path, root: Path) -> list[Path]:
    """Regenerate the marked blocks of docs/privacy.md; returns the files changed."""
    r = load(Path(report_json))
    changed = []
    for name in DOCS:
        path = root / name
        text = path.read_text()
        new = render_docs(r, text)
        if new != text:
            path.write_text(new)
            changed.append(path)
    return changed
