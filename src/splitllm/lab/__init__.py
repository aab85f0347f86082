"""The lab: benchmarks, the privacy audit, drafter training, the demo, and `splitllm netem` over the WAN
proxy of `splitllm.testing`.

It measures and trains the runtime from outside; the runtime never imports it (the import contracts in
pyproject.toml, checked by the suite). `CHECKOUT` is the source tree the lab reads and publishes to
(the committed reports, the docs, the commit a figure came from).
"""

from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[3]
