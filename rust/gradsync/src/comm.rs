// SPDX-License-Identifier: Apache-2.0
//! [`Communicator`]: a group of ranks and its collectives (comm.h), over threads of one process,
//! processes of one host (shared memory) or MPI.

use crate::error::{check, invalid, Result};
use crate::types::{Element, ReduceOp};
use gradsync_sys as sys;
use std::ffi::c_void;
use std::fmt;
use std::marker::PhantomData;
use std::mem::size_of;
use std::ops::{Deref, DerefMut};
use std::ptr::{self, NonNull};

/// `gradsync_transport`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum Transport {
    /// Threads of one process, grouped by name.
    Thread = sys::GRADSYNC_TRANSPORT_THREAD,
    /// Processes of one host, grouped by name through `/dev/shm/gradsync.<name>`.
    Shm = sys::GRADSYNC_TRANSPORT_SHM,
    /// Processes over MPI (when the library was built with it; rank and size come from MPI).
    Mpi = sys::GRADSYNC_TRANSPORT_MPI,
    /// Processes over MPI on any number of hosts: shared memory within a host, MPI between hosts.
    Hier = sys::GRADSYNC_TRANSPORT_HIER,
}

impl Transport {
    fn from_raw(value: i32) -> Transport {
        match value {
            sys::GRADSYNC_TRANSPORT_SHM => Transport::Shm,
            sys::GRADSYNC_TRANSPORT_MPI => Transport::Mpi,
            sys::GRADSYNC_TRANSPORT_HIER => Transport::Hier,
            _ => Transport::Thread,
        }
    }
}

/// Options of [`Communicator::new`] (`gradsync_comm_options`); unset fields keep the library's
/// defaults (300 s timeout, mismatch checks on).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommOptions {
    name: String,
    rank: i32,
    size: i32,
    transport: Transport,
    timeout_ms: Option<i64>,
    deterministic: Option<bool>,
    check_mismatch: Option<bool>,
    mpi_fcomm: Option<i64>,
    host: Option<String>,
    threads: Option<(i32, i32)>,
}

/// What a grow reports besides the grown group ([`Communicator::grow`], [`Communicator::join`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GrowInfo {
    /// The members before the grow: the joiners' ranks start here.
    pub old_size: i32,
    /// The members after it.
    pub new_size: i32,
    /// Joiner j's member id is `first_member_id + j`: ids the group never used.
    pub first_member_id: i64,
    /// Agreeing and admitting the joiners (a joiner: waiting to be admitted).
    pub agree: std::time::Duration,
    /// Forming and committing the grown group.
    pub form: std::time::Duration,
}

impl GrowInfo {
    fn raw() -> sys::gradsync_grow_result {
        sys::gradsync_grow_result {
            struct_size: size_of::<sys::gradsync_grow_result>() as u32,
            version: sys::GRADSYNC_GROW_RESULT_VERSION,
            ..Default::default()
        }
    }
    fn from_raw(r: &sys::gradsync_grow_result) -> GrowInfo {
        let time = |ns: i64| std::time::Duration::from_nanos(ns.max(0) as u64);
        GrowInfo {
            old_size: r.old_size,
            new_size: r.new_size,
            first_member_id: r.first_member_id,
            agree: time(r.agree_ns),
            form: time(r.form_ns),
        }
    }
}

/// Which ranks share a host ([`Communicator::topology`]), the same on every rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    /// This rank's host; hosts are numbered by their lowest rank.
    pub host: i32,
    /// This rank's place among its host's ranks.
    pub local_rank: i32,
    /// The number of ranks on this rank's host.
    pub local_size: i32,
    /// The number of hosts.
    pub num_hosts: i32,
    /// Every rank's host, by rank.
    pub rank_hosts: Vec<i32>,
}

impl CommOptions {
    /// Rank `rank` of a group of `size` members called `name` (at most 63 bytes, no NUL), over
    /// threads unless [`transport`](Self::transport) says otherwise.
    pub fn new(name: &str, rank: i32, size: i32) -> CommOptions {
        CommOptions {
            name: name.to_owned(),
            rank,
            size,
            transport: Transport::Thread,
            timeout_ms: None,
            deterministic: None,
            check_mismatch: None,
            mpi_fcomm: None,
            host: None,
            threads: None,
        }
    }
    /// MPI and hierarchical transports: this process holds `threads` ranks of the group, one per
    /// thread that creates the communicator, and this is thread `thread` of them (comm.h,
    /// "Threads as ranks"). Process p's threads are ranks after those of processes 0..p, in
    /// thread order.
    #[must_use]
    pub fn threads(mut self, threads: i32, thread: i32) -> Self {
        self.threads = Some((threads, thread));
        self
    }
    /// A host label that replaces the detected host identity (odd clusters, tests).
    #[must_use]
    pub fn host(mut self, label: &str) -> Self {
        self.host = Some(label.to_owned());
        self
    }
    /// The transport (default [`Transport::Thread`]).
    #[must_use]
    pub fn transport(mut self, transport: Transport) -> Self {
        self.transport = transport;
        self
    }
    /// Deadline of joining and of each collective, > 0 ms ([`i64::MAX`]: none).
    #[must_use]
    pub fn timeout_ms(mut self, timeout_ms: i64) -> Self {
        self.timeout_ms = Some(timeout_ms);
        self
    }
    /// Rank-order reduction on MPI (threads and shared memory always are).
    #[must_use]
    pub fn deterministic(mut self, on: bool) -> Self {
        self.deterministic = Some(on);
        self
    }
    /// Whether ranks that disagree in a round are detected (default on).
    #[must_use]
    pub fn check_mismatch(mut self, on: bool) -> Self {
        self.check_mismatch = Some(on);
        self
    }
    /// MPI: the host's communicator as its Fortran handle (`MPI_Comm_c2f`); default MPI_COMM_WORLD.
    #[must_use]
    pub fn mpi_fcomm(mut self, fcomm: i64) -> Self {
        self.mpi_fcomm = Some(fcomm);
        self
    }

    fn to_raw(&self) -> Result<sys::gradsync_comm_options> {
        let mut raw = sys::GRADSYNC_COMM_OPTIONS_INIT;
        let bytes = self.name.as_bytes();
        if bytes.contains(&0) {
            return Err(invalid("CommOptions", format!("group name {:?} contains a NUL byte", self.name)));
        }
        if bytes.len() >= sys::GRADSYNC_COMM_NAME_MAX {
            return Err(invalid(
                "CommOptions",
                format!("group name has {} bytes, at most {} fit", bytes.len(), sys::GRADSYNC_COMM_NAME_MAX - 1),
            ));
        }
        for (dst, &src) in raw.name.iter_mut().zip(bytes) {
            *dst = src as sys::c_char;
        }
        raw.transport = self.transport as i32;
        raw.rank = self.rank;
        raw.size = self.size;
        if let Some(ms) = self.timeout_ms {
            raw.timeout_ms = ms;
        }
        if let Some(on) = self.deterministic {
            raw.deterministic = on as i32;
        }
        if let Some(on) = self.check_mismatch {
            raw.check_mismatch = on as i32;
        }
        if let Some(fcomm) = self.mpi_fcomm {
            raw.mpi_fcomm = fcomm;
        }
        if let Some((threads, thread)) = self.threads {
            raw.threads = threads;
            raw.thread = thread;
        }
        if let Some(label) = &self.host {
            let bytes = label.as_bytes();
            if bytes.contains(&0) || bytes.len() >= sys::GRADSYNC_COMM_NAME_MAX {
                return Err(invalid(
                    "CommOptions",
                    format!("host label {:?} has a NUL byte or more than {} bytes", label, sys::GRADSYNC_COMM_NAME_MAX - 1),
                ));
            }
            for (dst, &src) in raw.host.iter_mut().zip(bytes) {
                *dst = src as sys::c_char;
            }
        }
        Ok(raw)
    }
}

/// A slice as the C API's `const void *`.
fn cptr<T>(s: &[T]) -> *const c_void {
    s.as_ptr() as *const c_void
}

/// A slice as the C API's `void *`.
fn mptr<T>(s: &mut [T]) -> *mut c_void {
    s.as_mut_ptr() as *mut c_void
}

/// `T`'s `gradsync_dtype`.
fn dtype<T: Element>() -> i32 {
    T::DTYPE as i32
}

/// A local `INVALID_ARG` from `what` unless `send` and `recv` have the same length.
fn same_len<T>(what: &str, send: &[T], recv: &[T]) -> Result<()> {
    if send.len() == recv.len() {
        return Ok(());
    }
    Err(invalid(what, format!("send has {} elements, recv {}", send.len(), recv.len())))
}

/// Start and length of part `index` of `n` elements over `parts` parts (the partition rule).
pub(crate) fn part_of(n: usize, parts: usize, index: usize) -> (usize, usize) {
    let (q, r) = (n / parts, n % parts);
    (index * q + index.min(r), q + usize::from(index < r))
}

/// One rank of a group (`gradsync_comm`): deterministic collectives on slices of `f32`, `f64`,
/// `i32` or `i64` ([`Element`]).
///
/// Semantics are the library's (comm.h): every rank gets bitwise the same result; either every
/// rank's call succeeds or every rank's call fails; ranks that disagree (count, dtype, op, root)
/// all get [`status::MISMATCH`](crate::status::MISMATCH) and the next call works; a rank that does
/// not arrive in time gives `TIMEOUT`, after which calls fail with `ABORTED` until every rank calls
/// [`reset`](Self::reset). Errors that this wrapper finds before calling C (slices of inconsistent
/// lengths) are local to the calling rank, like the library's own argument checks.
///
/// **Thread safety**: `Send`, not `Sync`. The C rule is "one thread at a time per handle", so a
/// communicator may move to another thread but is not shared; the exception, `gradsync_comm_abort`
/// from any thread at any time, is available through [`abort_handle`](Self::abort_handle).
///
/// ```compile_fail
/// fn shared<T: Sync>() {}
/// shared::<gradsync::Communicator>(); // not Sync: one thread at a time
/// ```
///
/// Dropping it calls `gradsync_comm_free` (leaves the group; the peers' calls then fail with
/// `ABORTED`).
pub struct Communicator {
    raw: NonNull<sys::gradsync_comm>,
    rank: i32,
    size: i32,
    transport: Transport,
}

// SAFETY: comm.h allows a handle to be used from any thread, one thread at a time; a &mut-free
// API over a value that is not Sync guarantees exactly that. Use in another *process* (fork) is not
// possible from safe Rust.
unsafe impl Send for Communicator {}

impl Communicator {
    /// Joins the group (`gradsync_comm_create`): returns once every rank has joined, or fails with
    /// `TIMEOUT`. The error's message is read on this thread right after the C call.
    pub fn new(options: &CommOptions) -> Result<Communicator> {
        let raw_opts = options.to_raw()?;
        let mut out = ptr::null_mut();
        check(unsafe { sys::gradsync_comm_create(&mut out, &raw_opts) })?;
        let raw = NonNull::new(out).expect("gradsync_comm_create returned OK and a NULL handle");
        Communicator::adopt(raw)
    }

    fn adopt(raw: NonNull<sys::gradsync_comm>) -> Result<Communicator> {
        let mut comm = Communicator { raw, rank: 0, size: 0, transport: Transport::Thread };
        // The getters of values fixed at creation; they cannot fail on a live handle.
        let (mut rank, mut size, mut transport) = (0i32, 0i32, 0i32);
        check(unsafe { sys::gradsync_comm_rank(comm.raw.as_ptr(), &mut rank) })?;
        check(unsafe { sys::gradsync_comm_size(comm.raw.as_ptr(), &mut size) })?;
        check(unsafe { sys::gradsync_comm_transport(comm.raw.as_ptr(), &mut transport) })?;
        comm.rank = rank;
        comm.size = size;
        comm.transport = Transport::from_raw(transport);
        Ok(comm)
    }

    /// Rank `rank` of the thread group `name` of `size` members, with the default timeout.
    pub fn threads(name: &str, rank: i32, size: i32) -> Result<Communicator> {
        Communicator::new(&CommOptions::new(name, rank, size))
    }

    /// Rank `rank` of the shared-memory group `name` of `size` processes of this host.
    pub fn shm(name: &str, rank: i32, size: i32) -> Result<Communicator> {
        Communicator::new(&CommOptions::new(name, rank, size).transport(Transport::Shm))
    }

    /// This member's rank.
    pub fn rank(&self) -> i32 {
        self.rank
    }
    /// The number of ranks.
    pub fn size(&self) -> i32 {
        self.size
    }
    /// The transport.
    pub fn transport(&self) -> Transport {
        self.transport
    }
    /// A subgroup, as `MPI_Comm_split` (`gradsync_comm_split`): ranks passing the same
    /// `Some(color)` (>= 0) form a new communicator, ranked by `key`, then by rank here; `None`
    /// joins no subgroup and returns `Ok(None)`. Collective; the subgroup is independent of `self`.
    pub fn split(&self, color: Option<i32>, key: i32) -> Result<Option<Communicator>> {
        let mut out = ptr::null_mut();
        check(unsafe { sys::gradsync_comm_split(self.raw(), color.unwrap_or(sys::GRADSYNC_SPLIT_NONE), key, &mut out) })?;
        match NonNull::new(out) {
            Some(raw) => Communicator::adopt(raw).map(Some),
            None => Ok(None),
        }
    }

    /// Grow the group by `joiners` new ranks at a round boundary (`gradsync_comm_grow`):
    /// collective over this group, every member with the same `join_name` and count, while the
    /// joiners call [`Communicator::join`] with that name. The members keep their ranks and member
    /// ids; joiner j is rank `old_size + j` with member id `first_member_id + j`. This group is
    /// left as it was: move state onto the grown one (broadcast the parameters,
    /// `gradsync_shard_reshard` the optimizer slices), then drop it. On failure this
    /// group is stopped as after a failed collective: [`Communicator::reset`] it and grow again.
    /// Over MPI and hier (under `mpirun`) the members start the joiners themselves: rank 0's
    /// command line again, with `GRADSYNC_JOIN=<join_name>` in its environment, which then calls
    /// [`Communicator::join`]; a job that lost a whole host gives `UNSUPPORTED`.
    pub fn grow(&self, join_name: &str, joiners: i32) -> Result<(Communicator, GrowInfo)> {
        let name = std::ffi::CString::new(join_name)
            .map_err(|_| invalid("Communicator::grow", format!("join name {:?} contains a NUL byte", join_name)))?;
        let mut out = ptr::null_mut();
        let mut res = GrowInfo::raw();
        check(unsafe { sys::gradsync_comm_grow(self.raw(), name.as_ptr(), joiners, &mut out, &mut res) })?;
        let raw = NonNull::new(out).expect("gradsync_comm_grow returned OK and a NULL handle");
        Ok((Communicator::adopt(raw)?, GrowInfo::from_raw(&res)))
    }

    /// Join a running group as a new rank, the other side of [`Communicator::grow`]
    /// (`gradsync_comm_join`): `options` name the members' join name, this joiner's index among
    /// the joiners (its rank) and their count (its size), the transport and how long to wait for
    /// the members (its timeout). The grown group has the members' timeout and checks. Over MPI
    /// and hier only a process that the members' grow started joins (`GRADSYNC_JOIN` names the
    /// join), its index and count from MPI; with [`CommOptions::threads`] every thread of that
    /// process joins, each with its index (threads as ranks: the members' grow counts processes).
    pub fn join(options: &CommOptions) -> Result<(Communicator, GrowInfo)> {
        let raw_opts = options.to_raw()?;
        let mut out = ptr::null_mut();
        let mut res = GrowInfo::raw();
        check(unsafe { sys::gradsync_comm_join(&mut out, &raw_opts, &mut res) })?;
        let raw = NonNull::new(out).expect("gradsync_comm_join returned OK and a NULL handle");
        Ok((Communicator::adopt(raw)?, GrowInfo::from_raw(&res)))
    }

    /// This member's stable id (`gradsync_comm_member_id`): its rank in the group it was created
    /// in, kept by grows and splits; a joiner's is one the group never used.
    pub fn member_id(&self) -> Result<i64> {
        let mut id = 0i64;
        check(unsafe { sys::gradsync_comm_member_id(self.raw.as_ptr(), &mut id) })?;
        Ok(id)
    }

    /// Which ranks share a host (`gradsync_comm_topology`), the same on every rank.
    pub fn topology(&self) -> Result<Topology> {
        let mut t = Topology { host: 0, local_rank: 0, local_size: 0, num_hosts: 0, rank_hosts: vec![0; self.size as usize] };
        check(unsafe {
            sys::gradsync_comm_topology(
                self.raw(),
                &mut t.host,
                &mut t.local_rank,
                &mut t.local_size,
                &mut t.num_hosts,
                t.rank_hosts.as_mut_ptr(),
                t.rank_hosts.len(),
            )
        })?;
        Ok(t)
    }

    /// The raw handle, for calls into [`gradsync_sys`]; it stays owned by `self`.
    pub fn as_raw(&self) -> *mut sys::gradsync_comm {
        self.raw.as_ptr()
    }

    fn raw(&self) -> *mut sys::gradsync_comm {
        self.raw.as_ptr()
    }

    fn my_part(&self, n: usize) -> (usize, usize) {
        part_of(n, self.size.max(1) as usize, self.rank as usize)
    }

    /// `recv` at the root, NULL elsewhere (where the C call does not read it).
    fn at_root_mut<T>(&self, root: i32, recv: &mut [T]) -> *mut c_void {
        if self.rank == root {
            mptr(recv)
        } else {
            ptr::null_mut()
        }
    }

    /// `p` at the root, NULL elsewhere (where the C call does not read it).
    fn at_root<P>(&self, root: i32, p: *const P) -> *const P {
        if self.rank == root {
            p
        } else {
            ptr::null()
        }
    }

    /// A local `INVALID_ARG` unless this rank's part of `n` elements has `len` elements.
    fn my_part_is(&self, what: &str, n: usize, buf: &str, len: usize) -> Result<()> {
        let (_, part) = self.my_part(n);
        if len == part {
            return Ok(());
        }
        let message = format!(
            "rank {}'s part of {} elements over {} ranks has {} elements, {} has {}",
            self.rank, n, self.size, part, buf, len
        );
        Err(invalid(what, message))
    }

    /// `recv[i] = op over ranks of send[i]` (`gradsync_comm_allreduce`). `send` and `recv` have the
    /// same length (else a local `INVALID_ARG`).
    pub fn allreduce<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        same_len("Communicator::allreduce", send, recv)?;
        let (s, r, n) = (cptr(send), mptr(recv), send.len());
        check(unsafe { sys::gradsync_comm_allreduce(self.raw(), s, r, n, dtype::<T>(), op as i32) })
    }

    /// In-place allreduce of `buf` (`gradsync_comm_allreduce` with send == recv).
    pub fn allreduce_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let p = mptr(buf);
        check(unsafe { sys::gradsync_comm_allreduce(self.raw(), p, p, buf.len(), dtype::<T>(), op as i32) })
    }

    /// One fused in-place allreduce over several buffers, e.g. a gradient bucket
    /// (`gradsync_comm_allreduce_many`); the same results as one call each.
    pub fn allreduce_many<T: Element>(&self, bufs: &mut [&mut [T]], op: ReduceOp) -> Result<()> {
        let recvs: Vec<*mut c_void> = bufs.iter_mut().map(|b| mptr(b)).collect();
        let counts: Vec<usize> = bufs.iter().map(|b| b.len()).collect();
        let (r, c, n) = (recvs.as_ptr(), counts.as_ptr(), bufs.len());
        check(unsafe { sys::gradsync_comm_allreduce_many(self.raw(), ptr::null(), r, c, n, dtype::<T>(), op as i32) })
    }

    /// `recv = Σ wᵢ·sendᵢ / Σ wᵢ` with `weight` this rank's sample count
    /// (`gradsync_comm_weighted_mean`; `f32` and `f64` only). Returns `Σ wᵢ`.
    pub fn weighted_mean<T: Element>(&self, send: &[T], recv: &mut [T], weight: u64) -> Result<u64> {
        same_len("Communicator::weighted_mean", send, recv)?;
        self.weighted_mean_raw(cptr(send), mptr(recv), send.len(), dtype::<T>(), weight)
    }

    /// In-place weighted mean of `buf`; returns `Σ wᵢ`.
    pub fn weighted_mean_in_place<T: Element>(&self, buf: &mut [T], weight: u64) -> Result<u64> {
        let p = mptr(buf);
        self.weighted_mean_raw(p, p, buf.len(), dtype::<T>(), weight)
    }

    fn weighted_mean_raw(&self, s: *const c_void, r: *mut c_void, n: usize, dtype: i32, weight: u64) -> Result<u64> {
        let mut total = 0u64;
        check(unsafe { sys::gradsync_comm_weighted_mean(self.raw(), s, r, n, dtype, weight, &mut total) })?;
        Ok(total)
    }

    /// Copies `root`'s `buf` into every rank's `buf` (`gradsync_comm_broadcast`).
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: i32) -> Result<()> {
        check(unsafe { sys::gradsync_comm_broadcast(self.raw(), mptr(buf), buf.len(), dtype::<T>(), root) })
    }

    /// Gathers every rank's part into `recv` (`gradsync_comm_allgather`); `send` is this rank's
    /// part of `recv.len()` elements by the partition rule ([`part`](Self::part)).
    pub fn allgather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.my_part_is("Communicator::allgather", recv.len(), "send", send.len())?;
        check(unsafe { sys::gradsync_comm_allgather(self.raw(), cptr(send), mptr(recv), recv.len(), dtype::<T>()) })
    }

    /// Allgather with this rank's part already in place in `buf` at its offset.
    pub fn allgather_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        check(unsafe { sys::gradsync_comm_allgather(self.raw(), ptr::null(), mptr(buf), buf.len(), dtype::<T>()) })
    }

    /// Reduces `send` over ranks; this rank receives its part (by the partition rule) into `recv`
    /// (`gradsync_comm_reduce_scatter`), whose length must be that part's.
    pub fn reduce_scatter<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        self.my_part_is("Communicator::reduce_scatter", send.len(), "recv", recv.len())?;
        let (s, r, n) = (cptr(send), mptr(recv), send.len());
        check(unsafe { sys::gradsync_comm_reduce_scatter(self.raw(), s, r, n, dtype::<T>(), op as i32) })
    }

    /// Reduce-scatter in place: this rank's part of `buf` (at its offset) receives the reduction;
    /// the rest of `buf` is left unspecified.
    pub fn reduce_scatter_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let (start, _) = self.my_part(buf.len());
        let base = buf.as_mut_ptr();
        // SAFETY (add): start is within buf (the partition of buf.len() elements).
        let (s, r) = (base as *const c_void, unsafe { base.add(start) } as *mut c_void);
        check(unsafe { sys::gradsync_comm_reduce_scatter(self.raw(), s, r, buf.len(), dtype::<T>(), op as i32) })
    }

    /// Exchanges parts (`gradsync_comm_alltoall`): `send` is split by the partition rule and part
    /// j goes to rank j; `recv` holds `size` blocks of this rank's part length, in rank order.
    pub fn alltoall<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let (_, len) = self.my_part(send.len());
        if len.checked_mul(self.size as usize) != Some(recv.len()) {
            return Err(invalid(
                "Communicator::alltoall",
                format!("recv must hold {} ranks x {} elements, it has {}", self.size, len, recv.len()),
            ));
        }
        check(unsafe { sys::gradsync_comm_alltoall(self.raw(), cptr(send), mptr(recv), send.len(), dtype::<T>()) })
    }

    /// `counts` must hold one entry per rank.
    fn per_rank(&self, what: &'static str, counts: &[usize]) -> Result<usize> {
        if counts.len() != self.size as usize {
            return Err(invalid(what, format!("counts has {} entries, the group {} ranks", counts.len(), self.size)));
        }
        counts
            .iter()
            .try_fold(0usize, |a, &c| a.checked_add(c))
            .ok_or_else(|| invalid(what, "the counts' sum overflows".to_string()))
    }

    /// Every rank's part, rank r's `counts[r]` elements (0 allowed) after those of the ranks
    /// before it (`gradsync_comm_allgatherv`); every rank passes the same counts.
    pub fn allgatherv<T: Element>(&self, send: &[T], recv: &mut [T], counts: &[usize]) -> Result<()> {
        let total = self.per_rank("Communicator::allgatherv", counts)?;
        if send.len() != counts[self.rank as usize] || recv.len() != total {
            return Err(invalid(
                "Communicator::allgatherv",
                format!("send must hold counts[{}] and recv their sum ({})", self.rank, total),
            ));
        }
        let (s, r, c) = (cptr(send), mptr(recv), counts.as_ptr());
        check(unsafe { sys::gradsync_comm_allgatherv(self.raw(), s, r, c, dtype::<T>()) })
    }

    /// Reduces `send` (the counts' sum) over ranks; this rank receives the reduction of its
    /// `counts[rank]` elements (`gradsync_comm_reduce_scatterv`).
    pub fn reduce_scatterv<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        let total = self.per_rank("Communicator::reduce_scatterv", counts)?;
        if send.len() != total || recv.len() != counts[self.rank as usize] {
            return Err(invalid(
                "Communicator::reduce_scatterv",
                format!("send must hold the counts' sum ({}) and recv counts[{}]", total, self.rank),
            ));
        }
        let (s, r, c) = (cptr(send), mptr(recv), counts.as_ptr());
        check(unsafe { sys::gradsync_comm_reduce_scatterv(self.raw(), s, r, c, dtype::<T>(), op as i32) })
    }

    /// Sends `send_counts[d]` elements to rank d and receives `recv_counts[s]` from rank s, both
    /// packed in rank order (`gradsync_comm_alltoallv`); counts that two ranks see differently
    /// fail every rank with `MISMATCH` before anything moves.
    pub fn alltoallv<T: Element>(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        let sent = self.per_rank("Communicator::alltoallv", send_counts)?;
        let received = self.per_rank("Communicator::alltoallv", recv_counts)?;
        if send.len() != sent || recv.len() != received {
            return Err(invalid(
                "Communicator::alltoallv",
                format!("send must hold {} elements and recv {}", sent, received),
            ));
        }
        let (s, sc, r, rc) = (cptr(send), send_counts.as_ptr(), mptr(recv), recv_counts.as_ptr());
        check(unsafe { sys::gradsync_comm_alltoallv(self.raw(), s, sc, ptr::null(), r, rc, ptr::null(), dtype::<T>()) })
    }

    /// Reduces `send` over ranks, in rank order, into root's `recv` (`gradsync_comm_reduce`);
    /// `recv` is not touched elsewhere (pass an empty slice).
    pub fn reduce<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp, root: i32) -> Result<()> {
        if self.rank == root && recv.len() != send.len() {
            return Err(invalid("Communicator::reduce", format!("recv must hold {} elements at the root", send.len())));
        }
        let (s, r, n) = (cptr(send), self.at_root_mut(root, recv), send.len());
        check(unsafe { sys::gradsync_comm_reduce(self.raw(), s, r, n, dtype::<T>(), op as i32, root) })
    }

    /// Every rank's `send` (same length everywhere) into root's `recv`, rank r's at r * len
    /// (`gradsync_comm_gather`); `recv` is not touched elsewhere (pass an empty slice).
    pub fn gather<T: Element>(&self, send: &[T], recv: &mut [T], root: i32) -> Result<()> {
        if self.rank == root && Some(recv.len()) != send.len().checked_mul(self.size as usize) {
            return Err(invalid("Communicator::gather", format!("recv must hold {} x {} elements at the root", self.size, send.len())));
        }
        let (s, r, n) = (cptr(send), self.at_root_mut(root, recv), send.len());
        check(unsafe { sys::gradsync_comm_gather(self.raw(), s, r, n, dtype::<T>(), root) })
    }

    /// Every rank's `send` (any length) into root's `recv`, packed in rank order
    /// (`gradsync_comm_gatherv`); `recv_counts` (every rank's length) is read at the root only.
    pub fn gatherv<T: Element>(&self, send: &[T], recv: &mut [T], recv_counts: &[usize], root: i32) -> Result<()> {
        if self.rank == root && self.per_rank("Communicator::gatherv", recv_counts)? != recv.len() {
            return Err(invalid("Communicator::gatherv", "recv must hold the sum of recv_counts at the root".to_string()));
        }
        let (s, n) = (cptr(send), send.len());
        let (r, rc) = (self.at_root_mut(root, recv), self.at_root(root, recv_counts.as_ptr()));
        check(unsafe { sys::gradsync_comm_gatherv(self.raw(), s, n, r, rc, dtype::<T>(), root) })
    }

    /// Rank r receives block r of root's `send` (size x `recv.len()` elements; not read
    /// elsewhere: pass an empty slice) (`gradsync_comm_scatter`).
    pub fn scatter<T: Element>(&self, send: &[T], recv: &mut [T], root: i32) -> Result<()> {
        if self.rank == root && Some(send.len()) != recv.len().checked_mul(self.size as usize) {
            return Err(invalid("Communicator::scatter", format!("send must hold {} x {} elements at the root", self.size, recv.len())));
        }
        let (s, r, n) = (self.at_root(root, cptr(send)), mptr(recv), recv.len());
        check(unsafe { sys::gradsync_comm_scatter(self.raw(), s, r, n, dtype::<T>(), root) })
    }

    /// Rank r receives `send_counts[r]` elements (its `recv.len()`) of root's `send`, parts
    /// packed in rank order (`gradsync_comm_scatterv`); `send` and `send_counts` are read at the
    /// root only.
    pub fn scatterv<T: Element>(&self, send: &[T], send_counts: &[usize], recv: &mut [T], root: i32) -> Result<()> {
        if self.rank == root && self.per_rank("Communicator::scatterv", send_counts)? != send.len() {
            return Err(invalid("Communicator::scatterv", "send must hold the sum of send_counts at the root".to_string()));
        }
        let (s, sc) = (self.at_root(root, cptr(send)), self.at_root(root, send_counts.as_ptr()));
        let (r, n) = (mptr(recv), recv.len());
        check(unsafe { sys::gradsync_comm_scatterv(self.raw(), s, sc, r, n, dtype::<T>(), root) })
    }

    /// Waits until every rank has arrived (`gradsync_comm_barrier`).
    pub fn barrier(&self) -> Result<()> {
        check(unsafe { sys::gradsync_comm_barrier(self.raw()) })
    }

    /// Aborts the group (`gradsync_comm_abort`): every rank blocked in, or later entering, a
    /// collective gets `ABORTED` until [`reset`](Self::reset). To abort from another thread while
    /// this one waits in a collective, use [`abort_handle`](Self::abort_handle).
    pub fn abort(&self) -> Result<()> {
        check(unsafe { sys::gradsync_comm_abort(self.raw()) })
    }

    /// Clears an abort or timeout so the group can be used again (`gradsync_comm_reset`).
    /// Collective: every rank calls it.
    pub fn reset(&self) -> Result<()> {
        check(unsafe { sys::gradsync_comm_reset(self.raw()) })
    }

    /// A handle that can only abort this group, and may be used from any thread (`Send + Sync`,
    /// `Copy`) while this communicator is in a collective, e.g. from a watchdog in
    /// `std::thread::scope`. It borrows the communicator, so it cannot outlive it.
    pub fn abort_handle(&self) -> AbortHandle<'_> {
        AbortHandle { raw: self.raw, _comm: PhantomData }
    }

    /// Start and length of `rank`'s part of `n` elements, by the partition rule that allgather,
    /// reduce-scatter and alltoall use.
    pub fn part(&self, n: usize, rank: i32) -> (usize, usize) {
        part_of(n, self.size.max(1) as usize, rank.max(0) as usize)
    }

    /// `len` zeroed elements of memory from this communicator (`gradsync_comm_alloc`): on the
    /// shared-memory transport it lies in the group's segment, and collectives whose buffers all
    /// come from here run zero copy. Freed (`gradsync_comm_free_buffer`) when dropped.
    pub fn alloc<T: Element>(&self, len: usize) -> Result<CommBuffer<'_, T>> {
        let bytes = len
            .checked_mul(size_of::<T>())
            .ok_or_else(|| invalid("Communicator::alloc", format!("{} elements overflow the address space", len)))?;
        let mut p: *mut c_void = ptr::null_mut();
        check(unsafe { sys::gradsync_comm_alloc(self.raw(), bytes, &mut p) })?;
        let p = NonNull::new(p as *mut T).expect("gradsync_comm_alloc returned OK and NULL");
        // SAFETY: `bytes` writable bytes, aligned to 4096; zeroed so that the slice is initialised.
        unsafe { ptr::write_bytes(p.as_ptr() as *mut u8, 0, bytes) };
        Ok(CommBuffer { comm: self, ptr: p, len })
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // SAFETY: owned handle, freed once; no call can run on it (not Sync, and &mut self).
        unsafe { sys::gradsync_comm_free(self.raw.as_ptr()) }
    }
}

impl fmt::Debug for Communicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("transport", &self.transport)
            .finish()
    }
}

/// Aborts a [`Communicator`]'s group from any thread (`gradsync_comm_abort`, "any thread, any
/// time"). Borrowed from the communicator by [`Communicator::abort_handle`].
#[derive(Clone, Copy, Debug)]
pub struct AbortHandle<'a> {
    raw: NonNull<sys::gradsync_comm>,
    _comm: PhantomData<&'a Communicator>,
}

// SAFETY: the only call made through it is gradsync_comm_abort, documented `any-abort`: callable
// from any thread, also while another thread is inside a collective on the handle. The borrow keeps
// the communicator (and so the handle) alive.
unsafe impl Send for AbortHandle<'_> {}
unsafe impl Sync for AbortHandle<'_> {}

impl AbortHandle<'_> {
    /// Aborts the group: the collective running on the communicator's thread returns `ABORTED`,
    /// and so do the peers'. The error message, if any, is read on the calling thread.
    pub fn abort(&self) -> Result<()> {
        check(unsafe { sys::gradsync_comm_abort(self.raw.as_ptr()) })
    }
}

/// Memory from [`Communicator::alloc`], usable as a slice; freed when dropped. It borrows the
/// communicator (so it is neither `Send` nor `Sync`, and cannot outlive it).
///
/// On the shared-memory transport, after a collective on it fails, a stopped peer may still write
/// the buffer until [`Communicator::reset`] returns (comm.h): do not read it in between.
pub struct CommBuffer<'c, T: Element> {
    comm: &'c Communicator,
    ptr: NonNull<T>,
    len: usize,
}

impl<T: Element> Deref for CommBuffer<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: len initialised elements, alive until drop.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Element> DerefMut for CommBuffer<'_, T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as above, and uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Element> Drop for CommBuffer<'_, T> {
    fn drop(&mut self) {
        // Nothing to report to: a failure here (never expected) leaves the buffer to
        // gradsync_comm_free, which releases every buffer still allocated.
        let _ = unsafe { sys::gradsync_comm_free_buffer(self.comm.raw(), self.ptr.as_ptr() as *mut c_void) };
    }
}

impl<T: Element + fmt::Debug> fmt::Debug for CommBuffer<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}
