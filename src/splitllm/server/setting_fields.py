"""The ServerSettings fields that `splitllm serve`'s options give, worked out from the option table alone.

Apart from `settings` (whose record holds a torch dtype), so that the command line registers `serve`
without importing torch.
"""

from __future__ import annotations

from typing import Any

from splitllm.options import SERVE, options_of

BYTES = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def fields_of(**options: Any) -> dict[str, Any]:
    """The ServerSettings fields that `splitllm serve`'s options of the 'server' group give: each by its
    own name, but a size the option takes in KiB, MiB or GiB held in bytes (--max-kv-gib: max_kv_bytes)."""
    units = {o.name: o.unit for o in options_of(SERVE)}
    return {
        f"{name.rsplit('_', 1)[0]}_bytes" if units[name] in BYTES else name:
            int(value * BYTES[units[name]]) if units[name] in BYTES else value
        for name, value in options.items()
    }
