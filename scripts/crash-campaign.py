#!/usr/bin/python3
"""Crash campaign for ferrovol: concurrent libnbd clients, kill -9, restart, verify.

Usage: /usr/bin/python3 scripts/crash-campaign.py --cycles 12 --seed 1 [--mode mixed|smallflush|alt]
       [--no-race] [--bin PATH] [--out DIR] [--serve-args "--dataplane-threads 2"]
Needs python3-libnbd (Debian) and a release build (default: $CARGO_TARGET_DIR or
target/, release/ferrovol). Prints one JSON line per cycle and a total; exits 1 if
any cycle found a violation or an unclean `ferrovol check`.

Model (per 512-byte sector, per export):
  every op records t_send (taken before the aio call) and t_ack (taken in the
  completion callback, error == 0 only).  A FLUSH covers every write of the same
  export with t_ack < flush.t_send (multi-conn is advertised), if the flush acked.
  An op is durable if acked and (FUA or covered by an acked flush).
  After the crash, sector s may hold the value of op O iff O touched s and no
  durable op D touching s has D.t_send > O.t_ack (O not strictly older than a
  durable op); zeros are allowed iff no durable op touched s, or an allowed op
  is a trim / write-zeroes.  Trim reads as zeros (volume.rs trim docs).
Snapshot exports (created by CLI during the run) are checked as a cut between the
CLI call's start cs and return ce: O allowed iff O.t_send < ce and no op O2 with
O2.t_ack < cs and O2.t_send > O.t_ack.

The workload includes, in a shared zone, trims concurrent with writes into the same
64 KiB unit and sub-4K writes concurrent with full-block writes of the same 4K block
(two races that once lost acknowledged writes); --no-race keeps them out, so that a
violation points at crash durability alone.
"""
import argparse, hashlib, json, os, random, shlex, signal, struct, subprocess, sys, threading, time
import nbd

BIN = os.path.join(os.environ.get("CARGO_TARGET_DIR") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "target"), "release", "ferrovol")
SERVE_ARGS = []
SEC = 512
UNIT = 65536
ZERO = bytes(SEC)
now = time.monotonic_ns


def sector_bytes(op_id, sec):
    h = struct.pack("<QQ", op_id, sec)
    return h + bytes([(op_id * 131 + sec * 7) & 0xFF]) * (SEC - 16)


class Op:
    __slots__ = ("id", "exp", "kind", "off", "len", "fua", "send", "ack", "err", "conn")

    def __init__(self, id, exp, kind, off, ln, fua, conn):
        self.id, self.exp, self.kind, self.off, self.len, self.fua, self.conn = id, exp, kind, off, ln, fua, conn
        self.send = None
        self.ack = None
        self.err = None

    def d(self):
        return dict(id=self.id, exp=self.exp, kind=self.kind, off=self.off, len=self.len, fua=self.fua,
                    send=self.send, ack=self.ack, err=self.err, conn=self.conn)


class History:
    def __init__(self):
        self.lock = threading.Lock()
        self.ops = []
        self.next_id = 1

    def new(self, exp, kind, off, ln, fua, conn):
        with self.lock:
            o = Op(self.next_id, exp, kind, off, ln, fua, conn)
            self.next_id += 1
            self.ops.append(o)
            return o


def worker(hist, uri, exp, wid, rng, cfg, stop, stats):
    h = nbd.NBD()
    h.connect_uri(uri)
    qd = cfg["qd"]
    inflight = {}  # op id -> (op, units set, buffer)
    busy_units = {}
    def units_of(off, ln):
        return set(range(off // UNIT, (off + ln - 1) // UNIT + 1))

    def done_cb(op, units):
        def cb(err):
            t = now()
            e = err.value
            if e == 0:
                op.ack = t
            else:
                op.err = e
            inflight.pop(op.id, None)
            for u in units:
                busy_units[u] -= 1
                if busy_units[u] == 0:
                    del busy_units[u]
            return 1
        return cb

    def pick():
        r = rng.random()
        mix = cfg["mix"]
        acc = 0
        for kind, p in mix:
            acc += p
            if r < acc:
                break
        if kind == "flush":
            return ("flush", 0, 0, False, False)
        shared = rng.random() < cfg["shared_frac"]
        if shared:
            z0, z1 = cfg["shared_zone"]
        else:
            z0, z1 = cfg["private_zones"][wid]
        fua = rng.random() < cfg["fua_frac"]
        aligned = shared and not cfg["race"] or rng.random() < 0.6
        if kind in ("trim", "zero_unmap") and shared and not cfg["race"]:
            kind = "write"
        if kind == "write":
            if aligned:
                ln = 4096 * rng.choice(cfg["blocks"])
                off = z0 + rng.randrange((z1 - z0 - ln) // 4096) * 4096
            else:
                ln = SEC * rng.randint(1, 24)
                off = z0 + rng.randrange((z1 - z0 - ln) // SEC) * SEC
        else:  # trim, zero_unmap, zero_nohole
            ln = SEC * rng.choice([1, 3, 8, 16, 40, 128, 256])
            if aligned or kind == "zero_nohole" and shared:
                ln = (ln + 4095) // 4096 * 4096
                off = z0 + rng.randrange((z1 - z0 - ln) // 4096) * 4096
            else:
                off = z0 + rng.randrange((z1 - z0 - ln) // SEC) * SEC
        # private zone (and race-free mode): no two in-flight ops of this thread share a unit
        if not shared and not cfg["race"]:
            if units_of(off, ln) & busy_units.keys():
                return None
        return (kind, off, ln, fua, shared)

    try:
        while not stop.is_set():
            while len(inflight) < qd and not stop.is_set():
                p = pick()
                if p is None:
                    break
                kind, off, ln, fua, shared = p
                flags = nbd.CMD_FLAG_FUA if fua else 0
                op = hist.new(exp, kind, off, ln, fua, wid)
                units = set() if kind == "flush" or shared else units_of(off, ln)
                for u in units:
                    busy_units[u] = busy_units.get(u, 0) + 1
                buf = None
                cb = done_cb(op, units)
                inflight[op.id] = (op, units, None)
                op.send = now()
                if kind == "write":
                    s0 = off // SEC
                    data = b"".join(sector_bytes(op.id, s) for s in range(s0, s0 + ln // SEC))
                    buf = nbd.Buffer.from_bytearray(bytearray(data))
                    inflight[op.id] = (op, units, buf)
                    h.aio_pwrite(buf, off, completion=cb, flags=flags)
                elif kind == "flush":
                    h.aio_flush(completion=cb)
                elif kind == "trim":
                    h.aio_trim(ln, off, completion=cb, flags=flags)
                elif kind == "zero_unmap":
                    h.aio_zero(ln, off, completion=cb, flags=flags)
                elif kind == "zero_nohole":
                    h.aio_zero(ln, off, completion=cb, flags=flags | nbd.CMD_FLAG_NO_HOLE)
                stats[kind] = stats.get(kind, 0) + 1
            h.poll(200)
    except Exception as e:  # server killed
        stats["exc"] = repr(e)[:120]
    try:
        h.shutdown()
    except Exception:
        pass


def cli(ddir, *args, timeout=30):
    return subprocess.run([BIN, "--data-dir", ddir, *args], capture_output=True, text=True, timeout=timeout)


def start_server(ddir, port, logf):
    p = subprocess.Popen([BIN, "--data-dir", ddir, "serve", "--listen", f"127.0.0.1:{port}", "--pool-size", "2GiB",
                          *SERVE_ARGS],
                         stdout=logf, stderr=logf)
    for _ in range(300):
        if p.poll() is not None:
            logf.flush()
            with open(logf.name, "rb") as f:
                tail = f.read()[-2000:].decode(errors="replace")
            raise RuntimeError(f"server exited rc={p.returncode}; the end of its log:\n{tail}")
        if cli(ddir, "pool", "status").returncode == 0:
            return p
        time.sleep(0.05)
    raise RuntimeError("server did not come up")


def mgmt(ddir, vol, cyc, rng, t0, events, kill_at, stop, v2_ready, v2name, prev_names):
    # second volume early, then snapshots at random moments before the kill
    time.sleep(rng.uniform(0.05, 0.3))
    cs = now(); r = cli(ddir, "volume", "create", v2name, "--size", "1GiB"); ce = now()
    events.append(dict(kind="vol2", cs=cs, ce=ce, rc=r.returncode, err=r.stderr[-200:]))
    if r.returncode == 0:
        v2_ready.set()
    # delete the previous cycle's exports while I/O runs (frees pending across the crash)
    if prev_names:
        pv, pv2 = prev_names
        for args in (["snapshot", "delete", pv, "s0"], ["snapshot", "delete", pv, "s1"],
                     ["volume", "delete", pv], ["volume", "delete", pv2]):
            if stop.is_set():
                return
            cs = now(); r = cli(ddir, *args); ce = now()
            events.append(dict(kind="delete", what=" ".join(args[2:]), cs=cs, ce=ce, rc=r.returncode))
    times = sorted(rng.uniform(0.2, max(0.3, kill_at * 1.1)) for _ in range(2))
    for i, t in enumerate(times):
        while (now() - t0) / 1e9 < t:
            if stop.is_set():
                return
            time.sleep(0.01)
        if stop.is_set():
            return
        name = f"s{i}"
        cs = now()
        try:
            r = cli(ddir, "snapshot", "create", vol, name, timeout=20)
            rc, err = r.returncode, r.stderr[-200:]
        except subprocess.TimeoutExpired:
            rc, err = -1, "timeout"
        ce = now()
        events.append(dict(kind="snap", name=name, cs=cs, ce=ce, rc=rc, err=err))


def allowed_set(ops_here, fmax):
    """ops_here: list of Op touching the sector. Returns (set of allowed values (0 = zeros), info)."""
    maxd = None
    for o in ops_here:
        if o.ack is not None and (o.fua or (fmax is not None and o.ack < fmax)):
            if maxd is None or o.send > maxd:
                maxd = o.send
    allowed = set()
    for o in ops_here:
        if o.ack is None or maxd is None or o.ack >= maxd:
            allowed.add(0 if o.kind != "write" else o.id)
    if maxd is None:
        allowed.add(0)
    return allowed


def allowed_cut(ops_here, cs, ce):
    maxa = None  # latest send among ops acked before cs
    for o in ops_here:
        if o.ack is not None and o.ack < cs and (maxa is None or o.send > maxa):
            maxa = o.send
    allowed = set()
    for o in ops_here:
        if o.send < ce and (o.ack is None or maxa is None or o.ack >= maxa):
            allowed.add(0 if o.kind != "write" else o.id)
    if maxa is None:
        allowed.add(0)
    return allowed


def verify_export(uri, region, ops, allowed_fn, label, byid, limit=20):
    """Read [region) and check every sector. Returns list of violation dicts."""
    per_sec = {}
    for o in ops:
        if o.kind == "flush" or o.send is None:
            continue
        for s in range(o.off // SEC, (o.off + o.len) // SEC):
            per_sec.setdefault(s, []).append(o)
    h = nbd.NBD()
    h.connect_uri(uri)
    viol = []
    nviol = 0
    r0, r1 = region
    CH = 1 << 20
    checked = 0
    determined = 0
    for base in range(r0, r1, CH):
        data = h.pread(min(CH, r1 - base), base)
        for i in range(0, len(data), SEC):
            s = (base + i) // SEC
            got = data[i:i + SEC]
            here = per_sec.get(s)
            if got == ZERO:
                val = 0
            else:
                oid, sec = struct.unpack_from("<QQ", got)
                val = oid if (sec == s and got == sector_bytes(oid, s)) else -1
            if here is None:
                ok = val == 0
                allowed = {0}
            else:
                allowed = allowed_fn(here)
                ok = val in allowed
            checked += 1
            if here is not None and len(allowed) == 1 and 0 not in allowed:
                determined += 1
            if not ok:
                nviol += 1
                if len(viol) < limit:
                    found = "zeros" if val == 0 else ("garbage " + got[:16].hex() if val == -1 else f"op {val}")
                    if val > 0 and val in byid:
                        found += f" {byid[val].d()}"
                    viol.append(dict(export=label, sector=s, byte_offset=s * SEC, found=found,
                                     allowed=sorted(allowed),
                                     ops=[o.d() for o in (here or [])]))
    h.shutdown()
    verify_export.determined += determined
    return nviol, checked, viol


verify_export.determined = 0


def hash_region(uri, region):
    h = nbd.NBD(); h.connect_uri(uri)
    m = hashlib.sha256()
    for base in range(region[0], region[1], 1 << 20):
        m.update(h.pread(min(1 << 20, region[1] - base), base))
    h.shutdown()
    return m.hexdigest()


def config(mode, race):
    MiB = 1 << 20
    if mode == "mixed":
        return dict(qd=8, nworkers=4, race=race, shared_frac=0.4, fua_frac=0.08,
                    blocks=[1, 1, 2, 4, 8, 16],
                    mix=[("write", 0.62), ("flush", 0.14), ("trim", 0.1), ("zero_unmap", 0.06), ("zero_nohole", 0.08)],
                    shared_zone=(0, 8 * MiB),
                    private_zones=[(8 * MiB + i * 6 * MiB, 8 * MiB + (i + 1) * 6 * MiB) for i in range(4)],
                    region=(0, 32 * MiB), kill=(1.0, 7.0))
    # heavy small-write flush load: 4K first writes into a big zone, QD 16, flush every few ops
    return dict(qd=16, nworkers=4, race=race, shared_frac=0.25, fua_frac=0.05, blocks=[1],
                mix=[("write", 0.75), ("flush", 0.22), ("trim", 0.03)],
                shared_zone=(0, 16 * MiB),
                private_zones=[(16 * MiB + i * 28 * MiB, 16 * MiB + (i + 1) * 28 * MiB) for i in range(4)],
                region=(0, 128 * MiB), kill=(0.5, 4.0))


V2CFG = dict(qd=4, race=False, shared_frac=0.0, fua_frac=0.1, blocks=[1, 2, 4],
             mix=[("write", 0.7), ("flush", 0.2), ("trim", 0.1)], shared_zone=(0, 0),
             private_zones=[(0, 4 << 20)])


def run_cycle(args, cyc, ddir, port, seed, mode, prev):
    rng = random.Random(seed)
    cfg = config(mode, args.race)
    vol, v2 = f"c{cyc}v1", f"c{cyc}v2"
    logf = open(os.path.join(args.out, f"server-c{cyc}.log"), "ab")
    srv = start_server(ddir, port, logf)
    res = dict(cycle=cyc, seed=seed, mode=mode, race=args.race)
    # previous cycle's volume must be unchanged (it was verified and is untouched since)
    if prev:
        res["prev_hash_ok"] = hash_region(f"nbd://127.0.0.1:{port}/{prev[0]}", prev[1]) == prev[2]
    r = cli(ddir, "volume", "create", vol, "--size", "1GiB")
    assert r.returncode == 0, r.stderr
    hist = History()
    stop = threading.Event()
    stats = [dict() for _ in range(cfg["nworkers"] + 1)]
    kill_at = rng.uniform(*cfg["kill"])
    t0 = now()
    ths = [threading.Thread(target=worker, args=(hist, f"nbd://127.0.0.1:{port}/{vol}", vol, w,
                                                  random.Random(seed * 100 + w), cfg, stop, stats[w]))
           for w in range(cfg["nworkers"])]
    events = []
    v2_ready = threading.Event()
    mt = threading.Thread(target=mgmt, args=(ddir, vol, cyc, random.Random(seed * 7 + 1), t0, events, kill_at, stop,
                                             v2_ready, v2, prev and prev[3]))
    for t in ths:
        t.start()
    mt.start()
    v2t = None
    while (now() - t0) / 1e9 < kill_at:
        if v2t is None and v2_ready.is_set():
            v2t = threading.Thread(target=worker, args=(hist, f"nbd://127.0.0.1:{port}/{v2}", v2, 0,
                                                        random.Random(seed * 100 + 99), V2CFG, stop, stats[-1]))
            v2t.start()
        time.sleep(0.005)
    os.kill(srv.pid, signal.SIGKILL)
    t_kill = now()
    srv.wait()
    stop.set()
    for t in ths + ([v2t] if v2t else []) + [mt]:
        t.join(30)
    ops = list(hist.ops)
    res["kill_at_s"] = round(kill_at, 3)
    res["ops"] = len(ops)
    res["acked"] = sum(o.ack is not None for o in ops)
    res["acked_after_kill"] = sum(o.ack is not None and o.ack > t_kill for o in ops)
    res["errors"] = sorted({o.err for o in ops if o.err})
    res["stats"] = stats
    res["events"] = [{k: v for k, v in e.items() if k not in ("cs", "ce")} for e in events]
    # check on the crashed pool (replays the log read-only)
    c = cli(ddir, "check")
    res["check_after_kill"] = (c.returncode, (c.stdout + c.stderr).strip()[-300:])
    srv = start_server(ddir, port, logf)
    byid = {o.id: o for o in ops}
    total_viol, total_checked, viols = 0, 0, []
    exports = [(vol, cfg["region"])]
    if any(e["kind"] == "vol2" and e["rc"] == 0 for e in events):
        exports.append((v2, (0, 4 << 20)))
    for name, region in exports:
        eops = [o for o in ops if o.exp == name]
        fl = [o.send for o in eops if o.kind == "flush" and o.ack is not None]
        fmax = max(fl) if fl else None
        res.setdefault("flushes_acked", {})[name] = len(fl)
        res.setdefault("durable_writes", {})[name] = sum(
            1 for o in eops if o.kind != "flush" and o.ack is not None and (o.fua or (fmax and o.ack < fmax)))
        n, ch, v = verify_export(f"nbd://127.0.0.1:{port}/{name}", region, eops,
                                 lambda here, fmax=fmax: allowed_set(here, fmax), name, byid)
        total_viol += n; total_checked += ch; viols += v
    vops = [o for o in ops if o.exp == vol]
    for e in events:
        if e["kind"] == "snap" and e["rc"] == 0:
            n, ch, v = verify_export(f"nbd://127.0.0.1:{port}/{vol}@{e['name']}", cfg["region"], vops,
                                     lambda here, cs=e["cs"], ce=e["ce"]: allowed_cut(here, cs, ce),
                                     f"{vol}@{e['name']}", byid)
            total_viol += n; total_checked += ch; viols += v
            res.setdefault("snapshots_checked", []).append(e["name"])
    res["sectors_checked"] = total_checked
    res["sectors_exactly_one_nonzero_value"] = verify_export.determined; verify_export.determined = 0
    res["violations"] = total_viol
    res["violation_samples"] = viols
    newprev = (vol, cfg["region"], hash_region(f"nbd://127.0.0.1:{port}/{vol}", cfg["region"]), (vol, v2))
    lst = cli(ddir, "volume", "list", "--json")
    res["volume_list_after_restart"] = lst.stdout[-2000:]
    gone = [e["what"].split()[0] for e in events if e["kind"] == "delete" and e["rc"] == 0 and e["what"].count(" ") == 0]
    res["deleted_but_present"] = [g for g in gone if f'"{g}"' in lst.stdout]
    if res["deleted_but_present"]:
        res["violations"] += 1
    # graceful stop, then check
    srv.send_signal(signal.SIGTERM)
    try:
        srv.wait(30)
    except subprocess.TimeoutExpired:
        os.kill(srv.pid, signal.SIGKILL); srv.wait()
        res["sigterm_timeout"] = True
    c = cli(ddir, "check")
    res["check_after_stop"] = (c.returncode, (c.stdout + c.stderr).strip()[-300:])
    logf.close()
    return res, newprev


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cycles", type=int, default=12)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--mode", default="alt")
    ap.add_argument("--no-race", dest="race", action="store_false")
    ap.add_argument("--bin", default=None)
    ap.add_argument("--port", type=int, default=21000)
    ap.add_argument("--out", default=None)
    ap.add_argument("--serve-args", default="", help="more arguments for `ferrovol serve`")
    args = ap.parse_args()
    global SERVE_ARGS
    SERVE_ARGS = shlex.split(args.serve_args)
    args.out = args.out or f"/tmp/ferrovol-crash-campaign/run-{args.seed}-{args.mode}{'-race' if args.race else ''}"
    if args.bin:
        global BIN
        BIN = args.bin
    os.makedirs(args.out, exist_ok=True)
    ddir = os.path.join(args.out, "data")
    os.makedirs(ddir, exist_ok=True)
    prev = None
    summary = []
    for i in range(args.cycles):
        seed = args.seed * 1000 + i
        mode = args.mode if args.mode != "alt" else ("mixed" if i % 2 == 0 else "smallflush")
        t = time.time()
        res, prev = run_cycle(args, i, ddir, args.port + i, seed, mode, prev)
        res["secs"] = round(time.time() - t, 1)
        with open(os.path.join(args.out, f"cycle-{i}.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
        line = {k: res.get(k) for k in ("cycle", "seed", "mode", "kill_at_s", "ops", "acked", "flushes_acked",
                                          "durable_writes", "snapshots_checked", "sectors_checked", "sectors_exactly_one_nonzero_value", "violations",
                                          "prev_hash_ok", "deleted_but_present", "secs")}
        line["check_kill"] = res["check_after_kill"][0]
        line["check_stop"] = res["check_after_stop"][0]
        line["errors"] = res["errors"]
        print(json.dumps(line, default=str), flush=True)
        for v in res["violation_samples"][:3]:
            print("  VIOLATION", json.dumps({k: v[k] for k in ("export", "byte_offset", "found", "allowed")}, default=str)[:600], flush=True)
        summary.append(line)
    bad = [s for s in summary if s["violations"] or s["check_kill"] or s["check_stop"] or s["prev_hash_ok"] is False]
    print("TOTAL cycles", len(summary), "bad cycles", len(bad))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
