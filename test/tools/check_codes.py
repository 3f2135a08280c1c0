#!/usr/bin/python3
"""check_codes: a trainer module with named return codes returns them by name.

    test/tools/check_codes.py [REPO]

A trainer module whose header declares return codes (PREFIX_Exxx, as an enum value or a
#define; docs/STYLE.md "Return codes") writes them by name: in its sources, `return -<digit>`
and `err_set(err, errlen, -<digit>, ...)` do not appear. A module's header is trainer/*/X.h for
X.c, else the header of the part before X's first '_' (dp_ddp.c: dp.h, pipeline_run.c:
pipeline.h). A static helper may keep a private convention (a parser's -1 for "not a number")
when the comment just above it names the value. Prints each bare literal as file:line and exits
1 when there is one; 0 and the number of files checked otherwise.
"""
import os
import re
import sys

CODE = re.compile(r'#\s*define\s+([A-Z][A-Z0-9]*_E[A-Z0-9]+)\s+\(?-|\b([A-Z][A-Z0-9]*_E[A-Z0-9]+)\s*=\s*-')
RETURN = re.compile(r'\breturn\s+\(?-\s*(\d+)')
ERR_SET = re.compile(r'\berr_set\s*\(')
FUNC = re.compile(r'^[A-Za-z_][^;{}()]*?\b(\w+)\s*\([^;{}]*\)\s*\{', re.M)



def headers(repo):
    """Basename -> codes its header declares, over every header under trainer/."""
    out = {}
    for dirpath, _, files in os.walk(os.path.join(repo, "trainer")):
        for f in files:
            if f.endswith(".h"):
                with open(os.path.join(dirpath, f), errors="replace") as fh:
                    codes = [a or b for a, b in CODE.findall(fh.read())]
                if codes:
                    out.setdefault(f[:-2], set()).update(codes)
    return out


def args_of(text, start):
    """The top-level arguments of the call whose '(' is at text[start - 1]."""
    args, cur, depth, i = [], [], 1, start
    while i < len(text) and depth:
        c = text[i]
        if c == '"':
            j = i + 1
            while j < len(text) and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            cur.append(text[i:j + 1])
            i = j + 1
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if not depth:
                break
        if c == "," and depth == 1:
            args.append("".join(cur).strip())
            cur = []
        else:
            cur.append(c)
        i += 1
    args.append("".join(cur).strip())
    return args


def stated(text, pos, value):
    """Whether pos lies in a static function whose comment above names -value."""
    best = None
    for m in FUNC.finditer(text, 0, pos):
        best = m
    if not best or not text[best.start():best.end()].lstrip().startswith("static"):
        return False
    above = text[:best.start()].rstrip()
    if not above.endswith("*/"):
        return False
    comment = above[above.rfind("/*"):]
    return ("-" + value) in comment


def check_file(repo, path):
    with open(os.path.join(repo, path), errors="replace") as fh:
        text = fh.read()
    found = []
    for m in RETURN.finditer(text):
        if not stated(text, m.start(), m.group(1)):
            found.append((text.count("\n", 0, m.start()) + 1, "return -" + m.group(1)))
    for m in ERR_SET.finditer(text):
        a = args_of(text, m.end())
        lit = re.fullmatch(r"\(?-\s*(\d+)\)?", a[2]) if len(a) > 2 else None
        if lit and not stated(text, m.start(), lit.group(1)):
            found.append((text.count("\n", 0, m.start()) + 1, "err_set(..., -%s, ...)" % lit.group(1)))
    return sorted(found)


def main():
    repo = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    named = headers(repo)
    bad, checked = [], 0
    for dirpath, _, files in os.walk(os.path.join(repo, "trainer")):
        for f in sorted(files):
            if not f.endswith((".c", ".cu", ".cpp")):
                continue
            path = os.path.relpath(os.path.join(dirpath, f), repo)
            stem = f.rsplit(".", 1)[0]
            codes = named.get(stem) or named.get(stem.split("_")[0])
            if not codes:
                continue
            checked += 1
            for line, what in check_file(repo, path):
                bad.append("%s:%d: %s where the module has named codes (%s)" %
                           (path, line, what, ", ".join(sorted(codes)[:3]) + (", ..." if len(codes) > 3 else "")))
    if bad:
        print("check_codes: bare numeric return codes:")
        print("\n".join(bad))
        return 1
    print("check_codes: %d files of modules with named codes, no bare numeric code" % checked)
    return 0


if __name__ == "__main__":
    sys.exit(main())
