"""One console for many ranks (--merge_output, launcher/console.h): identical lines that several
local ranks print at about the same time reach the console once, prefixed with the rank set;
different lines, a late rank's line, a filtered console, the off switch and two ranks keep
today's "[rank<R>]:" lines. Every test counts the console's lines exactly and checks that no
rank's line is lost or reordered.

The workers meet at a barrier of files before they print (polled, not slept), so that "at about
the same time" does not depend on how fast the machine starts eight Pythons; where a test needs
lines merged it widens the window (MESHRUN_MERGE_WINDOW_MS) so that a loaded machine still
merges them. The one worker that must be late sleeps ten windows after the others are done.
"""
import re

from conftest import PYTHON

WORKER = r'''
import os, sys, time
mode, d = sys.argv[1], sys.argv[2]
local, n = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
rank = int(os.environ["RANK"])

def out(text, stream=sys.stdout):
    stream.write(text)
    stream.flush()

def mark(name):
    open(os.path.join(d, "%s.%d" % (name, local)), "w").close()

def wait(name, ranks):
    deadline = time.monotonic() + 60
    while not all(os.path.exists(os.path.join(d, "%s.%d" % (name, r))) for r in ranks):
        if time.monotonic() > deadline:
            sys.exit(9)
        time.sleep(0.001)

mark("ready")
wait("ready", range(n))
if mode == "same":
    for i in range(3):
        out("line %d\n" % i)
    out("err line\n", sys.stderr)
elif mode == "different":
    for i in range(2):
        out("I am rank %d, line %d\n" % (rank, i))
elif mode == "mixed":
    out("same\n")
    out("mine %d\n" % rank)
elif mode == "late":
    if local < n - 1:
        out("sync\n")
        mark("done")
    else:
        wait("done", range(n - 1))
        time.sleep(float(sys.argv[3]))
        out("sync\n")
elif mode == "crash":
    # the others first, so that the stop after the crash finds them done
    if local == 5:
        wait("done", [r for r in range(n) if r != 5])
        out("dying", sys.stderr)
        os._exit(3)
    out("alive\n")
    mark("done")
'''


def start(launch, tmp_path, nproc, mode, *flags, window_ms=None, extra=()):
    script = tmp_path / "console_worker.py"
    script.write_text(WORKER)
    d = tmp_path / "sync"
    d.mkdir()
    # "" is unset: meshrun's default window, whatever the caller's environment says
    env = {"MESHRUN_MERGE_WINDOW_MS": "" if window_ms is None else str(window_ms)}
    return launch(["--nproc_per_node=%d" % nproc] + list(flags) + [PYTHON, str(script), mode, str(d)] + list(extra),
                  env=env)


def ranks_of(prefix):
    """The ranks a console prefix names: "[rank3]:" or "[ranks 0-3,6]:"."""
    m = re.fullmatch(r"\[rank(\d+)\]:", prefix)
    if m:
        return [int(m.group(1))]
    m = re.fullmatch(r"\[ranks ([0-9,-]+)\]:", prefix)
    assert m, prefix
    ranks = []
    for part in m.group(1).split(","):
        lo, _, hi = part.partition("-")
        ranks += list(range(int(lo), int(hi or lo) + 1))
    assert ranks == sorted(set(ranks)) and len(ranks) > 1, prefix
    return ranks


def console_lines(text):
    """[(ranks, line)] of the workers' lines on a console stream (meshrun's own are skipped)."""
    lines = []
    for l in text.splitlines():
        m = re.match(r"(\[ranks? [0-9,-]+\]:|\[rank\d+\]:)(.*)", l)
        if m:
            lines.append((ranks_of(m.group(1)), m.group(2)))
    return lines


def per_rank(lines):
    """{rank: [its lines in console order]}: what each rank printed, merged lines counted for each."""
    by = {}
    for ranks, text in lines:
        for r in ranks:
            by.setdefault(r, []).append(text)
    return by


def test_identical_lines_of_eight_ranks_are_one_line_each(launch, tmp_path):
    logs = tmp_path / "logs"
    m = start(launch, tmp_path, 8, "same", "--tee=3", "--log_dir", str(logs), window_ms=5000)
    assert m.wait(60) == 0, m.describe()
    assert m.out.splitlines() == ["[ranks 0-7]:line %d" % i for i in range(3)], m.describe()
    # stderr apart from stdout: its own merged line, and none of stdout's
    assert console_lines(m.err) == [(list(range(8)), "err line")], m.describe()
    # the per-rank files stay each rank's own, complete and unmerged
    run = next(logs.iterdir())
    for r in range(8):
        assert (run / "attempt_0" / str(r) / "stdout.log").read_text() == "line 0\nline 1\nline 2\n"
        assert (run / "attempt_0" / str(r) / "stderr.log").read_text() == "err line\n"


def test_different_lines_keep_their_own_prefix(launch, tmp_path):
    m = start(launch, tmp_path, 8, "different")
    assert m.wait(60) == 0, m.describe()
    lines = m.out.splitlines()
    assert len(lines) == 16, m.describe()
    assert sorted(lines) == sorted("[rank%d]:I am rank %d, line %d" % (r, r, i) for r in range(8) for i in range(2))
    for r in range(8):  # each rank's own order
        assert [l for l in lines if l.startswith("[rank%d]:" % r)] == \
            ["[rank%d]:I am rank %d, line %d" % (r, r, i) for i in range(2)], m.describe()


def test_late_rank_printed_alone_and_nothing_lost(launch, tmp_path):
    window_ms = 100
    m = start(launch, tmp_path, 8, "late", window_ms=window_ms, extra=[str(10 * window_ms / 1000)])
    assert m.wait(60) == 0, m.describe()
    assert m.out.splitlines() == ["[ranks 0-6]:sync", "[rank7]:sync"], m.describe()


def test_local_ranks_filter_shows_only_those_ranks(launch, tmp_path):
    # torchrun's spelling with dashes; two ranks reach the console, so auto does not merge
    m = start(launch, tmp_path, 8, "mixed", "--local-ranks-filter", "0,3")
    assert m.wait(60) == 0, m.describe()
    lines = m.out.splitlines()
    assert sorted(lines) == sorted(["[rank0]:same", "[rank3]:same", "[rank0]:mine 0", "[rank3]:mine 3"]), m.describe()
    assert lines.index("[rank0]:same") < lines.index("[rank0]:mine 0"), m.describe()
    assert lines.index("[rank3]:same") < lines.index("[rank3]:mine 3"), m.describe()
    # with merging on, the two shown ranks merge, and still no other rank appears
    (tmp_path / "on").mkdir()
    m = start(launch, tmp_path / "on", 8, "mixed", "--local_ranks_filter=0,3", "--merge_output=on", window_ms=5000)
    assert m.wait(60) == 0, m.describe()
    lines = console_lines(m.out)
    assert len(lines) == 3 and lines[0] == ([0, 3], "same"), m.describe()
    assert sorted(lines[1:]) == [([0], "mine 0"), ([3], "mine 3")], m.describe()


def test_off_switch_prints_every_rank_line(launch, tmp_path):
    m = start(launch, tmp_path, 8, "same", "--merge-output=off", window_ms=5000)
    assert m.wait(60) == 0, m.describe()
    lines = m.out.splitlines()
    assert len(lines) == 24, m.describe()
    for r in range(8):
        assert [l for l in lines if l.startswith("[rank%d]:" % r)] == \
            ["[rank%d]:line %d" % (r, i) for i in range(3)], m.describe()
    assert sorted(l for l in m.err.splitlines() if l.startswith("[rank")) == \
        sorted("[rank%d]:err line" % r for r in range(8)), m.describe()


def test_two_ranks_unmerged_by_default_merged_when_on(launch, tmp_path):
    m = start(launch, tmp_path, 2, "same", window_ms=5000)
    assert m.wait(60) == 0, m.describe()
    lines = m.out.splitlines()
    assert len(lines) == 6 and sorted(lines) == sorted("[rank%d]:line %d" % (r, i) for r in range(2) for i in range(3))
    (tmp_path / "on").mkdir()
    m = start(launch, tmp_path / "on", 2, "same", "--merge_output=on", window_ms=5000)
    assert m.wait(60) == 0, m.describe()
    assert m.out.splitlines() == ["[ranks 0,1]:line %d" % i for i in range(3)], m.describe()


def test_crashing_rank_partial_line_flushed(launch, tmp_path):
    m = start(launch, tmp_path, 8, "crash")
    assert m.wait(60) == 3, m.describe()
    # the partial line of the rank that died is out, once; every other rank's line too, once
    assert [t for ranks, t in console_lines(m.err)] == ["dying"], m.describe()
    assert console_lines(m.err)[0][0] == [5], m.describe()
    by = per_rank(console_lines(m.out))
    assert by == {r: ["alive"] for r in range(8) if r != 5}, m.describe()


def test_bad_merge_output_value_is_a_usage_error(launch, tmp_path):
    m = launch(["--merge_output=sometimes", "true"])
    assert m.wait(10) == 2, m.describe()
    lines = [l for l in m.err.splitlines() if l.strip()]
    assert len(lines) == 1 and "--merge_output" in lines[0] and "auto, on or off" in lines[0], m.describe()
