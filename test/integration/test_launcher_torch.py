"""A PyTorch gloo program runs under meshrun unchanged: first attempt and after a restart."""
import os

import pytest

from conftest import PYTHON

HERE = os.path.dirname(os.path.abspath(__file__))
PROG = os.path.join(HERE, "torch_allreduce.py")

try:
    import torch.distributed  # noqa: F401
    HAVE_TORCH = True
except Exception:
    HAVE_TORCH = False


def result(d, rank, attempt):
    with open(os.path.join(str(d), "r%d.a%d" % (rank, attempt))) as f:
        got, expect = map(float, f.read().split())
    return got, expect


@pytest.mark.skipif(not HAVE_TORCH, reason="needs torch in /usr/bin/python3")
def test_torch_gloo_allreduce(launch, tmp_path):
    m = launch(["--nproc_per_node=2", PYTHON, PROG, str(tmp_path)])
    assert m.wait(120) == 0, m.describe()
    for r in range(2):
        got, expect = result(tmp_path, r, 0)
        assert got == expect == 3.0, (got, expect)


@pytest.mark.skipif(not HAVE_TORCH, reason="needs torch in /usr/bin/python3")
def test_torch_gloo_restart_after_failure(launch, tmp_path):
    m = launch(["--nproc_per_node=2", "--max_restarts=1", "--shutdown_timeout=10", PYTHON, PROG, str(tmp_path),
                "--fail-first"])
    assert m.wait(180) == 0, m.describe()
    assert not os.path.exists(os.path.join(str(tmp_path), "r1.a0"))
    for r in range(2):
        got, expect = result(tmp_path, r, 1)
        assert got == expect == 3.0, (got, expect)
    assert "exited with code 1" in m.err, m.describe()
