//! The Prometheus endpoint (`serve --metrics-listen`): after qemu-io writes, reads and
//! flushes a volume, a scrape shows exactly those bytes for that volume, the latency
//! histograms, the pool's used bytes and the NBD connection gauge; once the volume is
//! deleted its series are gone.

mod common;

use common::*;

#[test]
fn metrics_count_volume_io_and_pool_usage() {
    let td = TestDir::new();
    let port = free_port();
    let s = Server::start_with(&td.data(), "2GiB", &["--metrics-listen", &format!("127.0.0.1:{port}")]);
    s.create_volume("m", "64MiB");
    s.create_volume("idle", "64MiB");
    qemu_io_ok(&s.uri("m"), &["write -P 0x61 0 1M", "read -P 0x61 0 1M", "flush"]);

    let text = scrape(port);
    let v = |metric: &str| sample(&text, &format!("ferrovol_{metric}{{volume=\"m\"}}"));
    assert_eq!(v("volume_write_bytes_total"), Some(1048576.0), "written bytes:\n{text}");
    assert_eq!(v("volume_read_bytes_total"), Some(1048576.0), "read bytes:\n{text}");
    assert!(v("volume_write_ops_total").is_some_and(|n| n >= 1.0), "write ops:\n{text}");
    assert!(v("volume_flushes_total").is_some_and(|n| n >= 1.0), "flushes:\n{text}");
    assert_eq!(v("volume_errors_total"), Some(0.0), "errors:\n{text}");
    assert!(v("volume_read_seconds_count").is_some_and(|n| n >= 1.0), "read latency histogram:\n{text}");
    assert!(
        sample(&text, "ferrovol_volume_write_bytes_total{volume=\"idle\"}").is_none(),
        "no series for a volume never opened"
    );
    assert_eq!(sample(&text, "ferrovol_pool_used_bytes"), Some(1048576.0), "pool used:\n{text}");
    assert_eq!(sample(&text, "ferrovol_pool_failed"), Some(0.0));
    assert!(sample(&text, "ferrovol_pool_capacity_bytes").is_some_and(|c| c > 1e9));
    assert!(sample(&text, "ferrovol_nbd_connections").is_some());
    assert!(sample(&text, "ferrovol_pool_freeing_bytes").is_some(), "freeing gauge:\n{text}");
    let (free, reserved) = (sample(&text, "ferrovol_pool_free_bytes"), sample(&text, "ferrovol_pool_reserved_bytes"));
    assert!(reserved.is_some_and(|r| r > 0.0 && Some(r) < free), "reserved gauge:\n{text}");

    s.cli_ok(&["volume", "delete", "m"]);
    let text = scrape(port);
    assert!(!text.contains("volume=\"m\""), "series of a deleted volume remain:\n{text}");
    assert_eq!(sample(&text, "ferrovol_pool_used_bytes"), Some(0.0), "pool used after the delete:\n{text}");
}
