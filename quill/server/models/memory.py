"""Memory a model's engine holds: the resident set of its process and the processes it started
(tensor-parallel ranks), read from /proc (Linux)."""

from __future__ import annotations

from pathlib import Path


def process_tree_rss(pid: int | None) -> int:
    """Bytes resident in `pid` and its descendants (0 when it is gone)."""
    if pid is None:
        return 0
    total, todo, seen = 0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                children = (task / "children").read_text().split()
                todo += [int(c) for c in children]
        except (OSError, ValueError):
            continue  # it ended while being read
    return total
