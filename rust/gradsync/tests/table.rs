// SPDX-License-Identifier: Apache-2.0
//! Tables: anonymous and file-backed, rows, views, and the library's shape checks.
mod common;

use gradsync::{status, Table, TableInit, TableMode, TableOptions};

#[test]
fn rows_gather_scatter_and_view() {
    let mut t = Table::anonymous(4, 3).unwrap();
    assert_eq!(t.shape(), (4, 3));
    t.set(1, &[1.0, 2.0, 3.0]).unwrap();
    t.scatter(&[3, 0], &[7.0, 7.0, 7.0, 5.0, 5.0, 5.0]).unwrap();
    let mut out = vec![0f32; 6];
    t.gather(&[1, 3], &mut out).unwrap();
    assert_eq!(out, [1.0, 2.0, 3.0, 7.0, 7.0, 7.0]);
    t.prefetch(&[0, 1]).unwrap();
    let view = t.view().unwrap();
    assert_eq!(view, &[5.0, 5.0, 5.0, 1.0, 2.0, 3.0, 0.0, 0.0, 0.0, 7.0, 7.0, 7.0]);
    t.fill_zero().unwrap();
    assert_eq!(t.row(1).unwrap(), vec![0.0; 3]);
    t.fill_uniform(42, -1.0, 1.0).unwrap();
    assert!(t.view().unwrap().iter().all(|v| (-1.0..=1.0).contains(v)));

    let err = t.get(4, &mut [0.0; 3]).unwrap_err();
    assert_eq!(err.status, status::OUT_OF_RANGE);
    assert!(err.message.contains("gradsync_table_get"), "{}", err.message);
}

#[test]
fn a_file_is_created_once_and_never_reinterpreted() {
    let dir = common::TempDir::new("table");
    let path = dir.join("emb.gst");
    let opts = TableOptions::new().shape(100, 32).init(TableInit::Uniform { seed: 7, lo: -0.5, hi: 0.5 });
    let mut t = Table::open(&path, &opts).unwrap();
    assert!(t.created().unwrap());
    let first = t.row(3).unwrap();
    t.set(0, &[1.5; 32]).unwrap();
    t.flush().unwrap();
    drop(t);

    let t = Table::open(&path, &TableOptions::new().mode(TableMode::Open).read_only(true)).unwrap();
    assert!(!t.created().unwrap());
    assert_eq!(t.shape(), (100, 32));
    assert_eq!(t.row(3).unwrap(), first);
    assert_eq!(t.row(0).unwrap(), vec![1.5; 32]);
    drop(t);

    let err = Table::open(&path, &TableOptions::new().shape(100, 64)).unwrap_err();
    assert_eq!(err.status, status::MISMATCH);
    assert!(err.message.contains("100 x 32"), "{}", err.message);

    let mut ro = Table::open(&path, &TableOptions::new().mode(TableMode::Open).read_only(true)).unwrap();
    let err = ro.set(0, &[0.0; 32]).unwrap_err();
    assert_eq!(err.status, status::MISUSE);
    assert!(err.message.contains("gradsync_table_set"), "{}", err.message);
}

#[test]
fn reads_from_many_threads_at_once() {
    let mut t = Table::anonymous(64, 4).unwrap();
    for r in 0..64 {
        t.set(r, &[r as f32; 4]).unwrap();
    }
    let t = &t;
    std::thread::scope(|s| {
        for k in 0..4 {
            s.spawn(move || {
                for r in (k..64).step_by(4) {
                    assert_eq!(t.row(r).unwrap(), vec![r as f32; 4]);
                }
            });
        }
    });
}
