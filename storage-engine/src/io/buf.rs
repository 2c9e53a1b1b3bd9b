//! Buffers for the ring: [`AlignedBuf`], 4 KiB-aligned heap buffers with a byte view,
//! and the cache that recycles them by power-of-two size. Not here: I/O (ring.rs).

use std::alloc::{self, Layout};
use std::ptr::NonNull;

/// Alignment of every [`AlignedBuf`], in bytes: enough for O_DIRECT on 4Kn devices.
pub const ALIGN: usize = 4096;

/// An initialised buffer aligned to [`ALIGN`] bytes (zeroed, or recycled with an
/// earlier request's bytes: `AlignedBuf::recycled`), with a *view*: the byte
/// range `[start, start + len)` that `as_ref`/`as_mut` expose. The engine reads and
/// writes whole 4 KiB blocks through the full capacity and hands out the view.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    cap: usize,
    start: usize,
    len: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively (like a Vec<u8>); no interior
// mutability, so moving it across threads or sharing `&AlignedBuf` is sound.
unsafe impl Send for AlignedBuf {}
// SAFETY: see above; `&AlignedBuf` only gives `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of at least `cap` bytes (a multiple of [`ALIGN`], at least one
    /// block; see [`AlignedBuf::capacity`]); the view is the first `cap` bytes.
    pub fn zeroed(cap: usize) -> AlignedBuf {
        match BufCache::take(cap) {
            Some(mut b) => {
                b.full_mut().fill(0);
                b
            }
            None => AlignedBuf::fresh(cap),
        }
    }

    /// A buffer like [`AlignedBuf::zeroed`] whose bytes are *unspecified*: a recycled
    /// buffer keeps the bytes of the request that used it before, which may be another
    /// volume's data. The caller overwrites or zeroes every byte it exposes or writes
    /// to the pool; it saves zeroing what the next step fills anyway (a read's mapped
    /// blocks, a write's payload).
    pub(crate) fn recycled(cap: usize) -> AlignedBuf {
        let mut b = BufCache::take(cap).unwrap_or_else(|| AlignedBuf::fresh(cap));
        // Test builds make the bytes visibly not zero, so that a caller relying on
        // zeroes it never wrote fails its tests instead of leaking bytes in production.
        // Not beyond the cached sizes: those buffers are always fresh mappings (zero),
        // whose pages must stay untouched until used.
        if cfg!(debug_assertions) && b.cap <= BufCache::LARGEST {
            b.full_mut().fill(0xa5);
        }
        b
    }

    /// A newly allocated zeroed buffer, with the capacity [`BufCache`] gives `cap`.
    ///
    /// One larger than [`BufCache::LARGEST`] (never cached) is an anonymous mapping of
    /// its own: the kernel backs its zero pages only as they are written. The
    /// allocator's `alloc_zeroed` writes every byte of an over-aligned block, so a
    /// 32 MiB write whose payload has not arrived yet held 32 MiB resident: a client
    /// sending WRITE headers and stalling made the server hold 33 MiB per connection.
    fn fresh(cap: usize) -> AlignedBuf {
        let rounded = BufCache::capacity_for(cap);
        if rounded > BufCache::LARGEST {
            // SAFETY: a new private anonymous mapping: no file, no address hint; the
            // result is checked against MAP_FAILED before use.
            let raw = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    rounded,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if raw != libc::MAP_FAILED {
                let ptr = NonNull::new(raw.cast::<u8>()).expect("mmap returns a non-null address");
                return AlignedBuf { ptr, cap: rounded, start: 0, len: cap };
            }
            let layout = Layout::from_size_align(rounded, ALIGN).expect("buffer size overflows");
            alloc::handle_alloc_error(layout);
        }
        let layout = Layout::from_size_align(rounded, ALIGN).expect("buffer size overflows");
        // SAFETY: the layout has a non-zero size (rounded >= ALIGN).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, cap: rounded, start: 0, len: cap }
    }

    /// Capacity in bytes: at least the size asked for, a multiple of [`ALIGN`], and a
    /// power of two up to 2 MiB (so that freed buffers can be reused by size class).
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Sets the view to `[start, start + len)`. Panics if it exceeds the capacity
    /// (a bug in the engine, never caused by input).
    pub fn set_view(&mut self, start: usize, len: usize) {
        assert!(start.checked_add(len).is_some_and(|end| end <= self.cap), "view out of buffer");
        self.start = start;
        self.len = len;
    }

    /// Start of the view, in bytes from the beginning of the buffer.
    pub fn view_start(&self) -> usize {
        self.start
    }

    /// The whole buffer, ignoring the view.
    pub fn full(&self) -> &[u8] {
        // SAFETY: ptr is valid for cap initialised bytes (zeroed at allocation), owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.cap) }
    }

    /// The whole buffer, mutably, ignoring the view.
    pub fn full_mut(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for cap initialised bytes; &mut self is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.cap) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if BufCache::give(self.ptr, self.cap) {
            return;
        }
        if self.cap > BufCache::LARGEST {
            // SAFETY: buffers of this capacity are mappings made in `fresh` with exactly
            // this length, never cached (give returned false), unmapped once here.
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.cap) };
            return;
        }
        let layout = Layout::from_size_align(self.cap, ALIGN).expect("layout was valid at allocation");
        // SAFETY: allocated in `fresh` with exactly this layout; dropped once, and not
        // kept by the cache (give returned false).
        unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) }
    }
}

/// Freed buffers kept for reuse, so that a request costs no allocation, no page faults
/// and (for [`AlignedBuf::recycled`]) no zeroing: a fresh 1 MiB buffer is 256 page
/// faults, which were a third of the server's CPU time in 1 MiB sequential writes.
///
/// Buffers up to [`BufCache::LARGEST`] bytes get power-of-two capacities (4 KiB,
/// 8 KiB, …, 2 MiB), one free list per capacity; at most [`BufCache::LIMIT`] bytes
/// are kept in all. Larger buffers are rounded to [`ALIGN`] and freed at once.
struct BufCache {
    /// Free buffers by class (`ALIGN << class` bytes); addresses of allocations made by
    /// [`AlignedBuf::fresh`] with that capacity, owned by the cache.
    free: [Vec<usize>; BufCache::CLASSES],
    bytes: usize,
}

static BUF_CACHE: std::sync::Mutex<BufCache> =
    std::sync::Mutex::new(BufCache { free: [const { Vec::new() }; BufCache::CLASSES], bytes: 0 });

impl BufCache {
    const CLASSES: usize = 10;
    /// Largest cached capacity, in bytes.
    const LARGEST: usize = ALIGN << (BufCache::CLASSES - 1);
    /// Most bytes kept in the cache.
    const LIMIT: usize = 16 << 20;

    /// The capacity a buffer of `cap` bytes gets.
    fn capacity_for(cap: usize) -> usize {
        let rounded = cap.max(1).div_ceil(ALIGN) * ALIGN;
        if rounded <= BufCache::LARGEST {
            rounded.next_power_of_two()
        } else {
            rounded
        }
    }

    fn class(cap: usize) -> Option<usize> {
        (cap.is_power_of_two() && (ALIGN..=BufCache::LARGEST).contains(&cap))
            .then(|| (cap / ALIGN).trailing_zeros() as usize)
    }

    /// A cached buffer for `cap` bytes, its view the first `cap` bytes.
    fn take(cap: usize) -> Option<AlignedBuf> {
        let rounded = BufCache::capacity_for(cap);
        let class = BufCache::class(rounded)?;
        let addr = {
            let mut c = BUF_CACHE.lock().unwrap_or_else(|e| e.into_inner());
            let addr = c.free[class].pop()?;
            c.bytes -= rounded;
            addr
        };
        let ptr = NonNull::new(addr as *mut u8).expect("cached buffers are non-null");
        Some(AlignedBuf { ptr, cap: rounded, start: 0, len: cap })
    }

    /// Keeps the buffer at `ptr` of capacity `cap` if there is room; true if kept (the
    /// cache then owns it).
    fn give(ptr: NonNull<u8>, cap: usize) -> bool {
        let Some(class) = BufCache::class(cap) else {
            return false;
        };
        let mut c = BUF_CACHE.lock().unwrap_or_else(|e| e.into_inner());
        if c.bytes + cap > BufCache::LIMIT {
            return false;
        }
        c.bytes += cap;
        c.free[class].push(ptr.as_ptr() as usize);
        true
    }
}

impl AsRef<[u8]> for AlignedBuf {
    fn as_ref(&self) -> &[u8] {
        &self.full()[self.start..self.start + self.len]
    }
}

impl AsMut<[u8]> for AlignedBuf {
    fn as_mut(&mut self) -> &mut [u8] {
        let (s, l) = (self.start, self.len);
        &mut self.full_mut()[s..s + l]
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("cap", &self.cap)
            .field("start", &self.start)
            .field("len", &self.len)
            .finish()
    }
}
