"""meshrun on one node: CLI errors, the worker environment, failures and restarts, signals,
orphans, logs. Each test starts real meshrun processes; waits are on files and exits."""
import os
import re
import signal
import stat

from conftest import (FAST_CONF, MESHRUN, PYTHON, WORKER, free_port, pids_alive, read_json, wait_for,
                      worker_cmd, worker_file)

import subprocess

import pytest


def test_unknown_flag_exits_2_naming_it(launch):
    m = launch(["--no_such_flag=1", "true"])
    assert m.wait(10) == 2, m.describe()
    lines = [l for l in m.err.splitlines() if l.strip()]
    assert len(lines) == 1 and "--no_such_flag" in lines[0], m.describe()


def test_bad_value_exits_2_naming_flag(launch):
    m = launch(["--nproc_per_node=zero", "true"])
    assert m.wait(10) == 2, m.describe()
    assert "--nproc_per_node" in m.err, m.describe()


def test_missing_program_exits_127(launch, tmp_path):
    m = launch(["--nproc_per_node=2", "/nonexistent/prog"])
    assert m.wait(10) == 127, m.describe()
    assert "meshrun: /nonexistent/prog: no such file" in m.err, m.describe()
    m = launch(["no-such-command-meshrun-test"])
    assert m.wait(10) == 127, m.describe()
    assert "command not found" in m.err, m.describe()
    f = tmp_path / "notexec.sh"
    f.write_text("#!/bin/sh\ntrue\n")
    m = launch([str(f)])
    assert m.wait(10) == 127, m.describe()
    assert "not executable" in m.err, m.describe()


def test_worker_environment(launch, tmp_path):
    m = launch(["--nproc_per_node=2", "--max_restarts=3", "--rdzv_id=envjob"] + worker_cmd(tmp_path))
    assert m.wait(30) == 0, m.describe()
    envs = [read_json(worker_file(tmp_path, r, 0, "json")) for r in range(2)]
    store = None
    for r, e in enumerate(envs):
        assert e["RANK"] == str(r)
        assert e["LOCAL_RANK"] == str(r)
        assert e["WORLD_SIZE"] == "2"
        assert e["LOCAL_WORLD_SIZE"] == "2"
        assert e["GROUP_RANK"] == "0"
        assert e["GROUP_WORLD_SIZE"] == "1"
        assert e["ROLE_RANK"] == str(r)
        assert e["ROLE_WORLD_SIZE"] == "2"
        assert e["ROLE_NAME"] == "default"
        assert e["MASTER_ADDR"] == "127.0.0.1"
        assert e["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert e["MESHRUN_ROUND"] == "0"
        assert e["TORCHELASTIC_MAX_RESTARTS"] == "3"
        assert e["TORCHELASTIC_RUN_ID"] == "envjob"
        # no log dir: the files go into the user's shared temporary directory, named per node
        assert re.search(r"/meshrun-%d/envjob-\d+-[0-9a-f]{8}-%d\.error\.json$" % (os.getuid(), r),
                         e["TORCHELASTIC_ERROR_FILE"]), e["TORCHELASTIC_ERROR_FILE"]
        assert e["OMP_NUM_THREADS"] == "1"
        host, port = e["MESHRUN_STORE"].rsplit(":", 1)
        assert host == "127.0.0.1" and 0 < int(port) < 65536
        assert 0 < int(e["MASTER_PORT"]) < 65536 and e["MASTER_PORT"] != port
        store = store or e["MESHRUN_STORE"]
        assert e["MESHRUN_STORE"] == store
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]


def test_temporary_files_shared_dir_and_removed(launch, tmp_path):
    """Without --log_dir, the error and stop files go to $TMPDIR/meshrun-<uid> (made private, 0700),
    named per node, and are gone when meshrun exits, also after a failure that wrote error files
    and a restart that wrote the stop file."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    m = launch(["--nproc_per_node=2", "--max_restarts=1", "--rdzv_id=tmpjob"] +
               worker_cmd(tmp_path, "--fail-rank", "1", "--errfile", "boom"), env={"TMPDIR": str(tmp)})
    assert m.wait(60) == 3, m.describe()
    assert "boom" in m.err, m.describe()
    shared = tmp / ("meshrun-%d" % os.getuid())
    st = os.lstat(shared)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700, oct(st.st_mode)
    ef = read_json(worker_file(tmp_path, 1, 0, "json"))["TORCHELASTIC_ERROR_FILE"]
    assert os.path.dirname(ef) == str(shared), ef
    assert os.listdir(shared) == [], os.listdir(shared)
    assert sorted(os.listdir(tmp)) == [shared.name]


def test_temporary_dir_not_ours_is_not_used(launch, tmp_path):
    """A $TMPDIR/meshrun-<uid> that others may write (here 0777) is left alone: the node makes a
    directory of its own, and removes it at exit."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    shared = tmp / ("meshrun-%d" % os.getuid())
    shared.mkdir()
    os.chmod(shared, 0o777)
    m = launch(["--nproc_per_node=1", "--rdzv_id=tmpjob2"] + worker_cmd(tmp_path), env={"TMPDIR": str(tmp)})
    assert m.wait(30) == 0, m.describe()
    ef = read_json(worker_file(tmp_path, 0, 0, "json"))["TORCHELASTIC_ERROR_FILE"]
    assert re.search(r"/meshrun-tmpjob2-[^/]+/0\.error\.json$", ef), ef
    assert sorted(os.listdir(tmp)) == [shared.name] and os.listdir(shared) == []


def test_omp_num_threads_kept_when_set(launch, tmp_path):
    m = launch(["--nproc_per_node=1"] + worker_cmd(tmp_path), env={"OMP_NUM_THREADS": "7"})
    assert m.wait(30) == 0, m.describe()
    assert read_json(worker_file(tmp_path, 0, 0, "json"))["OMP_NUM_THREADS"] == "7"


def test_restarts_exhausted_exit_code_and_summary(launch, tmp_path):
    m = launch(["--nproc_per_node=2", "--max_restarts=1"] +
               worker_cmd(tmp_path, "--fail-rank=1", "--code=7", "--errfile=boom: rank one broke"))
    assert m.wait(30) == 7, m.describe()
    # attempt 0 and attempt 1 both ran, then the budget (1 restart) was spent.
    assert os.path.exists(worker_file(tmp_path, 1, 0, "exit"))
    assert os.path.exists(worker_file(tmp_path, 1, 1, "exit"))
    assert not os.path.exists(worker_file(tmp_path, 0, 2, "json"))
    assert "root cause" in m.err and "boom: rank one broke" in m.err, m.describe()
    assert re.search(r"rank:\s+1\b", m.err) and re.search(r"exitcode:\s+7\b", m.err), m.describe()
    assert re.search(r"host:\s+\S+", m.err) and re.search(r"time:\s+\d{4}-", m.err), m.describe()


def test_plain_error_file_message(launch, tmp_path):
    m = launch(["--nproc_per_node=1"] +
               worker_cmd(tmp_path, "--fail-rank=0", "--code=5", "--errfile=plain message", "--errfile-plain"))
    assert m.wait(30) == 5, m.describe()
    assert "plain message" in m.err, m.describe()


def test_restart_after_failure_increments_attempt(launch, tmp_path):
    m = launch(["--nproc_per_node=2", "--max_restarts=2"] +
               worker_cmd(tmp_path, "--fail-rank=0", "--fail-attempts=1", "--code=4"))
    assert m.wait(30) == 0, m.describe()
    for r in range(2):
        e = read_json(worker_file(tmp_path, r, 1, "json"))
        assert e["TORCHELASTIC_RESTART_COUNT"] == "1" and e["MESHRUN_ROUND"] == "1", e
        assert os.path.exists(worker_file(tmp_path, r, 1, "done"))


def test_kill9_worker_restarts(launch, tmp_path):
    m = launch(["--nproc_per_node=2", "--max_restarts=1", "--shutdown_timeout=5"] +
               worker_cmd(tmp_path, "--hang-until=%s" % (tmp_path / "go")))
    f = wait_for(lambda: os.path.exists(worker_file(tmp_path, 1, 0, "json")) and worker_file(tmp_path, 1, 0, "json"),
                 20, "rank 1 to start")
    pid = read_json(f)["_pid"]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: os.path.exists(worker_file(tmp_path, 0, 1, "json")) and
             os.path.exists(worker_file(tmp_path, 1, 1, "json")), 20, "attempt 1 to start")
    (tmp_path / "go").write_text("")
    assert m.wait(30) == 0, m.describe()
    assert "SIGKILL" in m.err, m.describe()
    e = read_json(worker_file(tmp_path, 1, 1, "json"))
    assert e["TORCHELASTIC_RESTART_COUNT"] == "1" and e["MESHRUN_ROUND"] == "1", e


def test_signal_death_exit_code_is_128_plus_signal(launch, tmp_path):
    m = launch(["--nproc_per_node=1", "sh", "-c", "kill -SEGV $$"])
    assert m.wait(20) == 128 + signal.SIGSEGV, m.describe()
    assert "SIGSEGV" in m.err, m.describe()


def test_sigint_is_forwarded_then_meshrun_exits(launch, tmp_path):
    m = launch(["--nproc_per_node=2", "--shutdown_timeout=10"] + worker_cmd(tmp_path, "--hang"))
    wait_for(lambda: all(os.path.exists(worker_file(tmp_path, r, 0, "json")) for r in range(2)), 20,
             "both workers to start")
    pids = [read_json(worker_file(tmp_path, r, 0, "json"))["_pid"] for r in range(2)]
    m.signal(signal.SIGINT)
    assert m.wait(20) == 128 + signal.SIGINT, m.describe()
    for r in range(2):
        assert os.path.exists(worker_file(tmp_path, r, 0, "sig%d" % signal.SIGINT)), "rank %d got no SIGINT" % r
    assert pids_alive(pids) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_term_and_hup_are_forwarded_then_meshrun_exits(launch, tmp_path, sig):
    m = launch(["--nproc_per_node=2", "--shutdown_timeout=10"] + worker_cmd(tmp_path, "--hang"))
    wait_for(lambda: all(os.path.exists(worker_file(tmp_path, r, 0, "json")) for r in range(2)), 20,
             "both workers to start")
    pids = [read_json(worker_file(tmp_path, r, 0, "json"))["_pid"] for r in range(2)]
    m.signal(sig)
    assert m.wait(20) == 128 + sig, m.describe()
    for r in range(2):
        # The worker saw the signal meshrun got (not a SIGTERM of meshrun's own choosing).
        assert os.path.exists(worker_file(tmp_path, r, 0, "sig%d" % sig)), "rank %d got no %s\n%s" % (
            r, sig.name, m.describe())
    assert pids_alive(pids) == []
    assert not os.path.exists(worker_file(tmp_path, 0, 1, "json"))  # a shutdown, not a restart


def test_sigusr2_is_forwarded_and_job_continues(launch, tmp_path):
    m = launch(["--nproc_per_node=2"] + worker_cmd(tmp_path, "--hang-until=%s" % (tmp_path / "go")))
    wait_for(lambda: all(os.path.exists(worker_file(tmp_path, r, 0, "json")) for r in range(2)), 20,
             "both workers to start")
    m.signal(signal.SIGUSR2)
    wait_for(lambda: all(os.path.exists(worker_file(tmp_path, r, 0, "sig%d" % signal.SIGUSR2)) for r in range(2)),
             20, "SIGUSR2 to reach both workers")
    assert m.proc.poll() is None, m.describe()
    (tmp_path / "go").write_text("")
    assert m.wait(20) == 0, m.describe()
    for r in range(2):
        assert os.path.exists(worker_file(tmp_path, r, 0, "done"))
        assert not os.path.exists(worker_file(tmp_path, r, 1, "json"))


def test_sigusr1_is_forwarded_and_job_continues(launch, tmp_path):
    m = launch(["--nproc_per_node=2"] + worker_cmd(tmp_path, "--hang-until=%s" % (tmp_path / "go")))
    wait_for(lambda: all(os.path.exists(worker_file(tmp_path, r, 0, "json")) for r in range(2)), 20,
             "both workers to start")
    m.signal(signal.SIGUSR1)
    wait_for(lambda: all(os.path.exists(worker_file(tmp_path, r, 0, "sig%d" % signal.SIGUSR1)) for r in range(2)),
             20, "SIGUSR1 to reach both workers")
    (tmp_path / "go").write_text("")
    assert m.wait(20) == 0, m.describe()


def test_kill9_meshrun_leaves_no_process(launch, tmp_path):
    m = launch(["--nproc_per_node=3"] + worker_cmd(tmp_path, "--hang"))
    wait_for(lambda: all(os.path.exists(worker_file(tmp_path, r, 0, "json")) for r in range(3)), 20,
             "three workers to start")
    pids = [read_json(worker_file(tmp_path, r, 0, "json"))["_pid"] for r in range(3)]
    assert len(pids_alive(pids)) == 3
    m.proc.send_signal(signal.SIGKILL)  # meshrun only, not its session
    m.wait(10)
    wait_for(lambda: pids_alive(pids) == [], 10, "workers %s to die with their agent" % pids)


def test_log_dir_redirects_tee_and_filter(launch, tmp_path):
    logs = tmp_path / "logs"
    d = tmp_path / "w"
    d.mkdir()
    # stdout of every rank redirected (files only); stderr teed (files and console);
    # only local rank 1 reaches the console.
    m = launch(["--nproc_per_node=2", "--rdzv_id=logjob", "--log_dir", str(logs), "--redirects=1", "--tee=2",
                "--local_ranks_filter=1"] + worker_cmd(d, "--print=2"))
    assert m.wait(30) == 0, m.describe()
    runs = sorted(logs.iterdir())
    assert len(runs) == 1 and re.fullmatch(r"logjob_\w{6}", runs[0].name), runs
    assert "worker logs: %s" % runs[0] in m.err, m.describe()
    for r in range(2):
        base = runs[0] / "attempt_0" / str(r)
        out = (base / "stdout.log").read_text()
        err = (base / "stderr.log").read_text()
        assert out == "".join("out line %d from %d\n" % (i, r) for i in range(2)), out
        assert err == "".join("err line %d from %d\n" % (i, r) for i in range(2)), err
    assert "out line" not in m.out, m.describe()  # redirected: not on the console
    assert "[rank1]:err line 0 from 1" in m.err, m.describe()  # teed, prefixed
    assert "from 0" not in m.err, m.describe()  # filtered out


def test_console_prefix_only_with_several_workers(launch, tmp_path):
    m = launch(["--nproc_per_node=2"] + worker_cmd(tmp_path, "--print=1"))
    assert m.wait(30) == 0, m.describe()
    assert "[rank0]:out line 0 from 0" in m.out and "[rank1]:out line 0 from 1" in m.out, m.describe()
    m = launch(["--nproc_per_node=1"] + worker_cmd(tmp_path, "--print=1"))
    assert m.wait(30) == 0, m.describe()
    assert "out line 0 from 0\n" in m.out and "[rank" not in m.out, m.describe()


@pytest.mark.parametrize("code", [0, 3], ids=["success", "failure"])
def test_background_child_holding_output_neither_hangs_nor_survives(launch, tmp_path, code):
    # Each worker leaves a long sleep in its process group that inherited its stdout/stderr pipes
    # (two workers: the console is prefixed, so output goes through pipes). meshrun must not wait
    # for those pipes' EOF, and the sleeps must not outlive it.
    # Each pid file appears whole (written aside, then renamed), and each rank exits only once the
    # other's exists (polled, not slept), so both background children exist before any exit.
    script = ('sleep 300 & echo $! > "$0/bg.$RANK.tmp" && mv "$0/bg.$RANK.tmp" "$0/bg.$RANK"; '
              'while [ ! -e "$0/bg.$((1 - RANK))" ]; do :; done; exit %d') % code
    m = launch(["--nproc_per_node=2", "--max_restarts=0", "sh", "-c", script, str(tmp_path)])
    assert m.wait(30) == code, m.describe()
    assert (tmp_path / "bg.0").exists() and (tmp_path / "bg.1").exists(), m.describe()
    pids = [int(f.read_text()) for f in tmp_path.glob("bg.[0-9]")]
    wait_for(lambda: pids_alive(pids) == [], 10, "background children %s to die with their group" % pids)


def test_output_held_outside_the_tree_does_not_hang(launch, tmp_path):
    # What a worker started is killed with its round (test_process_tree.py); a process outside
    # meshrun's tree that holds a worker's output pipe (here this test, through /proc/PID/fd/1)
    # cannot be, but meshrun still exits after a bounded drain.
    # Each worker exits only once the pipe is held (polled, not slept).
    script = ('echo $$ > "$0/pid.$RANK.tmp" && mv "$0/pid.$RANK.tmp" "$0/pid.$RANK"; '
              'while [ ! -e "$0/held" ]; do sleep 0.01; done; exit 0')
    m = launch(["--nproc_per_node=2", "sh", "-c", script, str(tmp_path)])
    wait_for(lambda: (tmp_path / "pid.0").exists(), 20, "rank 0 to start")
    held = open("/proc/%d/fd/1" % int((tmp_path / "pid.0").read_text()), "wb")
    try:
        (tmp_path / "held").write_text("")
        assert m.wait(30) == 0, m.describe()
        assert "rank 0 exited but a process outside meshrun's tree still holds its output open" in m.err, m.describe()
    finally:
        held.close()


def test_success_line_counts_workers_in_words(launch):
    """One worker: "the worker exited 0" (was "all 1 workers exited 0"); more: "all N workers"."""
    m = launch(["--nproc_per_node=1", "true"])
    assert m.wait(30) == 0, m.describe()
    assert "round 0: the worker exited 0" in m.err and "all 1 workers" not in m.err, m.describe()
    m = launch(["--nproc_per_node=3", "true"])
    assert m.wait(30) == 0, m.describe()
    assert "round 0: all 3 workers exited 0" in m.err, m.describe()


def test_omp_num_threads_notice(launch):
    """Like torchrun: one line when meshrun sets OMP_NUM_THREADS=1 for several workers; none when
    the user set it, or for one worker."""
    notice = "OMP_NUM_THREADS=1 for each of the 2 workers"
    m = launch(["--nproc_per_node=2", "true"])
    assert m.wait(30) == 0, m.describe()
    assert m.err.count(notice) == 1, m.describe()
    m = launch(["--nproc_per_node=2", "true"], env={"OMP_NUM_THREADS": "4"})
    assert m.wait(30) == 0, m.describe()
    assert "OMP_NUM_THREADS=1" not in m.err, m.describe()
    m = launch(["--nproc_per_node=1", "true"])
    assert m.wait(30) == 0, m.describe()
    assert "OMP_NUM_THREADS=1" not in m.err, m.describe()


def test_failure_summary_names_the_program_and_interpreter(launch, tmp_path):
    """The root-cause block names what ran: a .py worker with its interpreter, as torchrun names
    the script."""
    script = tmp_path / "fail.py"
    script.write_text("import sys\nsys.exit(4)\n")
    m = launch(["--nproc_per_node=1", str(script), "--flag", "x"], env={"PYTHON_EXEC": PYTHON})
    assert m.wait(30) == 4, m.describe()
    lines = [l for l in m.err.splitlines() if "program:" in l]
    print(lines)
    assert lines == ["[meshrun]   program:   %s -u %s --flag x" % (PYTHON, script)], m.describe()
    m = launch(["--nproc_per_node=1", "sh", "-c", "exit 5"])
    assert m.wait(30) == 5, m.describe()
    assert "[meshrun]   program:   sh -c exit 5" in m.err, m.describe()


def test_exit_69_described_alike(launch):
    """--help and the README give exit 69 the same cause and the same number for etcd (a call
    that no member serves within 5 s), not join_timeout in one and the call timeout in the other."""
    m = launch(["--help"])
    assert m.wait(10) == 0, m.describe()
    block = m.out[m.out.index("\n  69 "):]
    block = block[:block.index("\n  127 ")]
    print(block)
    assert "within 5 s" in block and "join_timeout" not in block
    readme = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "README.md")
    with open(readme) as f:
        row = [l for l in f.read().splitlines() if l.startswith("| 69 |")]
    print(row)
    assert len(row) == 1 and "5 s" in row[0] and "join_timeout" not in row[0]


def test_log_dir_runs_never_overwrite_each_other(launch, tmp_path):
    """Two runs with the same --log_dir and the default run id each get a folder of their own
    (was: both wrote <log_dir>/none/attempt_0)."""
    logs = tmp_path / "logs"
    for i in range(2):
        m = launch(["--nproc_per_node=1", "--tee=3", "--log_dir", str(logs), "sh", "-c", "echo run %d" % i])
        assert m.wait(30) == 0, m.describe()
    runs = sorted(logs.iterdir())
    print(runs)
    assert len(runs) == 2 and all(re.fullmatch(r"none_\w{6}", r.name) for r in runs), runs
    outs = sorted((r / "attempt_0" / "0" / "stdout.log").read_text() for r in runs)
    assert outs == ["run 0\n", "run 1\n"], outs


def test_master_port_is_the_workers_on_one_node(launch, tmp_path):
    """--master_port on one node is every worker's MASTER_PORT, in every round, as torchrun gives
    it (was: ignored, a random port); meshrun's own store is elsewhere. In round 0 each worker
    has printed before any fails: a rank fails only once both have left their mark."""
    port = free_port()
    m = launch(["--nproc_per_node=2", "--max_restarts=1", "--master_port=%d" % port, "sh", "-c",
                'echo "port $MASTER_PORT store $MESHRUN_STORE round $TORCHELASTIC_RESTART_COUNT"; '
                '[ "$TORCHELASTIC_RESTART_COUNT" = 1 ] && exit 0; touch "$0/$RANK"; '
                'while [ ! -e "$0/0" ] || [ ! -e "$0/1" ]; do sleep 0.01; done; exit 1', str(tmp_path)])
    assert m.wait(30) == 0, m.describe()
    lines = re.findall(r"port (\d+) store \S+:(\d+) round (\d)", m.out)
    print(lines)
    assert len(lines) == 4 and {(p, r) for p, _, r in lines} == {(str(port), "0"), (str(port), "1")}, m.describe()
    assert all(s != str(port) for _, s, _ in lines), m.describe()
