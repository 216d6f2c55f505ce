"""The AVX2 library runs on AVX-512 CPUs too: every kernel file's native tests, in one process
that loads it (one start-up for them all, not one a file)."""

from __future__ import annotations

import pytest

from quill.ops import library
from tests.conftest import NATIVE, run_native_tests_with_avx2

KERNEL_TESTS = [
    "tests/test_attention.py",  # paged attention
    "tests/test_dense.py",  # fp32 FMAs after widening, 4 rows a pass
    "tests/test_fused.py",
    "tests/test_kquant.py",
    "tests/test_qlinear.py",  # vpmaddubsw, no VNNI
]


@pytest.mark.skipif(
    "avx512" not in library.runnable_isas(), reason="the CPU lacks AVX-512 (avx512_bf16, VNNI)"
)
@pytest.mark.skipif(
    NATIVE is None or NATIVE.isa != "avx512", reason="the AVX-512 library is not loaded"
)
def test_the_avx2_library_passes_every_kernel_files_native_tests():
    assert library.library_path("avx2").is_file(), "`make setup` builds every library the CPU runs"
    run_native_tests_with_avx2(*KERNEL_TESTS)
