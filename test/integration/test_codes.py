"""test_codes: named return codes are written by name (test/tools/check_codes.py).

The repository passes it; a tree where a module whose header declares codes returns a bare -2,
or passes one to err_set, fails it, naming file and line; a static helper whose comment states
its -1 passes.
"""
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def check(root):
    tool = os.path.join(REPO, "test", "tools", "check_codes.py")
    return subprocess.run([sys.executable, tool, str(root)], capture_output=True, text=True, timeout=60)


def test_the_repository_passes():
    r = check(REPO)
    print(r.stdout)
    assert r.returncode == 0 and "no bare numeric code" in r.stdout, r.stdout


def test_a_bare_literal_is_found(tmp_path):
    files = {
        "trainer/formats/thing.h": "enum { THING_EINVAL = -1, THING_EIO = -2 };\nint thing_open(void);\n",
        "trainer/formats/thing.c": ('#include "trainer/formats/thing.h"\n'
                                    "/* Index of c in s, or -1. */\n"
                                    "static int find(const char *s, char c) {\n"
                                    "  for (int i = 0; s[i]; i++) if (s[i] == c) return i;\n"
                                    "  return -1;\n"
                                    "}\n"
                                    "int thing_open(char *err, size_t errlen) {\n"
                                    "  if (find(\"ab\", 'c') < 0) return -2;\n"
                                    "  return err_set(err, errlen,\n"
                                    "                 -1, \"thing: %s, %d\", \"x\", 1);\n"
                                    "}\n"),
        "trainer/formats/other.c": "static int f(void) { return -1; }\n",  # no header with codes
    }
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    r = check(tmp_path)
    print(r.stdout)
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    assert lines[0] == "check_codes: bare numeric return codes:"
    assert lines[1].startswith("trainer/formats/thing.c:8: return -2 where the module has named codes")
    assert lines[2].startswith("trainer/formats/thing.c:9: err_set(..., -1, ...)")
    assert len(lines) == 3  # find's stated -1 and other.c pass
