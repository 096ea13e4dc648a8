// SPDX-License-Identifier: Apache-2.0
//! Helpers shared by the integration tests.
#![allow(dead_code)]

use gradsync::{CommOptions, Communicator};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A group name no other test of this process uses (thread groups are per process, and cargo
/// runs tests in parallel threads).
pub fn unique(name: &str) -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    format!("rs-{}-{}-{}", name, std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Runs `body(rank, comm)` on `size` threads, each a rank of a fresh thread group; returns the
/// results in rank order.
pub fn with_ranks<R, F>(name: &str, size: i32, body: F) -> Vec<R>
where
    R: Send,
    F: Fn(Communicator) -> R + Sync,
{
    let group = unique(name);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..size)
            .map(|rank| {
                let (group, body) = (&group, &body);
                s.spawn(move || {
                    let comm = Communicator::new(&CommOptions::new(group, rank, size).timeout_ms(30_000))
                        .expect("join the group");
                    body(comm)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
    })
}

/// A fresh directory under the system's temporary directory, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(unique(name));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
    pub fn join(&self, file: &str) -> PathBuf {
        self.0.join(file)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
