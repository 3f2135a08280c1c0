"""test_rooms: the include check between rooms (test/tools/check_rooms.py, run by `make test`).

The repository passes it (no cycle between common/, launcher/ and the rooms of trainer/); a tree
with an include that closes a cycle (trainer/model including trainer/parallel while parallel
includes model) fails it, naming both file-level includes.
"""
import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECK = os.path.join(REPO, "test", "tools", "check_rooms.py")


def check(root):
    return subprocess.run(["/usr/bin/python3", CHECK, str(root)], capture_output=True, text=True, timeout=60)


def test_the_repository_has_no_cycle():
    r = check(REPO)
    print(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 0 and "no cycle" in r.stdout, r.stdout


def test_a_cycle_is_found(tmp_path):
    for path, text in [("common/log.h", ""),
                       ("trainer/model/model.h", '#include "trainer/parallel/dp.h"\n#include "common/log.h"\n'),
                       ("trainer/parallel/dp.h", '#include "trainer/model/model.h"\n'),
                       ("trainer/run/main.c", '#include "trainer/parallel/dp.h"\n')]:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    r = check(tmp_path)
    print(r.stdout)
    assert r.returncode == 1
    assert r.stdout.splitlines()[0] == "check_rooms: a cycle between trainer/model, trainer/parallel:"
    assert "trainer/model/model.h -> trainer/parallel/dp.h" in r.stdout
    assert "trainer/parallel/dp.h -> trainer/model/model.h" in r.stdout
    assert "trainer/run/main.c" not in r.stdout  # run -> parallel closes no cycle
