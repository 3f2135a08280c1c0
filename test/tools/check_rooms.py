#!/usr/bin/python3
"""check_rooms: the #include edges between the rooms of the product code, and their cycles.

    test/tools/check_rooms.py [REPO]

A room is a folder of product sources: common/, launcher/, and each folder under trainer/. An
edge A -> B is an #include "B/x.h" written in a file of room A (with the files that write it).
Prints each cycle between rooms (a strongly connected group of more than one room) with the
file-level includes that close it, and exits 1 when there is one; 0 and the room order (each
room after the rooms it includes) otherwise.
"""
import os
import re
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def room_of(path):
    parts = path.split("/")
    if parts[0] == "trainer" and len(parts) > 2:
        return "trainer/" + parts[1]
    return parts[0] if parts[0] in ("common", "launcher", "trainer") else None


def edges(repo):
    out = {}
    for top in ("common", "launcher", "trainer"):
        for dirpath, _, files in os.walk(os.path.join(repo, top)):
            for f in files:
                if not f.endswith((".c", ".h", ".cu")):
                    continue
                path = os.path.relpath(os.path.join(dirpath, f), repo)
                src = room_of(path)
                with open(os.path.join(repo, path), errors="replace") as fh:
                    for inc in INCLUDE.findall(fh.read()):
                        dst = room_of(inc)
                        if dst and dst != src:
                            out.setdefault((src, dst), []).append("%s -> %s" % (path, inc))
    return out


def components(rooms, adj):
    """Tarjan's strongly connected components."""
    index, low, on, stack, comps, n = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(adj.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            comps.append(sorted(comp))

    for v in sorted(rooms):
        if v not in index:
            visit(v)
    return comps


def main():
    repo = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    e = edges(repo)
    rooms = {r for pair in e for r in pair}
    adj = {}
    for a, b in e:
        adj.setdefault(a, set()).add(b)
    comps = components(rooms, adj)
    cycles = [c for c in comps if len(c) > 1]
    for c in cycles:
        print("check_rooms: a cycle between %s:" % ", ".join(c))
        for a, b in sorted(e):
            if a in c and b in c:
                for line in e[(a, b)]:
                    print("  %s" % line)
    if cycles:
        print("check_rooms: %d cycle(s) between rooms (docs/ARCHITECTURE.md gives the order)" % len(cycles))
        return 1
    print("check_rooms: %d rooms, %d edges, no cycle; from the bottom: %s" %
          (len(rooms), len(e), " < ".join(c[0] for c in comps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
