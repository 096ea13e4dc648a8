// SPDX-License-Identifier: Apache-2.0
//! [`Table`]: `rows x dim` f32 in a memory-mapped file or anonymous memory (table.h).

use crate::error::{check, invalid, Error, Result};
use crate::status;
use gradsync_sys as sys;
use std::ffi::{c_void, CString};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::ptr::{self, NonNull};

/// `gradsync_table_mode`: how to open a file (also used by [`AccumOptions`](crate::AccumOptions)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum TableMode {
    /// Create a new file; `IO` if the path exists.
    Create = sys::GRADSYNC_TABLE_CREATE,
    /// Open an existing file; `IO` if there is none.
    Open = sys::GRADSYNC_TABLE_OPEN,
    /// Open the file, creating it when it does not exist (default).
    CreateOrOpen = sys::GRADSYNC_TABLE_CREATE_OR_OPEN,
    /// Memory only, no file.
    Anonymous = sys::GRADSYNC_TABLE_ANONYMOUS,
}

/// How a newly created table is filled.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum TableInit {
    /// All zeros (default).
    Zeros,
    /// Uniform in `[lo, hi]`, a deterministic function of `seed` and the element index.
    Uniform { seed: u64, lo: f64, hi: f64 },
}

/// Options of [`Table::open`] (`gradsync_table_options`); unset fields keep the library's defaults.
#[derive(Clone, Debug, PartialEq)]
pub struct TableOptions {
    raw: sys::gradsync_table_options,
}

file_options!(TableOptions, sys::gradsync_table_options, sys::GRADSYNC_TABLE_OPTIONS_INIT);

impl TableOptions {
    /// The defaults: create or open, shape taken from an existing file, zeros, mode 0600.
    pub fn new() -> Self {
        Self::default()
    }
    /// Map read-only (mode [`TableMode::Open`] only); writes then fail with `MISUSE`.
    #[must_use]
    pub fn read_only(mut self, on: bool) -> Self {
        self.raw.read_only = on as i32;
        self
    }
    /// How a created table is filled.
    #[must_use]
    pub fn init(mut self, init: TableInit) -> Self {
        match init {
            TableInit::Zeros => self.raw.init = sys::GRADSYNC_TABLE_INIT_ZEROS,
            TableInit::Uniform { seed, lo, hi } => {
                self.raw.init = sys::GRADSYNC_TABLE_INIT_UNIFORM;
                self.raw.seed = seed;
                self.raw.lo = lo;
                self.raw.hi = hi;
            }
        }
        self
    }
}

pub(crate) fn path_to_cstring(method: &str, path: &Path) -> Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| invalid(method, format!("path {:?} contains a NUL byte", path)))
}

/// A table of `rows x dim` f32 (`gradsync_table`), in a memory-mapped file (headered,
/// checksummed, durable on [`flush`](Self::flush)) or in anonymous memory.
///
/// **Thread safety**: `Send + Sync`. table.h lets reads and writes of distinct rows run in
/// parallel from any thread, but does not synchronise two writers of one row; so reads take
/// `&self` and writes `&mut self`, which safe Rust cannot race. [`set_shared`](Self::set_shared)
/// and [`scatter_shared`](Self::scatter_shared) write through `&self` for callers that guarantee
/// distinct rows themselves (unsafe). `fill_*` are `@threadsafety handle` and take `&mut self`.
/// Another handle on the same file (a second `Table` opened on it, or another process) is not
/// covered by these borrows: do not write rows through it that this one reads or views meanwhile.
pub struct Table {
    raw: NonNull<sys::gradsync_table>,
    rows: i64,
    dim: i64,
}

// SAFETY: see the type's documentation: every &self method is `@threadsafety any` and only reads
// (or, in the unsafe *_shared methods, writes rows the caller guarantees no one else touches).
unsafe impl Send for Table {}
unsafe impl Sync for Table {}

shaped_handle_open!(
    Table,
    TableOptions,
    sys::gradsync_table_options,
    sys::gradsync_table_open,
    sys::gradsync_table_shape,
    open: "Opens or creates the table file at `path` (`gradsync_table_open`).",
    anonymous_with: "A table in memory only (mode ANONYMOUS), `rows x dim`, filled as `options` say.",
    anonymous: "A zeroed table in memory only, `rows x dim`."
);

impl Table {
    /// Whether [`open`](Self::open) created the file (`gradsync_table_created`).
    pub fn created(&self) -> Result<bool> {
        let mut created = 0i32;
        check(unsafe { sys::gradsync_table_created(self.raw.as_ptr(), &mut created) })?;
        Ok(created != 0)
    }

    /// The raw handle, for calls into [`gradsync_sys`]; it stays owned by `self`.
    pub fn as_raw(&self) -> *mut sys::gradsync_table {
        self.raw.as_ptr()
    }

    /// Copies row `row` into `out` (`dim` floats; `gradsync_table_get`).
    pub fn get(&self, row: i64, out: &mut [f32]) -> Result<()> {
        check(unsafe { sys::gradsync_table_get(self.raw.as_ptr(), row, out.as_mut_ptr(), out.len()) })
    }

    /// Row `row` as a new vector.
    pub fn row(&self, row: i64) -> Result<Vec<f32>> {
        let mut out = vec![0f32; self.dim.max(0) as usize];
        self.get(row, &mut out)?;
        Ok(out)
    }

    /// Overwrites row `row` with `values` (`dim` floats; `gradsync_table_set`).
    pub fn set(&mut self, row: i64, values: &[f32]) -> Result<()> {
        unsafe { self.set_shared(row, values) }
    }

    /// [`set`](Self::set) through a shared reference, for parallel writers of distinct rows.
    ///
    /// # Safety
    /// No other thread may write or read row `row` (through any method, or a [`view`](Self::view))
    /// during the call.
    pub unsafe fn set_shared(&self, row: i64, values: &[f32]) -> Result<()> {
        check(sys::gradsync_table_set(self.raw.as_ptr(), row, values.as_ptr(), values.len()))
    }

    /// Copies the rows `ids` (repeats allowed) into `out`, row after row (`ids.len() * dim`
    /// floats; `gradsync_table_gather`).
    pub fn gather(&self, ids: &[i64], out: &mut [f32]) -> Result<()> {
        check(unsafe {
            sys::gradsync_table_gather(self.raw.as_ptr(), ids.as_ptr(), ids.len(), out.as_mut_ptr(), out.len())
        })
    }

    /// Writes the rows `ids` from `values` (`ids.len() * dim` floats; with repeated ids the last
    /// wins; `gradsync_table_scatter`).
    pub fn scatter(&mut self, ids: &[i64], values: &[f32]) -> Result<()> {
        unsafe { self.scatter_shared(ids, values) }
    }

    /// [`scatter`](Self::scatter) through a shared reference.
    ///
    /// # Safety
    /// As [`set_shared`](Self::set_shared), for every row in `ids`.
    pub unsafe fn scatter_shared(&self, ids: &[i64], values: &[f32]) -> Result<()> {
        check(sys::gradsync_table_scatter(self.raw.as_ptr(), ids.as_ptr(), ids.len(), values.as_ptr(), values.len()))
    }

    /// Sets every element to zero (`gradsync_table_fill_zero`).
    pub fn fill_zero(&mut self) -> Result<()> {
        check(unsafe { sys::gradsync_table_fill_zero(self.raw.as_ptr()) })
    }

    /// Fills with uniform values in `[lo, hi]`, a fixed function of `(seed, index)`
    /// (`gradsync_table_fill_uniform`).
    pub fn fill_uniform(&mut self, seed: u64, lo: f32, hi: f32) -> Result<()> {
        check(unsafe { sys::gradsync_table_fill_uniform(self.raw.as_ptr(), seed, lo, hi) })
    }

    /// Makes every row written so far durable (`gradsync_table_flush`).
    pub fn flush(&self) -> Result<()> {
        check(unsafe { sys::gradsync_table_flush(self.raw.as_ptr()) })
    }

    /// Hints that these rows are about to be used (`gradsync_table_prefetch`).
    pub fn prefetch(&self, ids: &[i64]) -> Result<()> {
        check(unsafe { sys::gradsync_table_prefetch(self.raw.as_ptr(), ids.as_ptr(), ids.len()) })
    }

    /// The whole row-major data, `rows * dim` floats, borrowed from the mapping
    /// (`gradsync_table_view`). While it is borrowed no write through this handle can happen.
    pub fn view(&self) -> Result<&[f32]> {
        let mut data: *const c_void = ptr::null();
        let mut bytes = 0usize;
        check(unsafe { sys::gradsync_table_view(self.raw.as_ptr(), &mut data, &mut bytes) })?;
        if bytes == 0 {
            return Ok(&[]);
        }
        if data.is_null() || (data as usize) % std::mem::align_of::<f32>() != 0 {
            return Err(Error::local(status::INTERNAL, "gradsync_table_view: NULL or misaligned data".into()));
        }
        // SAFETY: `bytes` bytes of floats, valid until gradsync_table_free (i.e. while `self` is).
        Ok(unsafe { std::slice::from_raw_parts(data as *const f32, bytes / 4) })
    }
}

impl Drop for Table {
    fn drop(&mut self) {
        // SAFETY: owned handle, freed once, no borrow left.
        unsafe { sys::gradsync_table_free(self.raw.as_ptr()) }
    }
}

impl std::fmt::Debug for Table {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Table").field("rows", &self.rows).field("dim", &self.dim).finish()
    }
}
