"""meshrun and its environment: Python programs run as torchrun runs them, flags from torchrun's
PET_<FLAG> variables, and a Slurm job's variables standing in for every rendezvous flag.

Each test starts real meshrun processes on loopback. Variables the caller may have (a Slurm job,
a Kubeflow pod) are blanked in every launch (meshrun takes an empty one as unset), so the tests
see only what they set. Waits are on exits and files, ports are free ones the kernel picks.
"""
import os

from conftest import PYTHON, free_port, read_json, wait_for, worker_cmd, worker_file

# A program only Python can run: no "#!", not executable. It prints what proves how it was run.
SCRIPT = '''import os, sys
print("rank=%s world=%s args=%s unbuffered=%s exe=%s" % (
    os.environ["RANK"], os.environ["WORLD_SIZE"], ",".join(sys.argv[1:]),
    "-u" in getattr(sys, "orig_argv", ["-u"]), sys.executable))
'''


def env_of(**extra):
    """Blanks every PET_*, SLURM_*, MESHRUN_SLURM_PORT and PYTHON_EXEC of the caller's, then
    adds extra."""
    env = {k: "" for k in os.environ
           if k.startswith(("PET_", "SLURM_")) or k in ("MESHRUN_SLURM_PORT", "PYTHON_EXEC")}
    env.update(extra)
    return env


def rank_lines(out):
    """{rank: line} of the SCRIPT's lines in meshrun's stdout ("[rank1]:rank=1 ..." or bare)."""
    lines = {}
    for l in out.splitlines():
        if "rank=" in l:
            body = l.split("]:", 1)[-1]
            fields = dict(f.split("=", 1) for f in body.split())
            lines[int(fields["rank"])] = fields
    return lines


# ---- Python programs ----

def test_py_program_runs_under_python3(launch, tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    m = launch(["--nproc_per_node=2", "script.py", "a", "--b=1"], env=env_of(), cwd=str(tmp_path))
    assert m.wait(30) == 0, m.describe()
    lines = rank_lines(m.out)
    print(lines)
    assert sorted(lines) == [0, 1], m.describe()
    for r, f in lines.items():
        assert f["world"] == "2" and f["args"] == "a,--b=1", f
        assert f["unbuffered"] == "True", f  # torchrun's "python -u"


def test_python_exec_chooses_the_interpreter(launch, tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    m = launch(["--nproc_per_node=1", "script.py"], env=env_of(PYTHON_EXEC=PYTHON), cwd=str(tmp_path))
    assert m.wait(30) == 0, m.describe()
    f = rank_lines(m.out)[0]
    assert os.path.realpath(f["exe"]) == os.path.realpath(PYTHON), f


def test_no_python_execs_the_program(launch, tmp_path):
    # A shell script named *.py: exec'd as is with --no_python (or PET_NO_PYTHON=1), while
    # Python would fail on it.
    tool = tmp_path / "tool.py"
    tool.write_text("#!/bin/sh\necho \"shell rank=$RANK\"\n")
    tool.chmod(0o755)
    for args, extra in ((["--no_python"], {}), ([], {"PET_NO_PYTHON": "1"})):
        m = launch(args + ["--nproc_per_node=2", str(tool)], env=env_of(**extra))
        assert m.wait(30) == 0, m.describe()
        assert "[rank0]:shell rank=0" in m.out and "[rank1]:shell rank=1" in m.out, m.describe()
    m = launch(["--nproc_per_node=1", str(tool)], env=env_of())
    rc = m.wait(30)
    print("under python: exit %d" % rc)
    assert rc != 0 and "SyntaxError" in m.err, m.describe()


def test_module_runs_python_m(launch, tmp_path):
    (tmp_path / "mymod.py").write_text(SCRIPT)
    m = launch(["--nproc_per_node=2", "-m", "mymod", "x"], env=env_of(), cwd=str(tmp_path))
    assert m.wait(30) == 0, m.describe()
    lines = rank_lines(m.out)
    assert sorted(lines) == [0, 1] and all(f["args"] == "x" for f in lines.values()), m.describe()


def test_missing_python_exits_127(launch, tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    empty = tmp_path / "empty-path"
    empty.mkdir()
    # Not on PATH: the shell's "command not found", before any rendezvous.
    m = launch(["--nproc_per_node=2", "script.py"], env=env_of(PATH=str(empty)), cwd=str(tmp_path))
    assert m.wait(30) == 127, m.describe()
    assert "meshrun: python3: command not found" in m.err, m.describe()
    # A PYTHON_EXEC that does not exist, for a script and for a module.
    for args in (["script.py"], ["-m", "mymod"]):
        m = launch(["--nproc_per_node=1"] + args, env=env_of(PYTHON_EXEC="/nonexistent/python3"),
                   cwd=str(tmp_path))
        assert m.wait(30) == 127, m.describe()
        assert "/nonexistent/python3: no such file" in m.err, m.describe()


# ---- PET_<FLAG> ----

def test_pet_nproc_per_node_starts_three_workers(launch, tmp_path):
    m = launch(worker_cmd(tmp_path), env=env_of(PET_NPROC_PER_NODE="3"))
    assert m.wait(30) == 0, m.describe()
    for r in range(3):
        e = read_json(worker_file(tmp_path, r, 0, "json"))
        assert e["WORLD_SIZE"] == "3" and e["LOCAL_WORLD_SIZE"] == "3", e
    assert not os.path.exists(worker_file(tmp_path, 3, 0, "json"))


def test_command_line_wins_over_pet(launch, tmp_path):
    # PET_NNODES is not even read when --nnodes is given: its bad value is no error then.
    pet = dict(PET_NPROC_PER_NODE="3", PET_RDZV_ID="from-env", PET_NNODES="not-a-number", PET_MAX_RESTARTS="4")
    m = launch(["--nproc_per_node=2", "--nnodes=1"] + worker_cmd(tmp_path), env=env_of(**pet))
    assert m.wait(30) == 0, m.describe()
    e = read_json(worker_file(tmp_path, 0, 0, "json"))
    assert e["WORLD_SIZE"] == "2", e                  # the command line's
    assert e["TORCHELASTIC_RUN_ID"] == "from-env", e  # PET_'s, where the command line says nothing
    assert e["TORCHELASTIC_MAX_RESTARTS"] == "4", e


def test_bad_pet_value_exits_2_naming_the_variable(launch, tmp_path):
    m = launch(worker_cmd(tmp_path), env=env_of(PET_NNODES="not-a-number"))
    assert m.wait(30) == 2, m.describe()
    lines = [l for l in m.err.splitlines() if l.strip()]
    print(lines)
    assert len(lines) == 1, m.describe()
    assert lines[0].startswith('meshrun: PET_NNODES (--nnodes): "not-a-number" is not valid; expected'), \
        m.describe()


# ---- Slurm ----

def slurm_env(job, nnodes, nodeid, nodelist, port, **extra):
    return env_of(SLURM_JOB_ID=str(job), SLURM_NNODES=str(nnodes), SLURM_NODEID=str(nodeid),
                  SLURM_JOB_NODELIST=nodelist, MESHRUN_SLURM_PORT=str(port), **extra)


def test_slurm_one_node_without_rendezvous_flags(launch, tmp_path):
    port = free_port()
    m = launch(worker_cmd(tmp_path),
               env=slurm_env(777, 1, 0, "localhost", port, SLURM_NTASKS_PER_NODE="2"))
    assert m.wait(30) == 0, m.describe()
    info = [l for l in m.err.splitlines() if "options from Slurm" in l]
    print(info)
    assert len(info) == 1 and "--rdzv_endpoint=localhost:%d" % port in info[0], m.describe()
    for r in range(2):
        e = read_json(worker_file(tmp_path, r, 0, "json"))
        assert e["WORLD_SIZE"] == "2" and e["LOCAL_WORLD_SIZE"] == "2", e
        assert e["TORCHELASTIC_RUN_ID"] == "777", e
        assert e["MESHRUN_STORE"] == "localhost:%d" % port, e
    assert not os.path.exists(worker_file(tmp_path, 2, 0, "json"))


def test_slurm_two_nodes_as_srun_starts_them(launch, tmp_path):
    # "srun meshrun PROGRAM" on two nodes: the same command, only SLURM_NODEID differs; node 0
    # (the first host of the list) serves the store, node 1 finds it there.
    port = free_port()
    nodes = [launch(worker_cmd(tmp_path, "--meet"),
                    env=slurm_env(31, 2, nodeid, "localhost,127.0.0.1", port, SLURM_GPUS_ON_NODE="2",
                                  MESHRUN_RDZV_TOKEN="slurm-test-secret-0123456789"))
             for nodeid in (0, 1)]
    for m in nodes:
        assert m.wait(60) == 0, m.describe()
    envs = [read_json(worker_file(tmp_path, r, 0, "json")) for r in range(4)]
    for r, e in enumerate(envs):
        assert e["WORLD_SIZE"] == "4" and e["GROUP_WORLD_SIZE"] == "2", e
        assert e["GROUP_RANK"] == str(r // 2), e       # SLURM_NODEID orders the nodes
        assert e["TORCHELASTIC_RUN_ID"] == "31", e
    wait_for(lambda: all(os.path.exists(worker_file(tmp_path, r, 0, "meet")) for r in range(4)), 10,
             "every rank to have met")
    assert read_json(worker_file(tmp_path, 0, 0, "meet"))["peers"] == [1, 2, 3]


def test_slurm_bad_nodelist_is_a_usage_error(launch, tmp_path):
    m = launch(worker_cmd(tmp_path), env=slurm_env(5, 1, 0, "gpu-[01", free_port()))
    assert m.wait(30) == 2, m.describe()
    lines = [l for l in m.err.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("meshrun: SLURM_JOB_NODELIST=\"gpu-[01\""), m.describe()
