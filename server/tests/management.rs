//! The management API and its CLI at scale: replies larger than gRPC's default limit of
//! 4 MiB per message (listings are not paged).

mod common;
use common::*;
use storage_engine::{Pool, PoolOptions};

/// 17,000 volumes with 120-character names: `volume list` (text and JSON) is a reply of
/// about 4.5 MiB, which the CLI's client refused with "decoded message length too
/// large" before its limit was raised. Every volume is listed.
#[test]
fn volume_list_beyond_four_mib() {
    const VOLUMES: usize = 17_000;
    let td = TestDir::new();
    std::fs::create_dir_all(td.data()).unwrap();
    // The volumes are made through the engine (a CLI call each would take minutes),
    // many at once so that their commits share their syncs.
    let name = |i: usize| format!("{}{i:05}", "n".repeat(115));
    {
        let pool = Pool::create(
            &td.data().join("pool.img"),
            &PoolOptions { size: 1 << 30, unit_size: 64 * 1024, ..Default::default() },
        )
        .unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async {
            let mut tasks = tokio::task::JoinSet::new();
            for i in 0..VOLUMES {
                let pool = pool.clone();
                tasks.spawn(async move { pool.create_volume(&name(i), 1 << 20).await.map(|_| ()) });
                if tasks.len() >= 256 {
                    tasks.join_next().await.unwrap().unwrap().unwrap();
                }
            }
            while let Some(r) = tasks.join_next().await {
                r.unwrap().unwrap();
            }
        });
        drop(rt);
        pool.close().unwrap();
    }
    let s = Server::start_with(&td.data(), "1GiB", &[]);
    let listed = json(&s.cli_ok(&["volume", "list", "--json"]));
    let names: std::collections::BTreeSet<&str> =
        listed.as_array().unwrap().iter().map(|v| v["name"].as_str().unwrap()).collect();
    assert_eq!(names.len(), VOLUMES);
    assert!((0..VOLUMES).all(|i| names.contains(name(i).as_str())), "a volume is missing from the listing");
    let text = s.cli_ok(&["volume", "list"]);
    assert_eq!(text.lines().count(), VOLUMES + 1, "one line per volume and a header");
}
