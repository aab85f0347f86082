"""`splitllm attest`: the simulated vendor that tests and development run a confidential server with."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from splitllm.commands.wiring import command, reported
from splitllm.options import ATTEST_SIM_INIT

app = typer.Typer(no_args_is_help=True, help="Attestation of a confidential server (docs/confidential.md).")


@command(app, ATTEST_SIM_INIT)
def sim_init(
    folder: Annotated[Path, typer.Argument(help="folder to write the simulated vendor, guest and policy.json into")],
    platform: str,
    product: str,
) -> None:
    """Write a SIMULATED SEV-SNP or TDX vendor, a guest's measurements and a policy.json trusting exactly them.

    `serve --attestation simulated --attestation-sim FOLDER` signs reports (or quotes) with it and a
    client with `--attestation-policy FOLDER/policy.json` verifies them with the same code as genuine
    evidence. Whoever holds the folder can sign anything: it protects nothing, and the policy says so.
    """
    from splitllm.attestation.policy import PLATFORMS, PRODUCTS
    from splitllm.attestation.simulation import sim_init
    from splitllm.attestation.tdx_simulation import tdx_sim_init

    if platform not in PLATFORMS:
        raise typer.BadParameter(f"--platform must be one of {', '.join(PLATFORMS)}")
    if product not in PRODUCTS:
        raise typer.BadParameter(f"--product must be one of {', '.join(PRODUCTS)}")
    with reported(OSError):
        policy = tdx_sim_init(folder) if platform == "tdx" else sim_init(folder, product)
    typer.echo(f"simulated vendor and guest in {folder}; clients use --attestation-policy {policy}")
    typer.echo("warning: a simulated vendor protects nothing: for tests and development only", err=True)


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="attest")
