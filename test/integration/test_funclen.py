"""test_funclen: no product function over 100 lines (test/tools/check_funclen.py, run by `make
test`).

The repository passes it. In a tree of its own, a function of 101 lines fails it (named with its
file, line and length) while one of exactly 100 passes; braces inside strings, comments and
initializers and macros do not count as functions, and a function inside an extern "C" block is measured.
"""
import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECK = os.path.join(REPO, "test", "tools", "check_funclen.py")


def check(root):
    return subprocess.run(["/usr/bin/python3", CHECK, str(root)], capture_output=True, text=True, timeout=120)


def body(name, lines):
    """A C function whose body spans exactly `lines` lines, brace to brace."""
    inner = "".join(f"  x += {i}; /* {{ */\n" for i in range(lines - 2))
    return f"int {name}(int x) {{\n{inner}}}\n"


def test_the_repository_passes():
    r = check(REPO)
    print(r.stdout.strip())
    assert r.returncode == 0, r.stdout
    assert "no function over 100 lines" in r.stdout


def test_a_long_function_is_named(tmp_path):
    (tmp_path / "launcher").mkdir()
    (tmp_path / "trainer" / "run").mkdir(parents=True)
    (tmp_path / "launcher" / "a.c").write_text(
        'static const char *s = "{";\nstatic int t[] = {1, 2};\n#define BAD(x) \\\n  do { x; } while (0)\n'
        + body("fits", 100) + body("too_long", 101))
    (tmp_path / "trainer" / "run" / "b.cpp").write_text('extern "C" {\n' + body("inside_extern", 120) + "}\n")
    r = check(tmp_path)
    print(r.stdout)
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("check_funclen: trainer/run/b.cpp:2: inside_extern is 120 lines"), lines
    assert lines[1].startswith("check_funclen: launcher/a.c:105: too_long is 101 lines"), lines


def test_limit_is_inclusive(tmp_path):
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "c.c").write_text(body("exactly", 100))
    r = check(tmp_path)
    print(r.stdout)
    assert r.returncode == 0 and "exactly (common/c.c:1, 100 lines)" in r.stdout, r.stdout
