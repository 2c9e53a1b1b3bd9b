//! Who may open a volume's NBD export, and cutting a node off when it is unpublished.
//!
//! Lives here: [`NbdAccess`] (the `--nbd-access` policy), [`ExportName`] (parsing an
//! export name that may carry an attachment's key, `VOLUME/KEY`) and [`Fences`] (one
//! revocation signal per attachment key: the connections opened with the key watch it,
//! and an unpublish raises it and waits for them to close). Not here: the attachments
//! themselves (the engine's `Pool::attach`/`detach`, durable), the NBD protocol's side
//! of a refusal or a revocation (the `nbd` crate's `ExportRegistry` and
//! `Export::revoked`).

use std::collections::HashMap;
use std::time::Duration;

use parking_lot::Mutex;
use storage_engine::AttachKey;
use tokio::sync::watch;

/// Who may open an export over TCP (`ferrovol serve --nbd-access`). Unix-socket
/// clients may always open every volume by its name: the socket's file permissions
/// guard it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NbdAccess {
    /// Anyone who reaches the port opens any volume by its name (and a published node
    /// by its attachment's export name too). Protects nothing: for a loopback
    /// listener, or a network only trusted hosts reach.
    Open,
    /// Only a client presenting a published attachment's key (`VOLUME/KEY`, as
    /// PublishVolume returns it) opens that volume, read-only when published so; plain
    /// names are refused (`NBD_REP_ERR_POLICY`) and nothing is listed. Protects
    /// against a client that reaches the port but was never given a key, and against a
    /// node that was unpublished (its key stops working, its connections are closed).
    /// It does not protect the key in transit unless NBD runs over TLS (`--nbd-tls`),
    /// which also binds the key to the node's certificate.
    Attached,
}

impl NbdAccess {
    /// The policy's name in the management API and logs: `open` or `attached`.
    pub fn as_str(self) -> &'static str {
        match self {
            NbdAccess::Open => "open",
            NbdAccess::Attached => "attached",
        }
    }
}

/// `--nbd-access` as given: a policy, or `auto`, which is [`NbdAccess::Open`] when the
/// TCP listener is on a loopback address (only local processes reach it) and
/// [`NbdAccess::Attached`] otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NbdAccessMode {
    /// Always [`NbdAccess::Open`].
    Open,
    /// Always [`NbdAccess::Attached`].
    Attached,
    /// Open on loopback, attached elsewhere.
    Auto,
}

impl NbdAccessMode {
    /// The policy for a TCP listener on `listen`.
    pub fn resolve(self, listen: std::net::SocketAddr) -> NbdAccess {
        match self {
            NbdAccessMode::Open => NbdAccess::Open,
            NbdAccessMode::Attached => NbdAccess::Attached,
            NbdAccessMode::Auto if listen.ip().is_loopback() => NbdAccess::Open,
            NbdAccessMode::Auto => NbdAccess::Attached,
        }
    }
}

impl std::str::FromStr for NbdAccessMode {
    type Err = String;

    /// `open`, `attached` or `auto`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "open" => Ok(NbdAccessMode::Open),
            "attached" => Ok(NbdAccessMode::Attached),
            "auto" => Ok(NbdAccessMode::Auto),
            _ => Err(format!("'{s}' is not an NBD access mode: use open, attached or auto")),
        }
    }
}

/// An export name as a client sent it: a volume or snapshot name (`VOLUME`,
/// `VOLUME@SNAPSHOT`), optionally with an attachment key (`VOLUME/KEY`, the key as 32
/// hex digits). Volume names never hold `/`.
#[derive(Debug, PartialEq, Eq)]
pub enum ExportName<'a> {
    /// A name without a key.
    Plain(&'a str),
    /// `VOLUME/KEY` with a well-formed key.
    Keyed(&'a str, AttachKey),
    /// A `/` followed by something that is not a key: no export has such a name.
    Malformed,
}

impl<'a> ExportName<'a> {
    /// Parses what a client sent.
    pub fn parse(name: &'a str) -> ExportName<'a> {
        match name.split_once('/') {
            None => ExportName::Plain(name),
            Some((vol, key)) => match AttachKey::from_hex(key) {
                Some(k) if !vol.is_empty() => ExportName::Keyed(vol, k),
                _ => ExportName::Malformed,
            },
        }
    }

    /// `name` with any key hidden, for logs and error messages: `VOLUME/…`.
    pub fn shown(name: &str) -> String {
        match name.split_once('/') {
            None => name.to_owned(),
            Some((vol, _)) => format!("{vol}/…"),
        }
    }

    /// The volume (or snapshot) `name` names, without any key.
    pub fn volume(name: &str) -> &str {
        name.split_once('/').map_or(name, |(vol, _)| vol)
    }
}

/// One revocation signal per attachment key (fences, as in cluster fencing: an
/// unpublished node's I/O stops reaching the pool). A connection opened with a key
/// holds a receiver of its signal; [`Fences::revoke`] raises it and waits until every
/// receiver is gone, that is until every such connection has answered what it had in
/// flight and closed. A raised signal is kept, tagged with the volume and node it was
/// revoked from, until its connections are gone, so that a retried unpublish (the
/// attachment is gone by then) still waits for them ([`Fences::pending`]). Keys are
/// random and never reused.
#[derive(Default)]
pub struct Fences {
    signals: Mutex<HashMap<[u8; 16], Signal>>,
}

struct Signal {
    tx: watch::Sender<bool>,
    /// `(volume, node)` once revoked.
    revoked_from: Option<(String, String)>,
}

impl Signal {
    fn new() -> Signal {
        Signal { tx: watch::Sender::new(false), revoked_from: None }
    }
}

impl Fences {
    /// A receiver of `key`'s signal: resolves `wait_for(|r| *r)` once the key is
    /// revoked. Subscribe before checking that the attachment exists, so that a
    /// revocation between the check and the connection's start is still seen.
    pub fn subscribe(&self, key: &AttachKey) -> watch::Receiver<bool> {
        self.signals.lock().entry(key.0).or_insert_with(Signal::new).tx.subscribe()
    }

    /// Drops `key`'s signal if no connection holds it (after a refused lookup).
    pub fn forget_unused(&self, key: &AttachKey) {
        let mut s = self.signals.lock();
        if s.get(&key.0).is_some_and(|sig| sig.tx.receiver_count() == 0) {
            s.remove(&key.0);
        }
    }

    /// Keys revoked from `node` on `volume` whose connections have not all closed.
    pub fn pending(&self, volume: &str, node: &str) -> Vec<AttachKey> {
        let s = self.signals.lock();
        s.iter()
            .filter(|(_, sig)| {
                sig.revoked_from.as_ref().is_some_and(|(v, n)| v == volume && n == node) && sig.tx.receiver_count() > 0
            })
            .map(|(k, _)| AttachKey(*k))
            .collect()
    }

    /// Raises `key`'s signal (revoked from `node` on `volume`) and waits up to `timeout`
    /// until the connections that hold it have closed. True when they all closed (or
    /// there were none); the signal stays raised either way, and stays listed by
    /// [`Fences::pending`] until they close.
    pub async fn revoke(&self, key: &AttachKey, volume: &str, node: &str, timeout: Duration) -> bool {
        let tx = {
            let mut s = self.signals.lock();
            let sig = s.entry(key.0).or_insert_with(Signal::new);
            sig.revoked_from = Some((volume.to_owned(), node.to_owned()));
            sig.tx.send_replace(true);
            sig.tx.clone()
        };
        let closed = tokio::time::timeout(timeout, tx.closed()).await.is_ok();
        // Drop every raised signal nobody holds any more (this one, and those of
        // earlier revocations that timed out).
        self.signals.lock().retain(|_, sig| !(*sig.tx.borrow() && sig.tx.receiver_count() == 0));
        closed
    }

    /// Connections holding `key`'s signal now.
    pub fn holders(&self, key: &AttachKey) -> usize {
        self.signals.lock().get(&key.0).map_or(0, |sig| sig.tx.receiver_count())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_is_open_only_on_loopback() {
        let at = |a: &str| NbdAccessMode::Auto.resolve(a.parse().unwrap());
        assert_eq!(at("127.0.0.1:10809"), NbdAccess::Open);
        assert_eq!(at("[::1]:10809"), NbdAccess::Open);
        assert_eq!(at("0.0.0.0:10809"), NbdAccess::Attached);
        assert_eq!(at("10.1.2.3:10809"), NbdAccess::Attached);
        assert_eq!(NbdAccessMode::Open.resolve("0.0.0.0:1".parse().unwrap()), NbdAccess::Open);
        assert_eq!("attached".parse::<NbdAccessMode>(), Ok(NbdAccessMode::Attached));
        assert!("closed".parse::<NbdAccessMode>().is_err());
    }

    #[test]
    fn export_names_parse() {
        let k = AttachKey([0xab; 16]);
        let keyed = format!("vol1/{}", k.to_hex());
        assert_eq!(ExportName::parse("vol1"), ExportName::Plain("vol1"));
        assert_eq!(ExportName::parse("vol1@s"), ExportName::Plain("vol1@s"));
        assert_eq!(ExportName::parse(&keyed), ExportName::Keyed("vol1", k));
        assert_eq!(ExportName::parse("vol1/xyz"), ExportName::Malformed);
        assert_eq!(ExportName::parse(&format!("/{}", k.to_hex())), ExportName::Malformed);
        assert_eq!(ExportName::shown(&keyed), "vol1/…");
        assert_eq!(ExportName::volume(&keyed), "vol1");
        assert_eq!(ExportName::volume("vol1@s"), "vol1@s");
    }

    #[tokio::test]
    async fn revoke_waits_for_every_holder() {
        let f = Fences::default();
        let k = AttachKey([1; 16]);
        let mut rx = f.subscribe(&k);
        assert!(!*rx.borrow());
        // Held: the revocation times out, but the signal is raised, and pending.
        assert!(!f.revoke(&k, "v", "n", Duration::from_millis(20)).await);
        rx.wait_for(|r| *r).await.unwrap();
        assert_eq!(f.pending("v", "n"), [k]);
        assert!(f.pending("v", "m").is_empty());
        // A subscriber after the revocation sees it at once.
        assert!(*f.subscribe(&k).borrow());
        let waiter = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            drop(rx);
        });
        assert!(f.revoke(&k, "v", "n", Duration::from_secs(5)).await);
        waiter.await.unwrap();
        assert_eq!(f.holders(&k), 0);
        assert!(f.pending("v", "n").is_empty());
    }
}
