//! NBD exports backed by the engine: each volume is an export named after it.
//!
//! Lives here: [`VolumeExport`] (the `nbd::Export` implementation over a
//! `storage_engine::Volume`) and [`PoolRegistry`] (export lookup and listing).
//! Not here: the protocol (the `nbd` crate) or the data path (the engine).

use std::sync::Arc;

use nbd::{BlockSizes, Client, Errno, Export, ExportFlags, ExportRegistry, Extent, ReadData, Refusal};
use storage_engine::{AlignedBuf, Pool, Volume, MAX_IO_BYTES};

use crate::errors::nbd_errno;
use crate::metrics::{Metrics, VolumeMetrics};

fn log_err(op: &'static str, e: storage_engine::Error) -> Errno {
    match e.kind() {
        storage_engine::ErrorKind::Io | storage_engine::ErrorKind::Failed | storage_engine::ErrorKind::Corrupt => {
            tracing::error!(error = %e, op, "request failed")
        }
        _ => tracing::debug!(error = %e, op, "request refused"),
    }
    nbd_errno(&e)
}

/// One volume served over NBD.
pub struct VolumeExport {
    vol: Volume,
    m: VolumeMetrics,
}

impl Export for VolumeExport {
    type ReadBuf = AlignedBuf;
    type WriteBuf = AlignedBuf;

    fn size(&self) -> u64 {
        self.vol.size()
    }

    fn flags(&self) -> ExportFlags {
        let rw = !self.vol.is_snapshot();
        ExportFlags { read_only: !rw, can_trim: rw, can_write_zeroes: rw, can_fast_zero: rw, can_multi_conn: true }
    }

    fn block_sizes(&self) -> BlockSizes {
        BlockSizes { minimum: 1, preferred: 4096, maximum: MAX_IO_BYTES as u32 }
    }

    fn description(&self) -> String {
        describe(&self.vol)
    }

    fn alloc_write_buf(&self, offset: u64, len: u32) -> AlignedBuf {
        self.vol.alloc_write_buf(offset, len as usize)
    }

    async fn read(&self, offset: u64, len: u32) -> Result<ReadData<AlignedBuf>, Errno> {
        let t = std::time::Instant::now();
        let r = self.vol.read(offset, u64::from(len)).await;
        self.m.read(u64::from(len), t.elapsed(), r.is_ok());
        let r = r.map_err(|e| log_err("read", e))?;
        let extents = if r.extents.len() == 1 && r.extents[0].allocated {
            Vec::new()
        } else {
            r.extents.iter().map(|e| Extent { length: e.length, hole: !e.allocated, zero: !e.allocated }).collect()
        };
        Ok(ReadData { data: r.data, extents })
    }

    async fn write(&self, offset: u64, buf: AlignedBuf, fua: bool) -> Result<(), Errno> {
        let (t, len) = (std::time::Instant::now(), buf.as_ref().len() as u64);
        let r = self.vol.write(offset, buf, fua).await;
        self.m.write(len, t.elapsed(), r.is_ok());
        r.map_err(|e| log_err("write", e))
    }

    async fn flush(&self) -> Result<(), Errno> {
        let r = self.vol.flush().await;
        self.m.flush(r.is_ok());
        r.map_err(|e| log_err("flush", e))
    }

    async fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<(), Errno> {
        let r = self.vol.trim(offset, len, fua).await;
        self.m.trim(r.is_ok());
        r.map_err(|e| log_err("trim", e))
    }

    async fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_unmap: bool,
        fast_only: bool,
        fua: bool,
    ) -> Result<(), Errno> {
        // Zeroing by unmapping is a metadata change (fast); NO_HOLE writes real zeros.
        if fast_only && !may_unmap {
            return Err(Errno::Enotsup);
        }
        let r = self.vol.write_zeroes(offset, len, may_unmap, fua).await;
        self.m.trim(r.is_ok());
        r.map_err(|e| log_err("write zeroes", e))
    }

    async fn cache(&self, _offset: u64, _len: u64) -> Result<(), Errno> {
        // No server-side data cache (O_DIRECT); nothing to prefetch into.
        Ok(())
    }

    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>, Errno> {
        let ext = self.vol.block_status(offset, len).map_err(|e| log_err("block status", e))?;
        Ok(ext.into_iter().map(|e| Extent { length: e.length, hole: !e.allocated, zero: !e.allocated }).collect())
    }
}

/// The pool's volumes as NBD exports.
pub struct PoolRegistry {
    pool: Pool,
    metrics: Arc<Metrics>,
}

impl PoolRegistry {
    /// Exports every volume of `pool`, present and future, counting their requests in
    /// `metrics`.
    pub fn new(pool: Pool, metrics: Arc<Metrics>) -> PoolRegistry {
        PoolRegistry { pool, metrics }
    }
}

/// The export description, the same in `NBD_OPT_LIST` and `NBD_INFO_DESCRIPTION`.
fn describe(vol: &Volume) -> String {
    let kind = if vol.is_snapshot() { "read-only snapshot" } else { "thin volume" };
    format!("ferrovol {kind} {}, {} bytes, {} KiB data units", vol.name(), vol.size(), vol.unit_size() / 1024)
}

impl ExportRegistry for PoolRegistry {
    type Export = VolumeExport;

    fn lookup(&self, name: &str, _client: &Client) -> Result<Arc<VolumeExport>, Refusal> {
        let vol = self.pool.volume(name).map_err(|_| Refusal::Unknown)?;
        Ok(Arc::new(VolumeExport { m: self.metrics.volume(name, vol.id()), vol }))
    }

    /// Cheap whatever the pool holds (no space accounting): it runs on the data plane.
    fn list(&self, _client: &Client) -> Vec<(String, String)> {
        let names = self.pool.names();
        names.into_iter().filter_map(|n| self.pool.volume(&n).ok().map(|v| (n, describe(&v)))).collect()
    }
}
