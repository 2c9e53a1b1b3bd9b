//! The storage hosts of the controller's configuration and its connections to their
//! management APIs: connected on first use, each host's pool UUID (its host id) read
//! once per connection, dropped when the host stops answering, so that a host that
//! restarts (or moves to another address after a configuration change) is found again.
//!
//! Not here: what the CSI calls do with the hosts ([`crate::controller`]).

use std::future::Future;
use std::time::Duration;

use futures_util::future::join_all;
use mgmt_api::{ApiError, Client, HostInfo};
use tokio::sync::Mutex;

use crate::config::{Api, Config, HostConfig};
use crate::ids::short_host_id;
use crate::CsiError;

/// How long connecting to a host (and reading its host info) may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// How long reading a host's view ([`Host::view`]: its info, pool state and volumes)
/// may take: short, so that one hung host costs every call that looks at all hosts
/// only this long (the sidecars' own timeout is 10 s by default).
pub const VIEW_TIMEOUT: Duration = Duration::from_secs(4);

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

/// What one host holds, read at once: for placement, capacity and name look-ups.
#[derive(Clone)]
pub struct View {
    /// The connection it was read over.
    pub conn: Conn,
    /// Its host info (capacity, free and reserved bytes).
    pub info: HostInfo,
    /// Its pool has failed after an I/O error (it takes no writes).
    pub failed: bool,
    /// Its volumes (not snapshots).
    pub volumes: Vec<mgmt_api::Volume>,
}

impl View {
    /// Bytes its volumes may still write into units they do not hold yet: the sum of
    /// each volume's size minus its allocated bytes (copies of shared units not
    /// counted).
    pub fn promised(&self) -> u64 {
        self.volumes.iter().map(|v| v.size_bytes.saturating_sub(v.allocated_bytes)).sum()
    }

    /// Bytes new volumes (or growth) may be given: free minus reserved bytes, times
    /// `overcommit`, minus what is [`View::promised`]; 0 for a failed pool.
    pub fn available(&self, overcommit: f64) -> u64 {
        if self.failed {
            return 0;
        }
        let room = self.info.free_bytes.saturating_sub(self.info.reserved_bytes);
        ((room as f64 * overcommit) as u64).saturating_sub(self.promised())
    }
}

/// The answer of one host to [`Hosts::survey`].
pub struct Surveyed<'a> {
    /// The host.
    pub host: &'a Host,
    /// What it holds, or why it did not answer.
    pub answer: Result<View, CsiError>,
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

    /// Its host info, read now, over a connection to the pool the info names (a
    /// connection to another pool that now answers at the address is replaced).
    ///
    /// Errors: as [`Host::call`]; UNAVAILABLE after [`CONNECT_TIMEOUT`].
    pub async fn info(&self) -> Result<(Conn, HostInfo), CsiError> {
        let read = async {
            let conn = self.conn().await?;
            let info = self.call("read the host info", |c| async move { c.host_info().await }).await?;
            if info.host_id != conn.host_id {
                *self.conn.lock().await = None;
                return Ok((self.conn().await?, info));
            }
            Ok((conn, info))
        };
        tokio::time::timeout(CONNECT_TIMEOUT, read).await.unwrap_or_else(|_| {
            Err(CsiError::unavailable(format!(
                "storage host {} ({}) does not answer within {} s",
                self.config.name,
                self.config.api,
                CONNECT_TIMEOUT.as_secs()
            )))
        })
    }

    /// Its [`View`], read now.
    ///
    /// Errors: as [`Host::call`]; UNAVAILABLE after [`VIEW_TIMEOUT`].
    pub async fn view(&self) -> Result<View, CsiError> {
        let read = async {
            let (conn, info) = self.info().await?;
            let failed = self.call("read the pool status", |c| async move { c.pool_status().await }).await?.failed;
            let volumes = self.call("list the volumes", |c| async move { c.list_volumes().await }).await?;
            Ok(View { conn, info, failed, volumes })
        };
        tokio::time::timeout(VIEW_TIMEOUT, read).await.unwrap_or_else(|_| {
            Err(CsiError::unavailable(format!(
                "storage host {} ({}) does not answer within {} s",
                self.config.name,
                self.config.api,
                VIEW_TIMEOUT.as_secs()
            )))
        })
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

    /// Reads every host's [`View`], all at once.
    pub async fn survey(&self) -> Vec<Surveyed<'_>> {
        join_all(self.hosts.iter().map(|h| async move { Surveyed { host: h, answer: h.view().await } })).await
    }

    /// The host whose short id is `short` (from a volume or snapshot ID), with its
    /// connection; `Ok(None)` when every host answered and none has that id. Each
    /// host's id is read now (a pool that replaced another at an address is seen).
    ///
    /// Errors: `UNAVAILABLE` when no answering host has it and some host does not
    /// answer (it may be the one: the caller must not say the volume is gone).
    pub async fn by_short_id(&self, short: &str) -> Result<Option<(&Host, Conn)>, CsiError> {
        let mut down = Vec::new();
        let tries = join_all(self.hosts.iter().map(|h| async move { (h, h.info().await) })).await;
        for (h, r) in tries {
            match r {
                Ok((c, _)) if c.short == short => return Ok(Some((h, c))),
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
}
