"""``.ci/gpu-suite``'s four parts select every gpu-marked test exactly once."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def collected(*args: str) -> set[str]:
    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return {line for line in out.stdout.splitlines() if re.match(r"tests/\S+\.py::", line)}


def test_gpu_suite_parts_cover_every_gpu_test_once():
    every = collected(sys.executable, "-m", "pytest", "-m", "gpu", "-n", "0", "--co", "-q", "-p", "no:randomly")
    # -n 0: collecting needs no workers (the parts' 15 each took most of this test's 46 s on 2 cores)
    parts = [collected("bash", ".ci/gpu-suite", part, "--co", "-p", "no:randomly", "-n", "0") for part in ("serial", "A", "B", "C")]
    assert every and all(parts)
    assert sum(len(p) for p in parts) == len(every)
    assert set().union(*parts) == every
