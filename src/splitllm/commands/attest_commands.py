"""`splitllm attest`: what a confidential server's attestation is checked against: the loaded-weights
fingerprint a policy names, and the simulated vendor that tests and development run with."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from splitllm.commands.wiring import AskedPrecision, command, reported
from splitllm.options import ATTEST_SIM_INIT, ATTEST_WEIGHTS, Split

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


@command(app, ATTEST_WEIGHTS, split=Split, precision=AskedPrecision)
def weights(split: Split, precision: AskedPrecision) -> None:
    """Print the loaded-weights fingerprint a server of this model, split and precision attests: a value for
    a policy's `weights` (docs/confidential.md).

    It loads the server's layers from this machine's copy of the model exactly as a server does
    (converting them first where the precision needs it) and hashes the bytes they are built from, so
    run it on a copy you trust, with the server's --dtype and --quant (or --exact): the default is the
    fastest setting on this machine, which may not be the server's.
    """
    from splitllm.model.stage import Stage
    from splitllm.weights.sources import ModelFiles

    chosen = precision.resolve("weights")
    with reported(ValueError, OSError, KeyError):
        files = ModelFiles(split.model)
        files.config.check_split(split.first, split.last)
        stage = Stage.load(files, split.first, files.config.num_layers - split.last, chosen)
    typer.echo(stage.loaded_fingerprint)


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="attest")
