// SPDX-License-Identifier: Apache-2.0
//! Atomics for asynchronous (Hogwild) training (atomics.h): counters, a sticky flag and a
//! thread-owned mutex. These handles are internally synchronised (`@threadsafety any` on every
//! call but `*_free`), so they are `Send + Sync` and every method takes `&self`; `Drop` frees
//! them, which needs the only (owned) reference.

use crate::error::{check, Result};
use gradsync_sys as sys;
use std::marker::PhantomData;
use std::ptr::{self, NonNull};

macro_rules! counter {
    ($(#[$doc:meta])* $name:ident, $t:ty, $raw:ident, $create:ident, $free:ident, $fetch_add:ident, $load:ident, $store:ident) => {
        $(#[$doc])*
        pub struct $name {
            raw: NonNull<sys::$raw>,
        }

        // SAFETY: atomics.h: any number of threads may use a counter at once (`@threadsafety
        // any`); only free must not race, and it runs in Drop on the owned value.
        unsafe impl Send for $name {}
        unsafe impl Sync for $name {}

        impl $name {
            /// A counter holding `initial`.
            pub fn new(initial: $t) -> Result<Self> {
                let mut out = ptr::null_mut();
                check(unsafe { sys::$create(&mut out, initial) })?;
                Ok($name { raw: NonNull::new(out).expect("counter create returned OK and NULL") })
            }
            /// Adds `delta` atomically (wrapping); returns `(old, new)`.
            pub fn fetch_add(&self, delta: $t) -> Result<($t, $t)> {
                let (mut old, mut new) = (0, 0);
                check(unsafe { sys::$fetch_add(self.raw.as_ptr(), delta, &mut old, &mut new) })?;
                Ok((old, new))
            }
            /// The current value.
            pub fn load(&self) -> Result<$t> {
                let mut value = 0;
                check(unsafe { sys::$load(self.raw.as_ptr(), &mut value) })?;
                Ok(value)
            }
            /// Sets the value.
            pub fn store(&self, value: $t) -> Result<()> {
                check(unsafe { sys::$store(self.raw.as_ptr(), value) })
            }
        }

        impl Drop for $name {
            fn drop(&mut self) {
                // SAFETY: owned handle, freed once, no other reference left.
                unsafe { sys::$free(self.raw.as_ptr()) }
            }
        }

        impl std::fmt::Debug for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($name)).field("value", &self.load().ok()).finish()
            }
        }
    };
}

counter!(
    /// A 64-bit atomic counter (`gradsync_counter64`); arithmetic wraps modulo 2^64.
    /// `Send + Sync`: share it between threads with `Arc` or scoped threads.
    Counter, i64, gradsync_counter64, gradsync_counter64_create, gradsync_counter64_free,
    gradsync_counter64_fetch_add, gradsync_counter64_load, gradsync_counter64_store
);
counter!(
    /// A 32-bit atomic counter (`gradsync_counter32`); arithmetic wraps modulo 2^32.
    /// `Send + Sync`.
    Counter32, i32, gradsync_counter32, gradsync_counter32_create, gradsync_counter32_free,
    gradsync_counter32_fetch_add, gradsync_counter32_load, gradsync_counter32_store
);

/// A sticky flag (`gradsync_flag`): once set, only [`reset`](Self::reset) clears it. `Send + Sync`.
pub struct Flag {
    raw: NonNull<sys::gradsync_flag>,
}

// SAFETY: as for the counters (atomics.h, `@threadsafety any`).
unsafe impl Send for Flag {}
unsafe impl Sync for Flag {}

impl Flag {
    /// A flag, not set.
    pub fn new() -> Result<Flag> {
        let mut out = ptr::null_mut();
        check(unsafe { sys::gradsync_flag_create(&mut out) })?;
        Ok(Flag { raw: NonNull::new(out).expect("gradsync_flag_create returned OK and NULL") })
    }
    /// Sets the flag if `condition`; returns whether it is set afterwards.
    pub fn conditional_set(&self, condition: bool) -> Result<bool> {
        let mut is_set = 0i32;
        check(unsafe { sys::gradsync_flag_conditional_set(self.raw.as_ptr(), condition as i32, &mut is_set) })?;
        Ok(is_set != 0)
    }
    /// Whether the flag is set.
    pub fn check(&self) -> Result<bool> {
        let mut is_set = 0i32;
        check(unsafe { sys::gradsync_flag_check(self.raw.as_ptr(), &mut is_set) })?;
        Ok(is_set != 0)
    }
    /// Clears the flag.
    pub fn reset(&self) -> Result<()> {
        check(unsafe { sys::gradsync_flag_reset(self.raw.as_ptr()) })
    }
}

impl Drop for Flag {
    fn drop(&mut self) {
        unsafe { sys::gradsync_flag_free(self.raw.as_ptr()) }
    }
}

/// A mutex owned by the thread that locks it (`gradsync_mutex`), not recursive. It guards no
/// data of its own (use it to serialise work, e.g. across a foreign-language boundary); locking
/// returns a [`MutexGuard`] that unlocks on drop, on the same thread. `Send + Sync`.
pub struct Mutex {
    raw: NonNull<sys::gradsync_mutex>,
}

// SAFETY: atomics.h, `@threadsafety any` for lock, try_lock, lock_timeout and unlock.
unsafe impl Send for Mutex {}
unsafe impl Sync for Mutex {}

impl Mutex {
    /// An unlocked mutex.
    pub fn new() -> Result<Mutex> {
        let mut out = ptr::null_mut();
        check(unsafe { sys::gradsync_mutex_create(&mut out) })?;
        Ok(Mutex { raw: NonNull::new(out).expect("gradsync_mutex_create returned OK and NULL") })
    }
    /// Blocks until this thread holds it (`MISUSE` if it already does).
    pub fn lock(&self) -> Result<MutexGuard<'_>> {
        check(unsafe { sys::gradsync_mutex_lock(self.raw.as_ptr()) })?;
        Ok(MutexGuard { mutex: self, _not_send: PhantomData })
    }
    /// Takes it if free; `None` when another thread holds it.
    pub fn try_lock(&self) -> Result<Option<MutexGuard<'_>>> {
        let mut acquired = 0i32;
        check(unsafe { sys::gradsync_mutex_try_lock(self.raw.as_ptr(), &mut acquired) })?;
        Ok(if acquired != 0 { Some(MutexGuard { mutex: self, _not_send: PhantomData }) } else { None })
    }
    /// Waits at most `timeout_ms` for it (`TIMEOUT` error when not acquired).
    pub fn lock_timeout(&self, timeout_ms: i64) -> Result<MutexGuard<'_>> {
        check(unsafe { sys::gradsync_mutex_lock_timeout(self.raw.as_ptr(), timeout_ms) })?;
        Ok(MutexGuard { mutex: self, _not_send: PhantomData })
    }
}

impl Drop for Mutex {
    fn drop(&mut self) {
        unsafe { sys::gradsync_mutex_free(self.raw.as_ptr()) }
    }
}

/// Holds a [`Mutex`]; unlocks it when dropped. Not `Send`: the owning thread must unlock.
///
/// ```compile_fail
/// fn movable<T: Send>() {}
/// movable::<gradsync::MutexGuard<'static>>(); // the thread that locked must unlock
/// ```
pub struct MutexGuard<'a> {
    mutex: &'a Mutex,
    _not_send: PhantomData<*const ()>,
}

impl Drop for MutexGuard<'_> {
    fn drop(&mut self) {
        // Cannot fail for the owning thread of a live mutex.
        let _ = unsafe { sys::gradsync_mutex_unlock(self.mutex.raw.as_ptr()) };
    }
}

impl std::fmt::Debug for Flag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Flag").field("set", &self.check().ok()).finish()
    }
}

impl std::fmt::Debug for Mutex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mutex").finish_non_exhaustive()
    }
}

impl std::fmt::Debug for MutexGuard<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MutexGuard").finish_non_exhaustive()
    }
}
