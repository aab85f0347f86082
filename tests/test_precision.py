"""Precision per side: quantized linears against float32, 16-bit and quantized stages against float32,
speculation exact against sequential decoding in the same precision, the stored forms on disk, and the
default model loading and generating in bfloat16 and int8."""

from __future__ import annotations

import pytest
import torch

from conftest import random_drafter
from report_tables import table, values
from splitllm.client.client_model import ClientModel
from splitllm.client.pipeline import InProcessMiddle, SplitPipeline
from splitllm.client.client import SplitClient
from splitllm.decoding.mode_names import Mode
from splitllm.decoding.modes import DECODERS
from splitllm.decoding.sequential import decode_sequential
from splitllm.decoding.speculation_config import SPECULATIVE_MODES, SpeculationConfig
from splitllm.decoding.speculative import SpeculativeDecoder
from splitllm.kernels import cpu_kernels
from splitllm.model.precision import Precision
from splitllm.model.quant import (
    WEIGHT_KINDS, BlockedLinear, Int4Linear, Int8Linear, Linear, PackedLinear, fuse, int4_values
)
from splitllm.model.stage import Stage, Step
from splitllm.weights.conversions import StoredWeights
from splitllm.weights.sources import ModelFiles, cache_root
from splitllm.model.visibility import Visibility

CPU = torch.device("cpu")
LOSSY = [Precision(torch.bfloat16), Precision(torch.float16), Precision(torch.bfloat16, "int8"),
         Precision(torch.float32, "int8"), Precision(torch.bfloat16, "int4")]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Each test writes its stored forms into its own cache, so they are really converted and read
    here; the converted GGUF models are shared (converting the default model again takes minutes)."""
    shared, private = cache_root(), tmp_path / "cache"
    private.mkdir()
    for folder in ("models", "digests"):
        (shared / folder).mkdir(parents=True, exist_ok=True)
        (private / folder).symlink_to(shared / folder)
    monkeypatch.setenv("SPLITLLM_CACHE", str(private))


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


@pytest.mark.parametrize("kernels", ["splitllm", "pytorch"])  # PyTorch's: no kernel variant, or SPLITLLM_KERNELS=off
@pytest.mark.parametrize(("module", "tolerance"), [(Int8Linear, 0.01), (Int4Linear, 0.1)])
def test_quantized_linear_is_close_to_float32(module, tolerance, kernels,  # type: ignore[no-untyped-def]
                                              monkeypatch) -> None:
    if kernels == "pytorch":
        monkeypatch.setattr(BlockedLinear, "available", staticmethod(lambda dtype, device: False))
    gen = torch.Generator().manual_seed(0)
    w, bias = torch.randn(96, 128, generator=gen) * 0.05, torch.randn(96, generator=gen)
    x = torch.randn(5, 128, generator=gen)
    quantized = module.from_stored(module.quantize(w), bias, CPU)
    assert isinstance(quantized,
                      module if kernels == "pytorch" or not BlockedLinear.available(torch.bfloat16,
                                                                                    CPU) else BlockedLinear)
    out = quantized(x)
    assert out.dtype == x.dtype and out.shape == (5, 96)
    assert _relative_error(out, x @ w.T + bias) < tolerance
    # Every row gets the same bits alone or in a batch: verification may score any number of rows.
    assert torch.equal(out, torch.cat([quantized(row) for row in x.split(1)]))


@pytest.mark.skipif(not PackedLinear.available(torch.bfloat16, CPU), reason="oneDNN without bfloat16 here")
def test_packed_bfloat16_linear_is_plain_bfloat16() -> None:
    """oneDNN's packed layout changes speed only: the same bits as F.linear in bfloat16, row by row or batched."""
    gen = torch.Generator().manual_seed(0)
    w, bias = torch.randn(96, 128, generator=gen).bfloat16(), torch.randn(96, generator=gen).bfloat16()
    x = torch.randn(1, 7, 128, generator=gen)
    linear = PackedLinear(w, bias)
    assert linear.out_features == 96 and torch.equal(linear.weight, w)
    out = linear(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, torch.nn.functional.linear(x.bfloat16(), w, bias))
    assert torch.equal(out[0], torch.cat([linear(row) for row in x[0].split(1)]))
    assert isinstance(Precision(torch.float32).linear({"weight": w.float()}), Linear)
    fastest = BlockedLinear if BlockedLinear.available(torch.bfloat16, CPU) else PackedLinear
    assert isinstance(Precision(torch.bfloat16).linear({"weight": w}), fastest)


def test_quantized_forms_take_fewer_bytes() -> None:
    w = torch.randn(64, 256)
    sizes = {q: sum(t.nbytes for t in Precision(torch.bfloat16, q).store_linear(w).values()) for q in ("none", "int8",
                                                                                                       "int4")}
    assert sizes["int8"] < 0.52 * sizes["none"] and sizes["int4"] < 0.65 * sizes["int8"]  # scales cost 1 bit a weight


def test_int4_finds_a_4_bit_grid_again_and_mixed_keeps_only_what_it_loses_nothing_on() -> None:
    """A weight already on 16 levels per group of 32 (as GGUF's Q4_1 dequantizes: q * d + m, float16 d and m)
    comes back bit for bit, even where a group never uses its top or neighbouring levels; `mixed` keeps such
    a weight in int4 and a weight on a finer grid (Q6_K-like, 64 levels) in int8, and fuses the two as int8."""
    gen = torch.Generator().manual_seed(5)
    d = (torch.rand(16, 4, 1, generator=gen) / 50 + 1e-3).half().float()
    m = (torch.randn(16, 4, 1, generator=gen) / 20).half().float()
    q = torch.randint(0, 16, (16, 4, 32), generator=gen).float()
    q[0, 0] = torch.randint(0, 8, (32,), generator=gen) * 2  # every other level, never the top one
    w = (q * d + m).view(16, 128)
    stored = Int4Linear.quantize(w)
    nibbles, sm = stored["nibbles"], stored["scales_mins"].float()
    back = (torch.stack([nibbles >> 4, nibbles & 15], -1).view(16, 4, 32).float() * sm[..., :1] + sm[..., 1:]).view(16,
                                                                                                                    128)
    assert torch.equal(back, w)
    mixed = Precision(torch.bfloat16, "mixed")
    fine = (torch.randint(-32, 32, (16, 128), generator=gen).float() * d.view(16, 4).repeat_interleave(32, 1))
    assert mixed.store_linear(w).keys() == {"nibbles", "scales_mins"} and mixed.store_linear(fine).keys() == {"q",
                                                                                                              "scales"}
    fused = mixed.linear(fuse([mixed.store_linear(w), mixed.store_linear(fine)]))
    x = torch.randn(3, 128, generator=gen)
    assert _relative_error(fused(x), x @ torch.cat([w, fine]).T) < 0.01


@pytest.mark.slow
def test_mixed_keeps_the_default_models_layers_exactly(default_files) -> None:  # type: ignore[no-untyped-def]
    """The default model ships its layers as Q4_1 blocks and its embedding as Q8_0: under `mixed` every layer's
    weight is int4 and equals the float32 conversion exactly; the embedding (the tied LM head) is int8."""
    mixed = Precision(torch.bfloat16, "mixed")
    names = [f"model.layers.3.{n}.weight" for n in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")]
    for name, w in default_files.read([*names, "model.embed_tokens.weight"], torch.float32).items():
        stored = mixed.store_linear(w)
        if name.startswith("model.layers"):
            assert stored.keys() == {"nibbles", "scales_mins"} and torch.equal(int4_values(stored), w), name
        else:
            assert stored.keys() == {"q", "scales"}, name


def test_int4_needs_whole_groups() -> None:
    with pytest.raises(ValueError, match="divisible by 32"):
        Int4Linear.quantize(torch.randn(8, 48))


@pytest.mark.parametrize(
    ("args", "message"),
    [(("float8",), "compute dtype must be one of"), (("float32", "int3"), "quantization must be one of"),
     (("float32", "none", "tpu"), "device must be one of")],
)
def test_bad_precision_names_list_the_choices(args, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        Precision.parse(*args)


@pytest.mark.parametrize("precision", LOSSY, ids=lambda p: p.name)
def test_lossy_stage_is_close_to_float32(precision, tiny_models, random_ids) -> None:  # type: ignore[no-untyped-def]
    files = ModelFiles(tiny_models["qwen2"])  # qkv biases too
    tokens = random_ids(24, seed=3)
    hidden = torch.randn(24, files.config.hidden_size, generator=torch.Generator().manual_seed(1))
    outs = {}
    for p in (Precision(), precision):
        stage = Stage.load(files, 0, 3, p)
        outs[p] = stage(stage.new_cache(32), Step(hidden, torch.arange(len(tokens)), Visibility.chain(len(tokens))))
    # The tiny models' wide weights sharpen attention, which amplifies int4's ~8% weight error.
    tolerance = {"none": 0.05, "int8": 0.08, "int4": 0.5}[precision.quant]
    assert _relative_error(outs[precision], outs[Precision()]) < tolerance


@pytest.mark.parametrize("precision", [Precision(torch.bfloat16, q) for q in ("none", "int8", "int4", "mixed")],
                         ids=lambda p: p.name)
@pytest.mark.parametrize("model", ["mistral", "gemma3"])  # sliding windows: trees cross window edges
def test_speculation_is_exact_against_sequential_in_the_same_precision(
    precision, model, tiny_models  # type: ignore[no-untyped-def]
) -> None:
    files = ModelFiles(tiny_models[model])
    client_model = ClientModel(files, 1, 1, precision)
    client_model.drafter = random_drafter(files, precision.dtype)  # the draft mode's noise must not change the output
    middle = Stage.load(files, 1, files.config.num_layers - 1, precision)

    def run(decoder) -> list[int]:  # type: ignore[no-untyped-def]
        pipeline = SplitPipeline(client_model, InProcessMiddle(middle, 96), 96)
        return [t for out in decoder(pipeline, prompt, 40, frozenset()) for t in out.tokens]

    prompt = [7, 8, 9, 10, 11] * 4 + [7, 8]
    expected = run(decode_sequential)
    if cpu_kernels.load() is None:  # PyTorch's 16-bit kernels: speculation is refused, never diverging silently
        with pytest.raises(ValueError, match="would not reproduce sequential decoding"):
            run(SpeculativeDecoder(SpeculationConfig(next(iter(SPECULATIVE_MODES)))))
        return
    for mode in SPECULATIVE_MODES:
        assert run(SpeculativeDecoder(SpeculationConfig(mode))) == expected, mode
    kernels = cpu_kernels.load()
    # On AMX's tiles a tree's logits come from one LM-head call, on the dot-product path a few rows at once
    # (as many as share a read of the weights); every row the bits it gets alone.
    variant = cpu_kernels.chosen()
    head = client_model.lm_head
    dot_rows = variant.shared_rows[WEIGHT_KINDS.get(head.packed.dtype, 0)] if isinstance(head, BlockedLinear) else 1
    assert client_model.shared_logit_rows == (1 if kernels is None else 32 if kernels.tiles_available() else dot_rows)


@pytest.mark.parametrize("precision", [Precision(torch.float16), Precision(torch.float32, "int8"), Precision()],
                         ids=lambda p: p.name)
def test_speculation_is_refused_where_a_rows_bits_depend_on_its_step(precision,  # type: ignore[no-untyped-def]
                                                                     tiny_models) -> None:
    """float16, float32-int8 and the float32 exact mode run PyTorch's kernels on every CPU, whose rows round
    by their step's size: with them on either side a speculative mode is refused and `auto` decodes
    sequentially (a server in such a precision says so when a session opens: test_server.py)."""
    files = ModelFiles(tiny_models["mistral"])
    reference_client, lossy_client = ClientModel(files, 1, 1, torch.float64), ClientModel(files, 1, 1, precision)
    lossy_middle = Stage.load(files, 1, files.config.num_layers - 1, precision)
    assert reference_client.row_invariant and not lossy_client.row_invariant and not lossy_middle.row_invariant
    reference_middle = Stage.load(files, 1, files.config.num_layers - 1, Precision(torch.float64))
    for client_model, middle in [(lossy_client, reference_middle), (reference_client, lossy_middle)]:

        def run(decoder, client_model=client_model, middle=middle):  # type: ignore[no-untyped-def]
            pipeline = SplitPipeline(client_model, InProcessMiddle(middle, 64), 64)
            return [out.tokens for out in decoder(pipeline, [3, 4, 5, 3, 4, 5], 6, frozenset())]

        with pytest.raises(ValueError, match="would not reproduce sequential decoding"):
            run(SpeculativeDecoder(SpeculationConfig(Mode.LOOKUP)))
        sequential = run(decode_sequential)
        assert len(sequential) == 6 and run(DECODERS[Mode.AUTO]()) == sequential  # a token a step


def test_lm_head_precision_is_its_own(tiny_models) -> None:  # type: ignore[no-untyped-def]
    files = ModelFiles(tiny_models["llama"])
    client_model = ClientModel(files, 1, 1, Precision(), Precision(torch.bfloat16, "int8"))
    assert isinstance(client_model.lm_head,
                      (Int8Linear, BlockedLinear)) and client_model.embed_weight.dtype == torch.bfloat16
    assert isinstance(client_model.first.layers[0].qkv,
                      Linear) and client_model.first.layers[0].qkv.weight.dtype == torch.float32
    reference = ClientModel(files, 1, 1)
    hidden = torch.randn(3, files.config.hidden_size)
    logits = client_model.logits(hidden)
    assert logits.dtype == torch.float32
    assert _relative_error(logits, reference.logits(hidden)) < 0.02


def test_stored_forms_are_converted_per_layer_once(tiny_models, tensor_reads) -> None:  # type: ignore[no-untyped-def]
    files = ModelFiles(tiny_models["llama"])
    precision = Precision(torch.bfloat16, "int8")
    Stage.load(files, 1, 3, precision)
    layers = {int(n.split(".")[2]) for n in tensor_reads if n.startswith("model.layers.")}
    assert layers == {1, 2}
    folder = StoredWeights(files, precision, ()).folder
    assert sorted(p.name for p in folder.iterdir()) == ["layer-0001.safetensors", "layer-0002.safetensors"]
    tensor_reads.clear()
    stage = Stage.load(files, 1, 3, precision)
    assert tensor_reads == []  # the second load reads only the stored forms
    assert isinstance(stage.layers[0].gate_up,
                      (Int8Linear, BlockedLinear)) and stage.layers[0].input_norm.dtype == torch.bfloat16


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["none", "int8", "int4", "mixed"])
def test_default_model_generates_in_bfloat16(quant) -> None:  # type: ignore[no-untyped-def]
    """The real model in a 16-bit or quantized precision on both sides still answers a factual question,
    and speculation gives the same tokens as sequential decoding in that precision."""
    precision = Precision(torch.bfloat16, quant)
    client = SplitClient(None, None, 2, 2, precision=precision)
    assert client._middle().stage.precision == precision  # type: ignore[attr-defined]
    prompt = "Which city is the capital of France?"  # "What is ..." is a near-tie at the first token in 16 bits
    sequential = client.generate(prompt, 12, decode="sequential").ids
    assert "Paris" in client.tokenizer.decode(sequential)
    assert client.generate(prompt, 12, decode="auto").ids == sequential


def _forward(ms: float, floor: float) -> dict:
    rows = {n: {"median_ms": ms * k, "floor_ratio": ms * k / floor, "others_cores": 0.1}
            for n, k in (("1", 1), ("8", 2), ("32", 4))}
    return {"layers": [2, 28], "context": 512, "weight_bytes": 88 << 20, "floor_ms": floor, "tokens": rows}


def test_speed_report_checks_every_target() -> None:
    """The report's arithmetic on a made-up run: targets met, missed and not measured."""
    from splitllm.lab.bench.speed_report import TARGETS, markdown, met

    step = {"total_ms": 20.0, "first_ms": 2.0, "server_ms": 10.0, "network_ms": 0.5, "last_ms": 3.0}
    run = {"rtt_ms": 0.0, "tok_s": 50.0, "tokens_per_step": 1.0, "mean_step_ms": step, "others_cores": 0.0}
    result = {
        "split": [2, 2], "settings": ["float32-none", "bfloat16-int8"], "fastest": "bfloat16-int8", "targets": TARGETS,
        "bandwidth": {"1": {"read_gb_s": 10.0, "copy_gb_s": 8.0}},
        "server_forward": {"float32-none 1t": _forward(50.0, 35.0), "bfloat16-int8 1t": _forward(8.0, 9.0)},
        "client_step": {"bfloat16-int8 1t": {"median_ms": 5.0, "weight_bytes": 1 << 20, "others_cores": 0.0}},
        "load": {"cold": {"total_s": 9.0, "resolve_s": 8.0, "server_s": 0.5, "client_s": 0.5}},
        "memory": {"server bfloat16-int8": {"peak_mib": 500.0, "baseline_mib": 400.0, "weights_mib": 88.0}},
        "decoding": {"bfloat16-int8": {"sequential": {"0": run}},
                     "float32-none": {"sequential": {"0": {**run, "tok_s": 25.0}}}},
        "decoding_wire_dtype": "float16",
    }
    verdicts = met(result)
    assert (
        verdicts["server_1_token_ms_bfloat16-int8"]
        and verdicts["client_1_token_ms"]
        and verdicts["sequential_tok_s_at_0ms"]
    )
    # float32 at 1.43x its floor
    assert verdicts["speedup_over_float32_at_0ms"] and not verdicts["server_1_token_floor_ratio"]
    assert verdicts["server_1_token_ms_bfloat16-none"] is None and verdicts["sequential_tok_s_at_80ms"] is None
    text = markdown({**result, "met": verdicts})
    forward = [values(row) for row in table(text, "1 position ms (x floor)")]
    assert [(row["setting"], row["threads"]) for row in forward] == [("float32-none", [1]), ("bfloat16-int8", [1])]
    assert (forward[1]["weights MiB"], forward[1]["floor ms"], forward[1]["1 position ms (x floor)"]) == ([88], [9.0],
                                                                                                          [8.0, 0.89])
    targets = [values(row) for row in table(text, "target")]
    flags = {True: "met", False: "MISSED", None: "not measured"}
    expected = [(k, [v], flags[verdicts[k]]) for k, v in TARGETS.items()]
    assert [(row["target"], row["value"], row["met"]) for row in targets] == expected


def test_idle_cost_waits_before_every_other_block_of_steps() -> None:
    """The server-step check times the same call back to back and after a wait, alternating blocks."""
    import time

    from splitllm.lab.bench.speed_compute import idle_cost

    calls: list[float] = []
    result = idle_cost(lambda: calls.append(time.perf_counter()), idle_s=0.01, rounds=2, per_round=3)
    gaps = [b - a for a, b in zip(calls, calls[1:])]
    assert len(calls) == 1 + 2 * 2 * 3 and sum(g >= 0.01 for g in gaps) == 2 * 3
    assert result["idle_s"] == 0.01 and result["after_idle_ms"] >= 0 and result["back_to_back_ms"] >= 0


def test_model_speed_report_shows_the_server_step_each_way() -> None:
    from splitllm.lab.bench.speed_model import markdown

    wan = {"tok_s": 6.5}
    step = {"in_process_ms": 40.0, "own_process_ms": 42.0, "ratio": 1.05, "floor_ms": 30.0, "floor_ratio": 1.33,
            "idle": {"idle_s": 0.015, "back_to_back_ms": 40.0, "after_idle_ms": 41.0}, "split_80ms": wan}
    result = {"model": "m", "split": [2, 2], "new_tokens": 8, "threads": 2, "rtt_ms": 80.0,
              "cores": {"server": [0], "client": [1]},
              "in_process": {"bfloat16-int4": {"tok_s": 30.0}}, "llama_cpp": {"skipped": "no build"},
              "server_step": {"bfloat16-int4": step}, "llama_cpp_rpc": {}}
    assert [values(row) for row in table(markdown(result), "own process ms")] == [{
        "setting": "bfloat16-int4", "in-process ms": [40.0], "own process ms": [42.0], "ratio": [1.05],
        "in-process, back to back / after an idle wait": [40.0, 41.0, 15], "floor ms": [30.0],
        "in-process / floor": [1.33],
        "split tok/s": [6.5],
    }]


def test_quality_report_shows_every_setting_against_float32() -> None:
    from splitllm.lab.bench.quality import markdown

    row = {"perplexity": 24.0, "kl_nats": 0.0, "top1_agreement": {"rate": 1.0}, "ppl_positions": 128}
    result = {"prompts": 4, "max_new_tokens": 8, "settings": {
        "float32-none": row,
        "bfloat16-none": {**row, "perplexity": 24.24, "kl_nats": 0.002, "identical": 3, "mean_first_divergence": 5.0},
    }}
    columns = ("setting", "identical to float32", "mean first divergence (token)", "perplexity", "vs float32",
               "KL from float32 (nats/token)")
    assert [values(row) for row in table(markdown(result), "perplexity")] == [
        dict(zip(columns, ("float32-none", "reference", "-", [24.0], [1.0], [0.0]))),
        dict(zip(columns, ("bfloat16-none", [3, 4], [5.0], [24.24], [1.01], [0.002]))),
    ]
