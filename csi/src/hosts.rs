//! The storage hosts of the controller's configuration and its connections to their
//! management APIs: connected on first use, each host's pool UUID (its host id) read
//! once per connection, dropped when the host stops answering, so that a host that
//! restarts (or moves to another address after a configuration change) is found again.
//!
//! Not here: what the CSI calls do with the hosts ([`crate::controller`]).

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use futures_util::future::join_all;
use mgmt_api::{ApiError, Client, HostInfo};
use tokio::sync::Mutex;

use crate::config::{Api, Config, HostConfig};
use crate::ids::short_host_id;
use crate::CsiError;

/// How long connecting to a host (and reading its host info) may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long one management call may take: longer than a storage host's own wait in
/// UnpublishVolume (30 s) so that its `ABORTED` arrives rather than a timeout.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(45);

/// One storage host.
pub struct Host {
    /// Its configuration entry.
    pub config: HostConfig,
    conn: Mutex<Option<Conn>>,
}

/// A live connection to a host.
#[derive(Clone)]
pub struct Conn {
    /// The management client.
    pub client: Client,
    /// The host's id: its pool's UUID.
    pub host_id: String,
    /// [`short_host_id`] of it, as IDs carry it.
    pub short: String,
}

/// The answer of one host to [`Hosts::survey`].
pub struct Surveyed<'a> {
    /// The host.
    pub host: &'a Host,
    /// Its connection and host info, or why it did not answer.
    pub answer: Result<(Conn, HostInfo), CsiError>,
}

impl Host {
    /// Its name.
    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// The connection, made now if there is none.
    ///
    /// Errors: `UNAVAILABLE` when the host does not answer within [`CONNECT_TIMEOUT`].
    pub async fn conn(&self) -> Result<Conn, CsiError> {
        let mut slot = self.conn.lock().await;
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        let name = &self.config.name;
        let down = |m: String| {
            CsiError::unavailable(format!("storage host {name} ({}) does not answer: {m}", self.config.api))
        };
        let connect = async {
            let client = match &self.config.api {
                Api::Unix(path) => Client::connect_unix(path).await,
                Api::Tls { addr, tls } => Client::connect_tls(addr, tls).await,
            }
            .map_err(|e| down(e.message().to_string()))?;
            let info = client.host_info().await.map_err(|e| down(e.message().to_string()))?;
            Ok::<_, CsiError>(Conn { client, short: short_host_id(&info.host_id), host_id: info.host_id })
        };
        let c = tokio::time::timeout(CONNECT_TIMEOUT, connect)
            .await
            .map_err(|_| down(format!("no answer within {} s", CONNECT_TIMEOUT.as_secs())))??;
        *slot = Some(c.clone());
        Ok(c)
    }

    /// Runs one management call `f` on the host's client, as `what` (for messages).
    /// A host that does not answer, or a call cut on its way, drops the connection (the
    /// next call connects again and reads the host id anew).
    ///
    /// Errors: [`CsiError::from_api`] of the call's error; `UNAVAILABLE` when the host
    /// does not answer or the call takes longer than [`CALL_TIMEOUT`].
    pub async fn call<T, F, Fut>(&self, what: &str, f: F) -> Result<T, CsiError>
    where
        F: FnOnce(Client) -> Fut,
        Fut: Future<Output = Result<T, ApiError>>,
    {
        let conn = self.conn().await?;
        match tokio::time::timeout(CALL_TIMEOUT, f(conn.client)).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => {
                if matches!(e.kind(), mgmt_api::ErrorKind::Unavailable | mgmt_api::ErrorKind::Interrupted) {
                    *self.conn.lock().await = None;
                }
                Err(CsiError::from_api(&self.config.name, what, e))
            }
            Err(_) => {
                *self.conn.lock().await = None;
                Err(CsiError::unavailable(format!(
                    "{what} on storage host {}: no answer within {} s",
                    self.config.name,
                    CALL_TIMEOUT.as_secs()
                )))
            }
        }
    }

    /// Its host info, read now.
    ///
    /// Errors: as [`Host::call`].
    pub async fn info(&self) -> Result<(Conn, HostInfo), CsiError> {
        let conn = self.conn().await?;
        let info = self.call("read the host info", |c| async move { c.host_info().await }).await?;
        if info.host_id != conn.host_id {
            // Another pool answers at this address now: start again with it.
            *self.conn.lock().await = None;
            let conn = self.conn().await?;
            return Ok((conn, info));
        }
        Ok((conn, info))
    }
}

/// Every storage host of the configuration.
pub struct Hosts {
    hosts: Vec<Host>,
    /// [`Config::overcommit`].
    pub overcommit: f64,
}

impl Hosts {
    /// The hosts of `config`, none connected yet.
    pub fn new(config: &Config) -> Hosts {
        Hosts {
            hosts: config.hosts.iter().map(|c| Host { config: c.clone(), conn: Mutex::new(None) }).collect(),
            overcommit: config.overcommit,
        }
    }

    /// Every host, in the configuration's order.
    pub fn all(&self) -> &[Host] {
        &self.hosts
    }

    /// Asks every host for its host info, all at once.
    pub async fn survey(&self) -> Vec<Surveyed<'_>> {
        let mut set = Vec::with_capacity(self.hosts.len());
        for h in &self.hosts {
            set.push(async move { Surveyed { host: h, answer: h.info().await } });
        }
        join_all(set).await
    }

    /// The host whose short id is `short` (from a volume or snapshot ID), with its
    /// connection; `Ok(None)` when every host answered and none has that id.
    ///
    /// Errors: `UNAVAILABLE` when no answering host has it and some host does not
    /// answer (it may be the one: the caller must not say the volume is gone).
    pub async fn by_short_id(&self, short: &str) -> Result<Option<(&Host, Conn)>, CsiError> {
        let mut down = Vec::new();
        let mut tries = Vec::with_capacity(self.hosts.len());
        for h in &self.hosts {
            tries.push(async move { (h, h.conn().await) });
        }
        for (h, r) in join_all(tries).await {
            match r {
                Ok(c) if c.short == short => return Ok(Some((h, c))),
                Ok(_) => {}
                Err(e) => down.push(e.message),
            }
        }
        if down.is_empty() {
            Ok(None)
        } else {
            Err(CsiError::unavailable(format!(
                "the storage host {short} is not among those that answer, and some do not: {}",
                down.join("; ")
            )))
        }
    }

    /// The topology segments of host `h`.
    pub fn segments(h: &Host) -> BTreeMap<String, String> {
        h.config.segments()
    }
}
