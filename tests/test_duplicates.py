"""Duplicated code stays down: pylint's duplicate-code check (``symilar``) over the library's sources."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("portable_nn", "kernels_cpu", "kernels_gpu", "kernels_aten")
#: Duplicated lines allowed (blocks of >= 6 identical lines).  38 when this check was added, down from 242
#: before the ops were described once and the backends declared themselves; the margin is for a short
#: block two kernels may legitimately share.  Lower it when the count falls; never raise it to hide a copy.
LIMIT = 60


@pytest.mark.skipif(shutil.which("symilar") is None, reason="symilar (pylint) is not installed")
def test_duplicated_lines_stay_under_the_limit():
    files = sorted(str(p) for package in PACKAGES for p in (ROOT / package).rglob("*.py"))
    result = subprocess.run(["symilar", "-d", "6", *files], capture_output=True, text=True, timeout=300)
    total = re.search(r"TOTAL lines=(\d+) duplicates=(\d+)", result.stdout)
    assert total is not None, result.stdout[-2000:] + result.stderr[-2000:]
    duplicates = int(total.group(2))
    assert duplicates <= LIMIT, f"{duplicates} duplicated lines (limit {LIMIT}):\n{result.stdout[-6000:]}"
