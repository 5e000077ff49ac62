#!/usr/bin/env python3
"""Where a process's CPU goes, by thread, on a machine with no `perf`.

    python3 bench/thread-cpu.py kvbm-recorder > threads.txt &
    ... run the bench ...
    kill -TERM %1

Polls /proc every 20 ms for processes whose name is NAME, keeps each
thread's last CPU time (user + system, from /proc/PID/task/TID/stat) and
the span over which each process was seen, and on SIGTERM or SIGINT prints
one table per process: each kind of thread (by its name: the main thread,
tokio's threads, kvbm's writer threads `kvbm-fleet-N` and the threads
they start to sync and close logs, `kvbm-sync`; the rest), its CPU
seconds, its busiest thread's, and that thread's share of the process's
wall time. A thread busy for nearly all of it is what bounds the process.

Made for bench/bench-fleet-kit.sh, which runs it beside the recorder on
a lent machine (the fleet benchmark asks what bounds the recorder when its
writer threads have cores to spare). A thread that exits between two polls
loses at most its last 20 ms.
"""

import os
import re
import signal
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def cpu_of(stat_path):
    """(thread name, CPU seconds) from a /proc stat file, or None if gone."""
    try:
        with open(stat_path) as f:
            s = f.read()
    except OSError:
        return None
    # The name is in parentheses and may itself hold spaces or ')'.
    name = s[s.index("(") + 1 : s.rindex(")")]
    fields = s[s.rindex(")") + 2 :].split()
    # utime and stime are fields 14 and 15 of the whole line, 12 and 13 here.
    return name, (int(fields[11]) + int(fields[12])) / TICK


def kind_of(pid, tid, name):
    if tid == pid:
        return "main thread"
    if re.fullmatch(r"kvbm-fleet-\d+", name):
        return "writer threads (kvbm-fleet-N)"
    if name == "kvbm-sync":
        return "sync threads (kvbm-sync: fsyncs, closing)"
    if name.startswith("tokio"):
        return "tokio threads (runtime, blocking pool)"
    return f"other ({name})"


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: thread-cpu.py PROCESS-NAME")
    want = sys.argv[1][:15]  # /proc's comm holds at most 15 bytes
    seen = {}  # pid -> {"first": t, "last": t, "threads": {tid: (name, cpu)}}
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))
    while not stop:
        now = time.monotonic()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            got = cpu_of(f"/proc/{pid}/stat")
            if got is None or got[0] != want:
                continue
            p = seen.setdefault(int(pid), {"first": now, "last": now, "threads": {}})
            p["last"] = now
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                t = cpu_of(f"/proc/{pid}/task/{tid}/stat")
                if t is not None:
                    p["threads"][int(tid)] = t
        time.sleep(0.02)
    for pid, p in sorted(seen.items(), key=lambda kv: kv[1]["first"]):
        wall = max(p["last"] - p["first"], 1e-9)
        kinds = {}
        for tid, (name, cpu) in p["threads"].items():
            k = kinds.setdefault(kind_of(pid, tid, name), [0, 0.0, 0.0])
            k[0] += 1
            k[1] += cpu
            k[2] = max(k[2], cpu)
        total = sum(k[1] for k in kinds.values())
        print(f"{want} pid {pid}: seen for {wall:.2f} s, {total:.2f} s of CPU ({total / wall:.1f} cores busy on average)")
        print("| threads | how many | CPU s | busiest thread's CPU s | busiest thread's share of the wall time |")
        print("|---|---:|---:|---:|---:|")
        for kind, (n, cpu, top) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
            print(f"| {kind} | {n} | {cpu:.2f} | {top:.2f} | {100 * top / wall:.0f}% |")
        print()


if __name__ == "__main__":
    main()
