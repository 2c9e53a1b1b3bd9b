"""Rows that ../shared/tools/nbd-bench.sh appends to its TSV file, for the bench scripts.

load(path) -> {(label, job): [(iops, mean_us, srv_cpu_percent), ...]}, one tuple per run;
rows with a failed job (ERR) or without a server CPU figure are left out.
"""
import collections


def load(path):
    rows = collections.defaultdict(list)
    for line in open(path):
        f = line.split()
        if len(f) < 7:
            continue
        label, job, iops, _mbs, mean, _p99, cpu = f[:7]
        try:
            rows[(label, job)].append((float(iops), float(mean), float(cpu)))
        except ValueError:
            pass
    return rows
