"""The package as a user installs it: a wheel built from the checkout carries the CUDA sources of
the top-level kernels/csrc (where the JIT loader finds them), the FP8 GEMM table, the license and
the ``minisgl`` command."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_wheel_carries_the_kernel_sources(tmp_path: Path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(ROOT), "-w", str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (wheel,) = tmp_path.glob("minisgl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for cu in (ROOT / "kernels" / "csrc").glob("*.cu"):
        assert f"minisgl/device/kernels/csrc/{cu.name}" in names
    assert "minisgl/device/kernels/configs/fp8_gemm.json" in names
    assert any(n.endswith("licenses/LICENSE") for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "minisgl = minisgl.launch:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
