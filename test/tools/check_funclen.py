#!/usr/bin/python3
"""check_funclen: no function of the product code runs over 100 lines.

    test/tools/check_funclen.py [REPO] [--limit N]

Reads the C, C++ and CUDA sources of common/, launcher/ and trainer/ and measures each function
body from the line of its opening brace to the line of its closing one. A function longer than
the limit (100 lines) is printed with its file, line and length, and the check exits 1; help text
and data tables are the exceptions, each named in EXCEPTIONS with its reason. Exits 0 and prints
the longest function otherwise.
"""
import os
import re
import sys

from csource import blank

LIMIT = 100
EXCEPTIONS = {
    ("launcher/cli_help.c", "cli_usage"): "help text: one printf of the usage, line for line",
}
SOURCES = (".c", ".cu", ".cpp")
CONTROL = {"if", "while", "for", "switch", "return", "sizeof"}


def no_directives(text):
    """The text with preprocessor lines (and their continuations) blanked, newlines kept."""
    out, cont = [], False
    for line in text.split("\n"):
        directive = cont or line.lstrip().startswith("#")
        cont = directive and line.rstrip().endswith("\\")
        out.append(" " * len(line) if directive else line)
    return "\n".join(out)


def last_called(head):
    """The name before the last top-level parenthesis of a signature: the function's own, not an
    attribute's (__launch_bounds__(256) kern(...))."""
    depth, name = 0, "?"
    for m in re.finditer(r"(\w+)?\s*([()])", head):
        if m.group(2) == "(":
            if depth == 0 and m.group(1):
                name = m.group(1)
            depth += 1
        else:
            depth -= 1
    return name


def functions(path):
    """(name, first line, length in lines) of each top-level function body in path. The braces of
    extern "C" { } and namespace { } blocks are seen through."""
    text = no_directives(blank(open(path, errors="replace").read()))
    found, stack, line, head_from, start = [], [], 1, 0, None
    for i, c in enumerate(text):
        if c == "\n":
            line += 1
        elif c == "{":
            head = text[head_from:i]
            if "f" not in stack and re.search(r"\b(extern|namespace)\b[\s\w]*$", head):
                stack.append("x")
                head_from = i + 1
                continue
            if "f" not in stack and "b" not in stack:
                m = re.search(r"(\w+)\s*\([^;{}]*\)[\s\w]*$", head)
                ok = m and m.group(1) not in CONTROL and "=" not in head.split("(")[0]
                start = (last_called(head), line) if ok else None
                stack.append("f" if ok else "b")
            else:
                stack.append("i")
        elif c == "}":
            kind = stack.pop() if stack else "x"
            if kind == "f":
                found.append((start[0], start[1], line - start[1] + 1))
            if kind in "fbx":
                head_from = i + 1
        elif c == ";" and all(k == "x" for k in stack):
            head_from = i + 1
    return found


def main(argv):
    repo, limit = ".", LIMIT
    args = list(argv)
    while args:
        a = args.pop(0)
        if a == "--limit":
            limit = int(args.pop(0))
        else:
            repo = a
    longest, over = None, []
    for top in ("common", "launcher", "trainer"):
        for dirpath, _, files in os.walk(os.path.join(repo, top)):
            for f in sorted(files):
                if not f.endswith(SOURCES):
                    continue
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, repo)
                for name, first, n in functions(path):
                    if (rel, name) in EXCEPTIONS:
                        continue
                    if longest is None or n > longest[2]:
                        longest = (rel, name, n, first)
                    if n > limit:
                        over.append((n, rel, first, name))
    for n, rel, first, name in sorted(over, reverse=True):
        print(f"check_funclen: {rel}:{first}: {name} is {n} lines (limit {limit}): split it into named steps")
    if over:
        return 1
    if longest:
        print(f"check_funclen: no function over {limit} lines; the longest is {longest[1]} "
              f"({longest[0]}:{longest[3]}, {longest[2]} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
