"""Converting a GGUF: the tensor table read without decoding the fields agrees with gguf's own reader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

from splitllm.weights.sources import _dequantized, _gguf_table


def _write(path: Path) -> dict[str, np.ndarray]:
    """A GGUF with a field of every kind (a string array and a nested array among them), a custom
    alignment and tensors stored four ways; returns the float32 values each tensor holds."""
    writer = GGUFWriter(path, "llama")
    writer.add_custom_alignment(64)
    writer.add_string("general.name", "tiny")
    writer.add_uint8("test.u8", 7)
    writer.add_int16("test.i16", -3)
    writer.add_uint64("test.u64", 1 << 40)
    writer.add_float64("test.f64", 0.5)
    writer.add_bool("test.flag", True)
    writer.add_array("tokenizer.ggml.tokens", ["a", "bb", "", "ü" * 9])
    writer.add_key_value("test.nested", [[1, 2], [3]], GGUFValueType.ARRAY, sub_type=GGUFValueType.ARRAY)
    rng = np.random.default_rng(0)
    values: dict[str, np.ndarray] = {}
    for name, qtype, shape in [("f32", GGMLQuantizationType.F32, (3, 5)), ("f16", GGMLQuantizationType.F16, (2, 7)),
                               ("q8", GGMLQuantizationType.Q8_0, (4, 64)),
                               ("q5", GGMLQuantizationType.Q5_0, (2, 3, 32))]:
        data = rng.standard_normal(shape).astype(np.float32)
        if qtype == GGMLQuantizationType.F32:
            writer.add_tensor(name, data)
            values[name] = data
        elif qtype == GGMLQuantizationType.F16:
            writer.add_tensor(name, data.astype(np.float16))
            values[name] = data.astype(np.float16).astype(np.float32)
        else:
            blocks = quantize(data, qtype)
            writer.add_tensor(name, blocks, raw_dtype=qtype)
            values[name] = dequantize(blocks, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return values


def test_the_tensor_table_agrees_with_ggufs_reader(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    values = _write(path)
    architecture, table = _gguf_table(path)
    reader = GGUFReader(path)
    assert architecture == "llama"
    assert [(t.name, t.shape, t.qtype, t.start, t.nbytes) for t in table] == [
        (t.name, tuple(int(d) for d in reversed(t.shape.tolist())), int(t.tensor_type), int(t.data_offset),
         int(t.n_bytes))
        for t in reader.tensors
    ]
    with open(path, "rb") as f:
        for tensor in table:
            read = _dequantized(tensor, f)
            np.testing.assert_array_equal(read, values[tensor.name])


def test_a_file_that_is_not_gguf_or_ends_early_is_refused_by_name(tmp_path: Path) -> None:
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="other.gguf cannot be read as GGUF: not a GGUF v2 or v3 file"):
        _gguf_table(other)
    whole = tmp_path / "whole.gguf"
    _write(whole)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[:200])  # the header ends inside the fields
    with pytest.raises(ValueError, match="cut.gguf cannot be read as GGUF"):
        _gguf_table(cut)
