// SPDX-License-Identifier: Apache-2.0
//! The accumulator's seed case: several threads add sparse rows to one accumulator, repeated ids
//! are summed exactly, then SGD updates the touched rows only.
mod common;

use gradsync::{status, AccumOptions, Accumulator, Concurrency, Optimizer, Table, TableMode};
use std::sync::Arc;

const ROWS: i64 = 100;
const DIM: usize = 8;
const THREADS: usize = 4;
const ROUNDS: usize = 50;

/// Every thread adds, ROUNDS times, one batch with rows [1, 5, 5, 42] (row 5 repeated), each row's
/// gradient all (thread + 1). Sums are small integers, so exact in f32.
fn add_from_threads(accum: &Accumulator) {
    std::thread::scope(|s| {
        for t in 0..THREADS {
            s.spawn(move || {
                let ids = [1i64, 5, 5, 42];
                let grads = vec![(t + 1) as f32; ids.len() * DIM];
                for _ in 0..ROUNDS {
                    accum.add_batch(&ids, &grads).unwrap();
                }
            });
        }
    });
}

fn seed(accum: &mut Accumulator) {
    add_from_threads(accum);
    let per_round: f32 = (1..=THREADS).map(|t| t as f32).sum(); // 10
    let once = per_round * ROUNDS as f32; // 500
    assert_eq!(accum.row(1).unwrap(), vec![once; DIM]);
    assert_eq!(accum.row(5).unwrap(), vec![2.0 * once; DIM]);
    assert_eq!(accum.row(42).unwrap(), vec![once; DIM]);
    assert_eq!(accum.row(0).unwrap(), vec![0.0; DIM]);
    assert_eq!(accum.touched_count().unwrap(), 3);
    let mut touched = accum.touched().unwrap();
    touched.sort_unstable();
    assert_eq!(touched, vec![1, 5, 42]);
    let view = accum.view().unwrap();
    assert_eq!(view.len(), ROWS as usize * DIM);
    assert_eq!(view[5 * DIM], 2.0 * once);

    let mut params = Table::anonymous(ROWS, DIM as i64).unwrap();
    let ones = vec![1.0f32; ROWS as usize * DIM];
    let all: Vec<i64> = (0..ROWS).collect();
    params.scatter(&all, &ones).unwrap();
    accum.apply(&mut params, Optimizer::Sgd { lr: 0.25 }, None).unwrap();

    for row in 0..ROWS {
        let expect = match row {
            1 | 42 => 1.0 - 0.25 * once,  // -124
            5 => 1.0 - 0.25 * 2.0 * once, // -249
            _ => 1.0,                     // untouched rows are not read or written
        };
        assert_eq!(params.row(row).unwrap(), vec![expect; DIM], "row {}", row);
    }
    // apply zeroed exactly the touched rows and emptied the set.
    assert_eq!(accum.touched_count().unwrap(), 0);
    assert_eq!(accum.row(5).unwrap(), vec![0.0; DIM]);
}

#[test]
fn seed_threads_add_sparse_rows_then_sgd_updates_touched_rows_only() {
    for mode in [Concurrency::Striped, Concurrency::LockFree] {
        let mut accum = Accumulator::anonymous_with(ROWS, DIM as i64, &AccumOptions::new().concurrency(mode)).unwrap();
        assert_eq!(accum.concurrency().unwrap().0, mode);
        assert_eq!(accum.shape(), (ROWS, DIM as i64));
        seed(&mut accum);
    }
}

#[test]
fn file_backed_accumulator_shared_through_an_arc() {
    let dir = common::TempDir::new("accum");
    let path = dir.join("grad.gsa");
    let opts = AccumOptions::new().mode(TableMode::Create).shape(ROWS, DIM as i64).rows_per_lock(4);
    let accum = Arc::new(Accumulator::open(&path, &opts).unwrap());
    let threads: Vec<_> = (0..THREADS)
        .map(|_| {
            let accum = Arc::clone(&accum);
            std::thread::spawn(move || accum.add(7, &[1.0; DIM]).unwrap())
        })
        .collect();
    threads.into_iter().for_each(|t| t.join().unwrap());
    assert_eq!(accum.row(7).unwrap(), vec![THREADS as f32; DIM]);
    accum.flush().unwrap();
    accum.zero().unwrap();
    assert_eq!((accum.touched_count().unwrap(), accum.row(7).unwrap()), (0, vec![0.0; DIM]));
    let mut accum = Arc::try_unwrap(accum).unwrap();
    seed(&mut accum);
    drop(accum);
    // The file exists now: CREATE refuses it, OPEN takes its shape.
    let err = Accumulator::open(&path, &opts).unwrap_err();
    assert_eq!(err.status, status::IO, "{}", err);
    let reopened = Accumulator::open(&path, &AccumOptions::new().mode(TableMode::Open)).unwrap();
    assert_eq!(reopened.shape(), (ROWS, DIM as i64));
}

#[test]
fn row_adagrad_with_its_state_table() {
    let accum = Accumulator::anonymous(10, 8).unwrap();
    accum.add_batch(&[2, 5, 2, 7], &[1.0; 32]).unwrap();
    let mut params = Table::anonymous(10, 8).unwrap();
    let mut state = Table::anonymous(10, 1).unwrap();
    let err = accum.apply(&mut params, Optimizer::RowAdagrad { lr: 0.5, eps: 1e-10 }, None).unwrap_err();
    assert_eq!(err.status, status::INVALID_ARG);
    assert!(err.message.contains("gradsync_accum_apply") && err.message.contains("state"), "{}", err.message);
    accum.apply(&mut params, Optimizer::RowAdagrad { lr: 0.5, eps: 1e-10 }, Some(&mut state)).unwrap();
    assert_eq!(state.row(2).unwrap(), vec![4.0]); // mean(2²)
    assert!((params.row(2).unwrap()[0] + 0.5).abs() < 1e-6);
    assert_eq!(params.row(3).unwrap(), vec![0.0; 8]);
}

#[test]
fn bad_rows_are_checked_before_anything_is_written() {
    let accum = Accumulator::anonymous(10, 8).unwrap();
    accum.add_batch(&[2], &[1.0; 8]).unwrap();
    let err = accum.add_batch(&[2, 10], &[1.0; 16]).unwrap_err();
    assert_eq!(err.status, status::OUT_OF_RANGE);
    assert!(err.message.contains("gradsync_accum_add_batch"), "{}", err.message);
    assert!(err.message.contains("row 10"), "{}", err.message);
    assert_eq!(accum.row(2).unwrap(), vec![1.0; 8]);
    let err = accum.add(0, &[1.0; 7]).unwrap_err();
    assert_eq!(err.status, status::INVALID_ARG);
    assert!(err.message.contains("gradsync_accum_add"), "{}", err.message);
}
