//! An in-memory export for protocol tests and the `memserver` example.
//!
//! Lives here: [`MemExport`] (a `Vec<u8>` behind a mutex, with per-4-KiB-block
//! allocation tracking so that reads and block status report holes), and
//! [`MemRegistry`]. Test knobs: a read delay that depends on the offset, a poisoned range
//! whose reads fail with `NBD_EIO`, and counters of flushes and of the largest write
//! buffer ever allocated.
//! Not here: anything durable; flush only counts.
#![allow(dead_code)]

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nbd::{BlockSizes, Errno, Export, ExportFlags, ExportRegistry, Extent, ReadData};

/// Allocation granularity in bytes.
pub const BLOCK: u64 = 4096;

type DelayFn = Box<dyn Fn(u64) -> Duration + Send + Sync>;

struct State {
    data: Vec<u8>,
    /// One entry per `BLOCK`; `false` is a hole that reads as zeros.
    allocated: Vec<bool>,
}

/// A `size`-byte export held in memory, all holes at first.
pub struct MemExport {
    state: Mutex<State>,
    pub flags: ExportFlags,
    pub sizes: BlockSizes,
    pub description: String,
    /// Delay applied to each read, computed from its offset.
    pub read_delay: Option<DelayFn>,
    /// Reads overlapping this byte range fail with `Eio`.
    pub poison: Option<Range<u64>>,
    /// Largest `len` passed to `alloc_write_buf`, in bytes.
    pub max_write_alloc: AtomicU64,
    /// Number of `flush` calls.
    pub flushes: AtomicU64,
}

impl MemExport {
    pub fn new(size: u64) -> Self {
        let blocks = size.div_ceil(BLOCK) as usize;
        Self {
            state: Mutex::new(State { data: vec![0; size as usize], allocated: vec![false; blocks] }),
            flags: ExportFlags {
                read_only: false,
                can_trim: true,
                can_write_zeroes: true,
                can_fast_zero: true,
                can_multi_conn: true,
            },
            sizes: BlockSizes { minimum: 1, preferred: 4096, maximum: 1 << 20 },
            description: "in-memory test export".to_string(),
            read_delay: None,
            poison: None,
            max_write_alloc: AtomicU64::new(0),
            flushes: AtomicU64::new(0),
        }
    }

    pub fn read_only(mut self) -> Self {
        self.flags.read_only = true;
        self
    }

    pub fn with_read_delay(mut self, f: impl Fn(u64) -> Duration + Send + Sync + 'static) -> Self {
        self.read_delay = Some(Box::new(f));
        self
    }

    /// Copies bytes out directly (for assertions).
    pub fn snapshot(&self, range: Range<usize>) -> Vec<u8> {
        self.state.lock().unwrap().data[range].to_vec()
    }

    fn extents(state: &State, offset: u64, len: u64) -> Vec<Extent> {
        let mut out: Vec<Extent> = Vec::new();
        let end = offset + len;
        let mut at = offset;
        while at < end {
            let block = (at / BLOCK) as usize;
            let block_end = ((at / BLOCK + 1) * BLOCK).min(end);
            let hole = !state.allocated[block];
            let length = block_end - at;
            match out.last_mut() {
                Some(last) if last.hole == hole => last.length += length,
                _ => out.push(Extent { length, hole, zero: hole }),
            }
            at = block_end;
        }
        out
    }

    fn zero_range(state: &mut State, offset: u64, len: u64, unmap: bool) {
        let (start, end) = (offset as usize, (offset + len) as usize);
        state.data[start..end].fill(0);
        let first_full = offset.div_ceil(BLOCK);
        let last_full = (offset + len) / BLOCK;
        for b in (offset / BLOCK)..(offset + len).div_ceil(BLOCK) {
            let full = b >= first_full && b < last_full;
            if unmap && full {
                state.allocated[b as usize] = false;
            } else if !unmap {
                state.allocated[b as usize] = true;
            }
        }
    }
}

impl Export for MemExport {
    type ReadBuf = Vec<u8>;
    type WriteBuf = Vec<u8>;

    fn size(&self) -> u64 {
        self.state.lock().unwrap().data.len() as u64
    }

    fn flags(&self) -> ExportFlags {
        self.flags
    }

    fn block_sizes(&self) -> BlockSizes {
        self.sizes
    }

    fn description(&self) -> String {
        self.description.clone()
    }

    fn alloc_write_buf(&self, _offset: u64, len: u32) -> Vec<u8> {
        self.max_write_alloc.fetch_max(u64::from(len), Ordering::SeqCst);
        vec![0; len as usize]
    }

    async fn read(&self, offset: u64, len: u32) -> Result<ReadData<Vec<u8>>, Errno> {
        if let Some(delay) = &self.read_delay {
            tokio::time::sleep(delay(offset)).await;
        }
        let end = offset + u64::from(len);
        if let Some(p) = &self.poison {
            if offset < p.end && p.start < end {
                return Err(Errno::Eio);
            }
        }
        let state = self.state.lock().unwrap();
        let data = state.data[offset as usize..end as usize].to_vec();
        let extents = Self::extents(&state, offset, u64::from(len));
        Ok(ReadData { data, extents })
    }

    async fn write(&self, offset: u64, buf: Vec<u8>, _fua: bool) -> Result<(), Errno> {
        let mut state = self.state.lock().unwrap();
        let end = offset as usize + buf.len();
        state.data[offset as usize..end].copy_from_slice(&buf);
        for b in (offset / BLOCK)..(end as u64).div_ceil(BLOCK) {
            state.allocated[b as usize] = true;
        }
        Ok(())
    }

    async fn flush(&self) -> Result<(), Errno> {
        self.flushes.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    async fn trim(&self, offset: u64, len: u64, _fua: bool) -> Result<(), Errno> {
        let mut state = self.state.lock().unwrap();
        Self::zero_range(&mut state, offset, len, true);
        Ok(())
    }

    async fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_unmap: bool,
        fast_only: bool,
        _fua: bool,
    ) -> Result<(), Errno> {
        if fast_only && !may_unmap {
            return Err(Errno::Enotsup);
        }
        let mut state = self.state.lock().unwrap();
        Self::zero_range(&mut state, offset, len, may_unmap);
        Ok(())
    }

    async fn cache(&self, _offset: u64, _len: u64) -> Result<(), Errno> {
        Ok(())
    }

    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>, Errno> {
        let state = self.state.lock().unwrap();
        Ok(Self::extents(&state, offset, len))
    }
}

/// A fixed set of named exports.
#[derive(Default)]
pub struct MemRegistry {
    pub exports: Vec<(String, Arc<MemExport>)>,
}

impl MemRegistry {
    pub fn with(mut self, name: &str, export: MemExport) -> Self {
        self.exports.push((name.to_string(), Arc::new(export)));
        self
    }

    pub fn get(&self, name: &str) -> Arc<MemExport> {
        self.lookup(name).expect("export in fixture")
    }
}

impl ExportRegistry for MemRegistry {
    type Export = MemExport;

    fn lookup(&self, name: &str) -> Option<Arc<MemExport>> {
        self.exports.iter().find(|(n, _)| n == name).map(|(_, e)| Arc::clone(e))
    }

    fn list(&self) -> Vec<(String, String)> {
        self.exports.iter().map(|(n, e)| (n.clone(), e.description.clone())).collect()
    }
}
