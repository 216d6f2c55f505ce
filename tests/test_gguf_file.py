"""quill's GGUF reader against gguf-py's own (the reference): every metadata value and every
tensor's type, shape and bytes, on the default model's file and on one written by gguf-py with
every value type, nested arrays, a custom alignment and plain and block tensor types; and a clear
error for files that are not GGUF or are cut short."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFWriter
from gguf.quants import quantize

from quill.contract.errors import ModelLoadError
from quill.model.default_model import default_gguf_path
from quill.model.gguf_config import gguf_hf_config, open_gguf
from quill.model.gguf_file import GGUFFile


def _plain(value):
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _assert_reads_as_gguf_py(path) -> GGUFFile:
    mine, ref = GGUFFile(path), GGUFReader(path)
    ref_fields = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(mine.fields) == list(ref_fields)
    for key, want in ref_fields.items():
        got = _plain(mine.fields[key])
        if key == "t.nested":  # gguf-py's contents() flattens an array of arrays
            got = [x for inner in got for x in inner]
        assert got == want and type(got) is type(want), key
    assert [t.name for t in mine.tensors] == [t.name for t in ref.tensors]
    for got, want in zip(mine.tensors, ref.tensors, strict=True):
        assert got.tensor_type == want.tensor_type, got.name
        assert got.data.shape == want.data.shape and got.data.dtype == want.data.dtype, got.name
        assert got.shape == tuple(int(n) for n in reversed(want.shape)), got.name
        assert np.array_equal(got.data.view(np.uint8), want.data.view(np.uint8)), got.name
    return mine


def _write(path, fill, endianess=GGUFEndian.LITTLE) -> None:
    writer = GGUFWriter(str(path), "llama", endianess=endianess)
    fill(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _every_kind(writer: GGUFWriter) -> None:
    writer.add_custom_alignment(64)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float32("t.f32", 0.1)
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.yes", True)
    writer.add_bool("t.no", False)
    writer.add_string("t.text", "naïve café ✓")
    writer.add_string("t.empty", "")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.strings", ["a", "", "ünï"])
    writer.add_array("t.nested", [[1, 2], [3]])
    g = np.random.default_rng(0)
    writer.add_tensor("f32.2d", g.standard_normal((3, 64)).astype(np.float32))
    writer.add_tensor("f32.1d", g.standard_normal(5).astype(np.float32))
    writer.add_tensor("f16", g.standard_normal((2, 7)).astype(np.float16))
    writer.add_tensor("i32", np.arange(12, dtype=np.int32).reshape(3, 4))
    for kind in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.BF16):
        data = quantize(g.standard_normal((4, 64)).astype(np.float32), kind)
        writer.add_tensor(f"{kind.name}", data, raw_dtype=kind)


def test_default_models_file_reads_as_gguf_py_reads_it():
    mine = _assert_reads_as_gguf_py(default_gguf_path())
    assert len(mine.fields["tokenizer.ggml.tokens"]) == 49152
    assert gguf_hf_config(mine)["num_hidden_layers"] == 30


def test_every_value_type_alignment_and_tensor_type(tmp_path):
    path = tmp_path / "kinds.gguf"
    _write(path, _every_kind)
    mine = _assert_reads_as_gguf_py(path)
    assert mine.fields["t.text"] == "naïve café ✓" and mine.fields["t.u64"] == 2**63 + 5
    assert mine.fields["general.alignment"] == 64
    assert _plain(mine.fields["t.nested"]) == [[1, 2], [3]]
    q8 = next(t for t in mine.tensors if t.name == "Q8_0")
    assert q8.shape == (4, 64) and q8.data.shape == (4, 2 * 34)  # two blocks of 34 bytes a row


def test_files_that_are_not_gguf_or_cut_short_are_refused_clearly(tmp_path):
    path = tmp_path / "kinds.gguf"
    _write(path, _every_kind)
    whole = path.read_bytes()
    cases = {
        "empty": (b"", "too short"),
        "text": (b"this is a text file, not a model at all\n", "no GGUF magic"),
        "header": (whole[:200], "not a readable GGUF file"),  # cut inside the metadata
        "data": (whole[:-100], "runs past the file"),  # cut inside the last tensor
    }
    for name, (content, why) in cases.items():
        bad = tmp_path / f"{name}.gguf"
        bad.write_bytes(content)
        with pytest.raises(ModelLoadError, match=why):
            open_gguf(bad)
    big = tmp_path / "big.gguf"
    _write(big, lambda w: w.add_uint32("t.u32", 1), GGUFEndian.BIG)
    with pytest.raises(ModelLoadError, match="big-endian"):
        open_gguf(big)
