"""test_comm_backends: the trainer's choice of comm backend, and the staged backend on device cpu.

MESHRUN_COMM_BACKEND=staged on device cpu runs every device collective through comm_staged (the
cpu backend's memory copied into staging buffers, reduced by an inner cpu ring) while the host
values (loss, eval sums, gradient-norm shares, memory report, checkpoint coordination) go through
the mesh's separate host rings. The staged ring reduces in the same order as the cpu one, so each
plan (ddp2, fsdp2, tp2, fsdp2 x tp2) must give the cpu-comm run's losses and eval losses bit for
bit, the same final weights bit for bit, and the same bytes sent per group (host rings
are counted with their group). This is the whole multi-rank plumbing of a GPU run (device
buffers, host side channels, separate uids in the store) checked without a GPU.

Also: an unknown MESHRUN_COMM_BACKEND is one line on stderr and exit 2, before anything else; nccl
on device cpu is refused with a message naming both. The tiny plan of test_parallel, 6 steps.
"""
import os
import subprocess

import pytest

from conftest import FAST_CONF, Meshrun, solo_env
from test_parallel import TRAINER, read_records, read_safetensors, sets_for, write_plan

# name: (ranks, mesh (dp_replicate, dp_shard, tp))
PLANS = {
    "ddp2": (2, (2, 1, 1)),
    "fsdp2": (2, (1, 2, 1)),
    "tp2": (2, (1, 1, 2)),
    "fsdp2_tp2": (4, (1, 2, 2)),
}
SHORT = ["train.steps=6", "eval.interval=3", "eval.batches=3"]


def run(d, nproc, mesh, comm):
    args = sets_for(d, mesh, [])
    for kv in SHORT:
        args += ["--set", kv]
    # "" is unset for the trainer: the cpu-comm run must not inherit a value from the caller.
    m = Meshrun(["--nproc_per_node=%d" % nproc, "--rdzv_conf=" + FAST_CONF, TRAINER, write_plan(d)] + args,
                env={"OMP_NUM_THREADS": "1", "MESHRUN_COMM_BACKEND": comm}, cwd=str(d))
    rc = m.wait(180)
    assert rc == 0, m.describe()
    return m


@pytest.mark.parametrize("name", list(PLANS))
def test_staged_equals_cpu(tmp_path, name):
    nproc, mesh = PLANS[name]
    runs = {}
    for comm in ("", "staged"):
        d = tmp_path / (comm or "cpu")
        d.mkdir()
        m = run(d, nproc, mesh, comm)
        want = "comm backend %s (%s)" % (comm or "cpu", "MESHRUN_COMM_BACKEND" if comm else "device cpu")
        assert want in m.err, "rank 0 did not log '%s':\n%s" % (want, m.err)
        runs[comm or "cpu"] = d
    a, b = (read_records(runs[k]) for k in ("cpu", "staged"))
    losses = lambda rs, key: [(r["step"], r[key]) for r in rs if key in r]
    for key in ("loss", "eval_loss"):
        la, lb = losses(a, key), losses(b, key)
        assert len(la) == (6 if key == "loss" else 2), la
        diff = [(x, y) for x, y in zip(la, lb) if x != y]
        print("%s %s: %d values, %d differ" % (name, key, len(la), len(diff)))
        assert la == lb, "staged %s differs from cpu (step, cpu, staged): %s" % (
            key, [(x[0], x[1], y[1]) for x, y in diff])
    comm_a, comm_b = ([r["comm"] for r in rs if "comm" in r] for rs in (a, b))
    assert comm_a and comm_a == comm_b, "bytes sent per group differ:\ncpu    %s\nstaged %s" % (comm_a[0], comm_b[0])
    # Tensors, not file bytes: the metadata's plan names each run's own checkpoint.dir.
    wa, wb = (read_safetensors(os.path.join(str(runs[k]), "ck", "final.safetensors")) for k in ("cpu", "staged"))
    assert sorted(wa) == sorted(wb)
    differ = [t for t in wa if wa[t] != wb[t]]
    assert not differ, "final weights differ between the cpu and staged comm runs: %s" % differ


def test_unknown_comm_backend(tmp_path):
    env = solo_env(MESHRUN_COMM_BACKEND="mpi")
    r = subprocess.run([TRAINER, write_plan(tmp_path), "--set", "train.steps=1"], cwd=str(tmp_path), env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("trainer: MESHRUN_COMM_BACKEND=mpi: unknown comm backend (known: cpu, nccl, staged"), \
        lines[0]


def test_nccl_on_cpu_refused(tmp_path):
    m = Meshrun(["--nproc_per_node=2", "--rdzv_conf=" + FAST_CONF, TRAINER, write_plan(tmp_path),
                 "--set", "mesh.dp_shard=2", "--set", "train.steps=1"],
                env={"OMP_NUM_THREADS": "1", "MESHRUN_COMM_BACKEND": "nccl"}, cwd=str(tmp_path))
    rc = m.wait(60)
    assert rc != 0, m.describe()
    assert "MESHRUN_COMM_BACKEND=nccl needs device cuda, and this run's device is cpu" in m.err + m.out, m.describe()
