"""Start-up measurements kept per machine (quill/model/measured.py): a second start reads the
first one's timings instead of timing again; anything they depend on changing measures anew."""

from __future__ import annotations

from quill.model import measured


def test_a_measurement_is_kept_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("QUILL_CACHE", str(tmp_path))
    calls = []

    def measure():
        calls.append(1)
        return [[16, 0.5, 0.25], [32, 1.0, 0.5]]

    what = {"products": [["Q4_K", 64, 256, True]], "dtype": "torch.bfloat16"}
    first = measured.remembered("tiled-dequantized-products", what, measure)
    again = measured.remembered("tiled-dequantized-products", what, measure)
    assert first == again == [[16, 0.5, 0.25], [32, 1.0, 0.5]] and len(calls) == 1
    # Other shapes, or another machine (here: other threads), measure again.
    measured.remembered("tiled-dequantized-products", {**what, "dtype": "x"}, measure)
    assert len(calls) == 2
    monkeypatch.setattr(measured, "machine", lambda: {"cpu": "another"})
    measured.remembered("tiled-dequantized-products", what, measure)
    assert len(calls) == 3
    files = list((tmp_path / "measured").glob("tiled-dequantized-products-*.json"))
    assert len(files) == 3


def test_a_damaged_or_unwritable_cache_only_measures_again(tmp_path, monkeypatch):
    monkeypatch.setenv("QUILL_CACHE", str(tmp_path))
    assert measured.remembered("k", {}, lambda: 1) == 1
    (path,) = (tmp_path / "measured").glob("k-*.json")
    path.write_text("{not json")
    assert measured.remembered("k", {}, lambda: 2) == 2
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("QUILL_CACHE", str(blocked))  # a file where the folder would be
    assert measured.remembered("k", {}, lambda: 3) == 3
