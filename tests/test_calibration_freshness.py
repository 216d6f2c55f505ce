"""A calibration's key (quill/cost/freshness.py): what makes one stale, which file is found,
what each policy does with a stale one (a real refit included), an engine refusing to start on
one, and `quill cost calibrate --check`'s held-out error."""

from __future__ import annotations

import json
import math
import os
import time

import pytest

from quill.config import EngineConfig
from quill.cost import freshness
from quill.cost.calibrate import calibration_cases
from quill.cost.check import held_out_cases
from quill.cost.hardware import HardwareSpec
from tests.conftest import write_tiny_config


def _key(**changes) -> dict:
    key = {
        "native_library": "avx512-0123456789ab",
        "cpu_model": "Some CPU",
        "cpu_flags_hash": freshness.flags_hash(["avx2", "fma"]),
        "torch": "2.13.0+cpu",
        "weight_formats": ["float32"],
    }
    return {**key, **changes}


def test_each_part_of_the_key_makes_a_calibration_stale():
    key = _key()
    assert freshness.stale_reasons({"key": key}, key) == []
    for field, value in [
        ("native_library", "avx512-ffffffffffff"),
        ("native_library", "pytorch"),
        ("cpu_model", "Another CPU"),
        ("cpu_flags_hash", freshness.flags_hash(["avx2", "fma", "avx512f"])),
        ("torch", "2.14.0+cpu"),
        ("weight_formats", ["int8", "float32"]),
    ]:
        reasons = freshness.stale_reasons({"key": key}, {**key, field: value})
        assert len(reasons) == 1, (field, reasons)
        assert ("flags" in reasons[0]) if field == "cpu_flags_hash" else (field in reasons[0])
    assert "no key" in freshness.stale_reasons({"dtype": "float32"}, key)[0]
    # The flags' order is not part of the key.
    assert freshness.flags_hash(["fma", "avx2"]) == freshness.flags_hash(["avx2", "fma"])


def test_this_process_key_names_its_native_library(monkeypatch):
    from quill.ops import library

    key = freshness.current_key(["float32"])
    assert set(key) == set(freshness.KEY_FIELDS)
    if library.load() is not None:
        isa = library.load().isa
        assert key["native_library"] == f"{isa}-{library.source_hash(isa)}"
    monkeypatch.setenv("QUILL_NATIVE", "0")
    assert freshness.current_key(["float32"])["native_library"] == "pytorch"


def _write(path, dtype: str, key: dict | None, mtime: float) -> None:
    spec = HardwareSpec("cpu", {dtype: 1e11}, 1e10, 24e9)
    spec.save(path)
    data = json.loads(path.read_text())
    data["calibration"] = {"dtype": dtype, **({"key": key} if key else {})}
    path.write_text(json.dumps(data))
    os.utime(path, (mtime, mtime))


def test_find_prefers_a_fresh_calibration_to_a_newer_stale_one(tmp_path):
    now = time.time()
    key = _key()
    _write(tmp_path / "fresh.json", "float32", key, now - 100)
    _write(tmp_path / "stale.json", "float32", _key(torch="2.12.0"), now - 10)
    _write(tmp_path / "other-dtype.json", "bfloat16", key, now)
    assert freshness.find("float32", key, tmp_path) == (tmp_path / "fresh.json", [])
    (tmp_path / "fresh.json").unlink()
    path, reasons = freshness.find("float32", key, tmp_path)
    assert path == tmp_path / "stale.json" and reasons == ["torch: calibrated with 2.12.0, now "
                                                           "2.13.0+cpu"]  # fmt: skip
    assert freshness.find("float16", key, tmp_path) == (None, [])


def test_a_stale_calibration_is_refused_with_the_command_or_used_as_it_is(tmp_path):
    stale = tmp_path / "old.json"
    _write(stale, "float32", None, time.time())
    reasons = freshness.stale_reasons({}, _key())
    with pytest.raises(ValueError) as refused:
        freshness.resolve_stale(stale, reasons, "refuse", "MODEL", "float32", "none", _key())
    message = str(refused.value)
    assert "stale" in message and "no key" in message
    assert "quill cost calibrate --quick --model MODEL --dtype float32 --quantization none" in (
        message
    )
    assert freshness.resolve_stale(stale, reasons, "as-is", "M", "float32", "none", _key()) == stale


def test_an_engine_refuses_to_start_on_a_stale_calibration(tmp_path, model_dir, monkeypatch):
    from quill.engine.llm_engine import LLMEngine

    monkeypatch.setenv("QUILL_CACHE", str(tmp_path))
    (tmp_path / "hardware").mkdir()
    _write(tmp_path / "hardware" / "old.json", "float32", _key(cpu_model="Elsewhere"), time.time())
    write_tiny_config(tmp_path, model_dir)
    config = EngineConfig(model=str(tmp_path), load_format="dummy", tokenizer=str(model_dir),
                          dtype="float32", quantization="none", kv_cache_memory=2**20,
                          calibration="refuse")  # fmt: skip
    with pytest.raises(Exception, match="stale .*cpu_model: calibrated with Elsewhere"):
        LLMEngine(config)


def test_a_stale_calibration_is_refitted_into_a_fresh_one(tmp_path, model_dir, monkeypatch):
    """The refit runs `quill cost calibrate --quick` on the model at hand (here a tiny one,
    with the sweep's limits cut down) and writes a file whose key is this process's."""
    monkeypatch.setenv("QUILL_CACHE", str(tmp_path))
    (tmp_path / "hardware").mkdir()
    stale = tmp_path / "hardware" / "old-float32.json"
    _write(stale, "float32", None, time.time())
    write_tiny_config(tmp_path, model_dir)
    key = freshness.current_key(["float32"])
    extra = ("--load-format", "dummy", "--tokenizer", str(model_dir), "--threads", "1",
             "--max-batch", "2", "--max-context", "24", "--max-chunk", "16", "--steps", "1",
             "--warmup", "0", "--no-progress", "--tp-sizes", "none")  # fmt: skip
    out = freshness.resolve_stale(
        stale, ["it records no key"], "refit", str(tmp_path), "float32", "none", key, extra
    )
    assert out != stale and out.is_file()
    spec = HardwareSpec.load(out)
    assert spec.calibration["key"] == key
    assert freshness.find("float32", key, tmp_path / "hardware") == (out, [])


def test_held_out_cases_are_shapes_the_fit_never_saw():
    for limits in ((64, 1536, 2048), (48, 1024, 1536), (3, 40, 24)):
        fitted = {(c.decodes, c.context, c.chunks, c.chunk, c.chunk_start)
                  for quick in (False, True)
                  for c in calibration_cases(*limits, 1, 0, quick)}  # fmt: skip
        held = held_out_cases(*limits, steps=2)
        assert held
        for c in held:
            assert (c.decodes, c.context, c.chunks, c.chunk, c.chunk_start) not in fitted
            assert c.decodes <= limits[0] and c.context <= limits[1] and c.chunk <= limits[2]


def test_check_reports_held_out_error_and_freshness(tmp_path, model_dir):
    from quill.cost import calibrate

    write_tiny_config(tmp_path, model_dir)
    out, report = tmp_path / "hw.json", tmp_path / "check.json"
    common = ["--model", str(tmp_path), "--load-format", "dummy", "--tokenizer", str(model_dir),
              "--threads", "1", "--no-progress"]  # fmt: skip
    sizes = ["--max-batch", "3", "--max-context", "40", "--max-chunk", "24", "--steps", "2"]
    fit_args = ["--dtype", "float32", "--quick", "--warmup", "0", "--tp-sizes", "none"]
    assert calibrate.main([*common, *sizes, *fit_args, "--out", str(out)]) == 0
    assert calibrate.main([*common, *sizes, "--check", str(out), "--out", str(report)]) == 0
    result = json.loads(report.read_text())
    assert result["stale"] == []
    held = result["held_out"]["all"]
    assert held["steps"] >= 4 and math.isfinite(held["median"]) and held["median"] >= 0
    # The same file with another CPU's flags in its key: stale, exit status 1.
    data = json.loads(out.read_text())
    data["calibration"]["key"]["cpu_flags_hash"] = "000000000000"
    out.write_text(json.dumps(data))
    assert calibrate.main([*common, *sizes, "--check", str(out), "--out", str(report)]) == 1
    assert json.loads(report.read_text())["stale"] == ["the CPU's feature flags differ"]
