"""Nothing a worker starts outlives its round or its meshrun (launcher/tree), and a Python worker
that cannot import a module ends the job at once (launcher/errfile, launcher/agent).

Each worker below is a bash script that leaves long sleeps behind: a plain background child (in
the worker's process group), one started with setsid (a session of its own), one daemonized
(setsid in a subshell that exits at once: an orphan). Every one of them carries a tag of its own
in its command line (TAG-<name>, unique per test), which is how the tests count survivors in
/proc; the tag is given in the environment, so neither meshrun's nor the worker's command line
holds it. Each test kills what is left of its tag at the end, whether it passed or not.

Where cgroup v2 is writable, meshrun keeps the workers in a cgroup of its own, else it finds them
through /proc (it is their subreaper); MESHRUN_CGROUP=0 makes it do the latter anywhere, so both
ways run here where both can, and each test checks which one the worker was under. Waits poll for
a condition with a deadline; the times printed are those of the cleanup, measured by polling."""
import os
import re
import signal
import time
import uuid

import pytest

from conftest import FAST_CONF, PYTHON, meshrun_guard, pids_alive, wait_for

# A worker's helpers. mark NAME [setsid|daemon] starts a long sleep whose command line holds
# $TAG-NAME and returns once it runs (its pid file is there). skip_round0 ends round 0 with exit
# 1 when $ROUND0 says so, after waiting (ROUND0=wait) until meshrun ($PPID) is in its cgroup: the
# case then runs in round 1, whose workers are born in the cgroup for sure (a round that starts
# before meshrun is in it is handled as without one, launcher/tree).
MARK = r'''
D=$1
wait_moved() { until grep -qs '^0::.*/meshrun-' /proc/$PPID/cgroup; do sleep 0.01; done; }
skip_round0() {
  [ "$TORCHELASTIC_RESTART_COUNT" = 0 ] && [ -n "$ROUND0" ] || return 0
  [ "$ROUND0" = wait ] && wait_moved
  exit 1
}
mark() {
  local cmd='echo $$ > "$1.tmp" && mv "$1.tmp" "$1" && exec -a "$0" sleep 300'
  case "$2" in
    setsid) setsid bash -c "$cmd" "$TAG-$1" "$D/$1.pid" & ;;
    daemon) ( setsid bash -c "$cmd" "$TAG-$1" "$D/$1.pid" & ) ;;
    *) bash -c "$cmd" "$TAG-$1" "$D/$1.pid" & ;;
  esac
  until [ -e "$D/$1.pid" ]; do sleep 0.01; done
}
cat /proc/self/cgroup > "$D/cgroup.$RANK.$TORCHELASTIC_RESTART_COUNT"
'''


def cgroup2_dir():
    """This process's cgroup v2 directory, or None (no cgroup2 mount or not in one)."""
    try:
        with open("/proc/self/cgroup") as f:
            own = [l[3:] for l in f.read().splitlines() if l.startswith("0::")]
        with open("/proc/self/mountinfo") as f:
            mounts = [l.split() for l in f]
    except OSError:
        return None
    for m in mounts:
        if own and m[m.index("-") + 1] == "cgroup2" and own[0].startswith(m[3]):
            return os.path.join(m[4], own[0][len(m[3]):].lstrip("/"))
    return None


def cgroup2_writable():
    d = cgroup2_dir()
    if not d:
        return False
    probe = os.path.join(d, "test-probe-%d" % os.getpid())
    try:
        os.mkdir(probe)
    except OSError:
        return False
    ok = os.path.exists(os.path.join(probe, "cgroup.kill"))
    os.rmdir(probe)
    return ok


# cgroup: the workers in meshrun's cgroup (the case in round 1); proc: MESHRUN_CGROUP=0 (also in
# round 1); cgroup-round0: the case in round 0, whose workers may be born before meshrun is in its
# cgroup (then handled as without one) or after.
MODES = ["cgroup", "proc"]
ROUND0 = {"cgroup": "wait", "proc": "fail", "cgroup-round0": ""}


def mode_env(mode, tag):
    if mode.startswith("cgroup") and not cgroup2_writable():
        pytest.skip("cgroup v2 is not writable here")
    env = {"TAG": tag, "ROUND0": ROUND0[mode]}
    if mode == "proc":
        env["MESHRUN_CGROUP"] = "0"
    return env


def check_mode(d, mode, restart):
    """The workers of that restart ran in meshrun's cgroup in mode cgroup, not in mode proc;
    returns whether they did."""
    files = sorted(f for f in os.listdir(str(d)) if f.startswith("cgroup.") and f.endswith(".%d" % restart))
    assert files, "no worker of restart %d wrote its cgroup" % restart
    inside = []
    for f in files:
        with open(os.path.join(str(d), f)) as fh:
            line = [l for l in fh.read().splitlines() if l.startswith("0::")]
        inside.append(bool(line) and "/meshrun-" in line[0])
        assert mode == "cgroup-round0" or inside[-1] == (mode == "cgroup"), "%s: %s" % (f, line)
    return all(inside)


def tagged(tag):
    """Live processes whose command line holds tag (a zombie's is empty)."""
    t = tag.encode()
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open("/proc/%s/cmdline" % p, "rb") as f:
                if t in f.read():
                    out.append(int(p))
        except OSError:
            pass
    return out


def kill_tagged(tag):
    for p in tagged(tag):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def guards_of(pid):
    """meshrun's guard processes among pid's children (launcher/tree)."""
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit() or not meshrun_guard(int(p)):
            continue
        try:
            with open("/proc/%s/stat" % p) as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(p))
        except (OSError, IndexError, ValueError):
            pass
    return out


@pytest.fixture
def tag():
    t = "meshrun-tree-test-%s" % uuid.uuid4().hex[:12]
    yield t
    kill_tagged(t)


def write_script(d, body):
    p = d / "worker.sh"
    p.write_text(MARK + body)
    return p


# ---- (a) a restart: what the failed round's worker started is gone before the next round ----

@pytest.mark.parametrize("mode", MODES)
def test_restart_leaves_no_descendant_of_the_failed_round(launch, tmp_path, tag, mode):
    script = write_script(tmp_path, '''
[ "$ROUND0" = wait ] && [ "$TORCHELASTIC_RESTART_COUNT" = 0 ] && wait_moved
mark "r$TORCHELASTIC_RESTART_COUNT"
if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then exit 1; fi
touch "$D/round1"
until [ -e "$D/go" ]; do sleep 0.01; done
''')
    m = launch(["--nproc_per_node=1", "--max_restarts=1", "--rdzv_conf=" + FAST_CONF, "bash", str(script),
                str(tmp_path)], env=mode_env(mode, tag))
    wait_for(lambda: (tmp_path / "round1").exists() or m.proc.poll() is not None, 30, "round 1 to start")
    assert (tmp_path / "round1").exists(), m.describe()
    # Round 1 runs only once round 0 is over: its leftovers must be gone by now (not in a while).
    left = pids_alive(tagged(tag + "-r0"))
    print("%s: round 0's background child alive when round 1 runs: %d" % (mode, len(left)))
    assert left == [], "round 0's background child survived the restart: %s" % left
    (tmp_path / "go").write_text("")
    assert m.wait(30) == 0, m.describe()
    t0 = time.monotonic()
    wait_for(lambda: tagged(tag) == [], 5, "every tagged process to end")
    print("%s: all gone %.1f ms after meshrun's exit" % (mode, (time.monotonic() - t0) * 1e3))
    check_mode(tmp_path, mode, 1)


# ---- (b) a setsid'd or daemonized grandchild ends with the round ----

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("nproc", [1, 2])
def test_setsid_and_daemon_grandchildren_end_with_the_round(launch, tmp_path, tag, mode, nproc):
    script = write_script(tmp_path, '''
skip_round0
mark "sid$RANK" setsid
mark "daemon$RANK" daemon
exit 0
''')
    m = launch(["--nproc_per_node=%d" % nproc, "--max_restarts=1", "--rdzv_conf=" + FAST_CONF, "bash", str(script),
                str(tmp_path)], env=mode_env(mode, tag))
    assert m.wait(30) == 0, m.describe()
    # meshrun exits once the round is over, which now includes its process tree being gone.
    left = pids_alive(tagged(tag))
    print("%s, %d worker(s): tagged processes alive at meshrun's exit: %d" % (mode, nproc, len(left)))
    assert left == [], "setsid'd or daemonized grandchildren survived meshrun: %s" % left
    assert "holds its output open" not in m.err, m.describe()
    check_mode(tmp_path, mode, 1)


# ---- (c) kill -9 of meshrun ----

@pytest.mark.parametrize("mode", MODES + ["cgroup-round0"])
def test_kill9_of_meshrun_leaves_no_descendant(launch, tmp_path, tag, mode):
    script = write_script(tmp_path, '''
skip_round0
mark "bg$RANK"
mark "sid$RANK" setsid
mark "daemon$RANK" daemon
touch "$D/ready.$RANK"
exec -a "$TAG-worker$RANK" sleep 300
''')
    m = launch(["--nproc_per_node=2", "--max_restarts=1", "--rdzv_conf=" + FAST_CONF, "bash", str(script),
                str(tmp_path)], env=mode_env(mode, tag))
    wait_for(lambda: all((tmp_path / ("ready.%d" % r)).exists() for r in range(2)) or m.proc.poll() is not None,
             30, "both workers to start their children")
    assert m.proc.poll() is None, m.describe()
    wait_for(lambda: len(pids_alive(tagged(tag))) == 8, 10, "2 workers and their 6 children to run")
    guards = guards_of(m.pid)
    m.proc.send_signal(signal.SIGKILL)  # meshrun only, not its session
    t0 = time.monotonic()
    m.wait(10)
    wait_for(lambda: pids_alive(tagged(tag)) == [], 10, "every worker and descendant to end after kill -9 of meshrun")
    inside = check_mode(tmp_path, mode, 0 if mode == "cgroup-round0" else 1)
    print("%s: 8 tagged processes gone %.1f ms after kill -9 of meshrun (workers %s the cgroup)" % (
        mode, (time.monotonic() - t0) * 1e3, "in" if inside else "outside"))
    assert len(guards) == 1, "meshrun's guards: %s" % guards
    wait_for(lambda: pids_alive(guards) == [], 10, "the guard to exit after its cleanup")


# ---- (d) a Python worker that cannot import a module ----

# case: (meshrun's arguments after the common ones, the exception, what the line names, its advice
# after the interpreter: PYTHON_EXEC only where meshrun chose the interpreter, for a *.py PROGRAM)
CASES = {
    "dash-c": (["--nproc_per_node=1", PYTHON, "-c", "import nosuchmodule_tree_test"], "ModuleNotFoundError",
               "'nosuchmodule_tree_test'", ""),
    "script-2-workers": (["--nproc_per_node=2", "train.py"], "ModuleNotFoundError", "'nosuchmodule_tree_test'",
                         " or set PYTHON_EXEC"),
    "import-error": (["--nproc_per_node=1", PYTHON, "-c", "from os import nosuchname_tree_test"], "ImportError",
                     "name 'nosuchname_tree_test' from 'os'", ""),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_missing_python_module_ends_the_job_at_once(launch, tmp_path, case):
    args, exc, what, advice = CASES[case]
    (tmp_path / "train.py").write_text("import os\nimport nosuchmodule_tree_test.sub\n")
    m = launch(["--max_restarts=3", "--rdzv_conf=" + FAST_CONF] + args, cwd=str(tmp_path),
               env={"PYTHON_EXEC": PYTHON})
    rc = m.wait(60)
    rounds = re.findall(r"\] round (\d+): node", m.err)
    lines = [l for l in m.err.splitlines() if "cannot import" in l]
    print("exit %d, rounds %s: %s" % (rc, rounds, lines[:1]))
    assert rc == 1, m.describe()
    assert rounds == ["0"], "rounds %s, not one:\n%s" % (rounds, m.describe())
    want = re.compile(r"^\[meshrun\] rank [01] \(python3\) cannot import %s \(%s\): install it for %s%s; no "
                      r"restart tried$" % (re.escape(what), exc, re.escape(PYTHON), re.escape(advice)))
    assert any(want.match(l) for l in lines), m.describe()


def test_other_python_failures_still_restart(launch, tmp_path):
    m = launch(["--nproc_per_node=1", "--max_restarts=1", "--rdzv_conf=" + FAST_CONF, PYTHON, "-c",
                "raise RuntimeError('no module named here, but not an import error')"])
    assert m.wait(60) == 1, m.describe()
    assert re.findall(r"\] round (\d+): node", m.err) == ["0", "1"], m.describe()
    assert "cannot import" not in m.err, m.describe()
