//! Space reclaim at 4 KiB precision over NBD: sixteen 4 KiB trims in random order,
//! alternating between two connections, cover one 64 KiB data unit; each trimmed range
//! reads zeros at once while the rest keeps its data; after the last one the unit is
//! free (the volume maps nothing) and block status reports a hole (scenario 3 of the
//! snapshot issue).

mod common;
use common::*;

#[test]
fn sixteen_small_trims_over_two_connections_free_the_unit() {
    let dir = tempfile::tempdir().unwrap();
    let s = Server::start(dir.path());
    s.create_volume("t", "64MiB");
    let code = r#"
import nbd, random, sys
uri = sys.argv[1]
a, b = nbd.NBD(), nbd.NBD()
a.add_meta_context(nbd.CONTEXT_BASE_ALLOCATION)
a.connect_uri(uri); b.connect_uri(uri)
base = 1 << 20
a.pwrite(b'\x5a' * 65536, base); a.flush()
order = list(range(16)); random.shuffle(order)
for n, i in enumerate(order):
    h = a if n % 2 == 0 else b
    h.trim(4096, base + i * 4096)
    other = b if h is a else a
    assert other.pread(4096, base + i * 4096) == b'\0' * 4096, 'trimmed block %d not zero' % i
    for j in order[n + 1:]:
        assert a.pread(4096, base + j * 4096) == b'\x5a' * 4096, 'untrimmed block %d lost' % j
exts = []
a.block_status(65536, base, lambda meta, off, e, err: exts.extend(e) or 0)
print('EXTENTS', exts[:2])
assert exts[1] & 1, 'block status does not report a hole: %s' % exts
print('OK')
"#;
    let o = python(code, &[&s.uri("t")]);
    assert!(text(&o).contains("OK"), "{}", text(&o));
    let v = json(&s.cli_ok(&["volume", "info", "t", "--json"]));
    assert_eq!(v["allocated_bytes"], 0, "the unit was not freed: {v}");
    assert_eq!(s.pool_status()["used_bytes"], 0);
}
