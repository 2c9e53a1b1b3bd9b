//! Access decisions of the registry on the wire: a refused export gets
//! `NBD_REP_ERR_POLICY` (or a closed connection under `NBD_OPT_EXPORT_NAME`) and is not
//! listed, and a revoked export ends its connections after answering what is in flight.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::client::*;
use common::mem_export::{MemExport, MemRegistry};
use nbd::proto::*;
use nbd::ServerConfig;

fn registry() -> Arc<MemRegistry> {
    let mut r = MemRegistry::default()
        .with("open", MemExport::new(1 << 20))
        .with("secret", MemExport::new(1 << 20))
        .with("slow", MemExport::new(1 << 20).with_read_delay(|_| Duration::from_millis(300)));
    r.denied.push("secret".into());
    Arc::new(r)
}

#[tokio::test]
async fn a_denied_export_gets_policy_on_go_and_info_and_is_not_listed() {
    let (mut c, task) = start(registry(), ServerConfig::default());
    greet(&mut c, NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES).await;
    for option in [NBD_OPT_INFO, NBD_OPT_GO] {
        let req = InfoRequest { name: "secret".into(), requests: vec![] };
        send_option(&mut c, option, &req.encode()).await;
        let replies = read_option_replies(&mut c).await;
        assert_eq!(replies.len(), 1);
        assert_eq!(replies[0].0.reply_type, NBD_REP_ERR_POLICY, "option {option}");
        assert_eq!(replies[0].1, b"not published to this client");
    }
    // An unknown name is still unknown, not denied.
    let req = InfoRequest { name: "nothing".into(), requests: vec![] };
    send_option(&mut c, NBD_OPT_GO, &req.encode()).await;
    assert_eq!(read_option_replies(&mut c).await[0].0.reply_type, NBD_REP_ERR_UNKNOWN);
    send_option(&mut c, NBD_OPT_LIST, &[]).await;
    let listed: Vec<_> = read_option_replies(&mut c)
        .await
        .into_iter()
        .filter(|(h, _)| h.reply_type == NBD_REP_SERVER)
        .map(|(_, d)| {
            String::from_utf8_lossy(&d[4..4 + u32::from_be_bytes(d[..4].try_into().unwrap()) as usize]).into_owned()
        })
        .collect();
    assert_eq!(listed, ["open", "slow"]);
    // The haggling goes on: an export the client may open still opens.
    let s = connect_after_greeting(&mut c, "open").await;
    assert_eq!(s, 1 << 20);
    send_request(&mut c, Command::Disc, 0, 1, 0, 0).await;
    finish(task).await.unwrap();
}

/// GO on `name` after the greeting; returns the export size.
async fn connect_after_greeting(c: &mut tokio::io::DuplexStream, name: &str) -> u64 {
    let go = InfoRequest { name: name.into(), requests: vec![] };
    send_option(c, NBD_OPT_GO, &go.encode()).await;
    let mut size = 0;
    for (h, data) in read_option_replies(c).await {
        assert_ne!(h.reply_type & NBD_REP_FLAG_ERROR, NBD_REP_FLAG_ERROR, "GO failed");
        if h.reply_type == NBD_REP_INFO && u16::from_be_bytes([data[0], data[1]]) == NBD_INFO_EXPORT {
            size = u64::from_be_bytes(data[2..10].try_into().unwrap());
        }
    }
    size
}

#[tokio::test]
async fn a_denied_export_name_option_closes_the_connection() {
    let (mut c, task) = start(registry(), ServerConfig::default());
    greet(&mut c, NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES).await;
    send_option(&mut c, NBD_OPT_EXPORT_NAME, b"secret").await;
    expect_closed(&mut c).await;
    assert!(matches!(finish(task).await, Err(nbd::Error::Denied(name, _)) if name == "secret"));
}

#[tokio::test]
async fn a_denied_export_gets_policy_on_set_meta_context() {
    let (mut c, task) = start(registry(), ServerConfig::default());
    greet(&mut c, NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES).await;
    send_option(&mut c, NBD_OPT_STRUCTURED_REPLY, &[]).await;
    assert_eq!(read_option_reply(&mut c).await.0.reply_type, NBD_REP_ACK);
    let q = MetaContextRequest { export_name: "secret".into(), queries: vec![BASE_ALLOCATION.into()] };
    send_option(&mut c, NBD_OPT_SET_META_CONTEXT, &q.encode()).await;
    assert_eq!(read_option_replies(&mut c).await[0].0.reply_type, NBD_REP_ERR_POLICY);
    send_option(&mut c, NBD_OPT_ABORT, &[]).await;
    let _ = read_option_reply(&mut c).await;
    finish(task).await.unwrap();
}

#[tokio::test]
async fn revoking_answers_the_request_in_flight_then_closes() {
    let registry = registry();
    let (mut c, task) = start(Arc::clone(&registry), ServerConfig::default());
    connect(&mut c, "slow", false, false).await;
    // A read that takes 300 ms is in flight when the export is revoked.
    send_request(&mut c, Command::Read, 0, 7, 0, 4096).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    registry.get("slow").revoke();
    let (error, data) = simple_reply(&mut c, 7, 4096).await;
    assert_eq!((error, data.len()), (0, 4096));
    // Then nothing more is read or answered: the server closes the connection.
    expect_closed(&mut c).await;
    assert!(matches!(finish(task).await, Err(nbd::Error::Revoked)));
}

#[tokio::test]
async fn a_revoked_export_is_not_served_to_a_new_connection_on_the_same_export_object() {
    // The registry decides who may connect; revocation only ends the connections
    // made before it. A connection made after revocation ends at once.
    let registry = registry();
    registry.get("open").revoke();
    let (mut c, task) = start(Arc::clone(&registry), ServerConfig::default());
    connect(&mut c, "open", false, false).await;
    expect_closed(&mut c).await;
    assert!(matches!(finish(task).await, Err(nbd::Error::Revoked)));
}
