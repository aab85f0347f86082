"""llama.cpp as a benchmark peer: without a build every benchmark says how to get one; with one
(`make peers`) both peers run on a real GGUF, locally and through the WAN proxy."""

from __future__ import annotations

import pytest

from splitllm.lab import peers
from splitllm.weights.sources import packaged_gguf_path


@pytest.mark.parametrize(("isa", "how"),
                         [("native", "make peers"), ("avx2", "python -m splitllm.lab.peers build avx2")])
def test_without_a_build_the_benchmarks_name_the_command_that_builds_it(  # type: ignore[no-untyped-def]
    isa, how, tmp_path, monkeypatch
) -> None:
    """The build a run is weighed against follows its kernels: `avx2` beside SPLITLLM_KERNELS=avx2 on a wider CPU."""
    monkeypatch.setenv("SPLITLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(peers, "matching", lambda: isa)
    assert peers.find(isa) is None and str(tmp_path) in str(peers.install_dir(isa))
    never = lambda _: pytest.fail("no build: nothing may run")  # noqa: E731
    assert how in peers.measured("default", never, lambda _: None)["skipped"]
    assert "GGUF" in peers.measured("/some/hf/folder", never, lambda _: None)["skipped"]
    with pytest.raises(RuntimeError, match=how):
        peers.whole_model(tmp_path / "model.gguf", 1, 8)  # refused for the missing build, before the file is read


@pytest.mark.slow
@pytest.mark.skipif(peers.find() is None, reason="llama.cpp is not built here (make peers)")
def test_both_peers_decode_the_default_gguf() -> None:
    gguf = packaged_gguf_path("default")
    local = peers.whole_model(gguf, 1, 16)
    remote = peers.rpc(gguf, 1, 20.0, 16)
    assert local.tokens_per_second > 0 and 0 < remote.tokens_per_second < 1000 / 20  # one round trip per token
    assert remote.as_dict()["rtt_ms"] == 20.0
