// SPDX-License-Identifier: Apache-2.0
//! The sharded embedding table over threads: the same rows on 1, 2 and 3 ranks as one process's
//! accumulator, an id out of range failing every rank, and a checkpoint (a full save and an
//! incremental layer) loaded by another world size under the other sharding rule.
mod common;

use common::{with_ranks, TempDir};
use gradsync::{
    status, AccumOptions, Accumulator, Concurrency, EmbeddingOptions, Optimizer, RowOptimizer, ShardedEmbedding,
    Sharding, Table, TableInit, TableOptions,
};

const ROWS: i64 = 200;
const DIM: usize = 5;

fn batch(step: u64) -> (Vec<i64>, Vec<f32>) {
    // A small deterministic generator: a third of the ids among 6 hot rows.
    let mut x = step.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xdead_beef;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut ids = Vec::new();
    let mut grads = Vec::new();
    for _ in 0..150 {
        let h = next();
        ids.push(if h % 3 == 0 { (h >> 8) as i64 % 6 } else { (h >> 8) as i64 % ROWS });
        for j in 0..DIM {
            grads.push(((next() % 2001) as f32 - 1000.0) * [1e-4, 1e-1, 3.0][j % 3]);
        }
    }
    (ids, grads)
}

fn options(sharding: Sharding) -> EmbeddingOptions {
    EmbeddingOptions {
        rows: ROWS,
        dim: DIM as i64,
        sharding,
        optimizer: RowOptimizer::RowAdagrad,
        lr: 0.05,
        init: TableInit::Uniform { seed: 9, lo: -0.1, hi: 0.1 },
        ..EmbeddingOptions::default()
    }
}

fn reference(steps: u64) -> Vec<f32> {
    let init = TableOptions::new().init(TableInit::Uniform { seed: 9, lo: -0.1, hi: 0.1 });
    let mut params = Table::anonymous_with(ROWS, DIM as i64, &init).unwrap();
    let mut state = Table::anonymous(ROWS, 1).unwrap();
    let accum = Accumulator::anonymous_with(ROWS, DIM as i64, &AccumOptions::new().concurrency(Concurrency::Owner))
        .unwrap();
    for s in 0..steps {
        let (ids, grads) = batch(s);
        accum.add_batch(&ids, &grads).unwrap();
        accum.apply(&mut params, Optimizer::RowAdagrad { lr: 0.05, eps: 1e-10 }, Some(&mut state)).unwrap();
    }
    let mut out = vec![0f32; ROWS as usize * DIM];
    params.gather(&(0..ROWS).collect::<Vec<_>>(), &mut out).unwrap();
    out
}

fn train(t: &mut ShardedEmbedding, rank: i32, size: i32, steps: std::ops::Range<u64>) {
    for s in steps {
        let (ids, grads) = batch(s);
        let (lo, hi) = (ids.len() * rank as usize / size as usize, ids.len() * (rank as usize + 1) / size as usize);
        t.push(&ids[lo..hi], &grads[lo * DIM..hi * DIM]).unwrap();
    }
}

fn assemble(parts: Vec<(Vec<i64>, Vec<f32>, Vec<f32>)>) -> Vec<f32> {
    let mut all = vec![f32::NAN; ROWS as usize * DIM];
    for (ids, values, _) in parts {
        for (i, id) in ids.iter().enumerate() {
            all[*id as usize * DIM..(*id as usize + 1) * DIM].copy_from_slice(&values[i * DIM..(i + 1) * DIM]);
        }
    }
    all
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn bitwise_equal_to_one_process_on_1_2_3_ranks() {
    let expected = bits(&reference(3));
    for size in 1..=3 {
        for sharding in [Sharding::Contiguous, Sharding::Hash] {
            let parts = with_ranks("emb", size, |comm| {
                let mut t = ShardedEmbedding::new(&comm, &options(sharding), None).unwrap();
                train(&mut t, comm.rank(), size, 0..3);
                let mut row = vec![0f32; 2 * DIM];
                t.lookup(&[0, 199], &mut row).unwrap();
                t.local_state().unwrap()
            });
            assert_eq!(bits(&assemble(parts)), expected, "{} ranks, {:?}", size, sharding);
        }
    }
}

#[test]
fn an_id_out_of_range_fails_every_rank() {
    let errs = with_ranks("emb-bad", 2, |comm| {
        let mut t = ShardedEmbedding::new(&comm, &options(Sharding::Hash), None).unwrap();
        let ids = if comm.rank() == 1 { vec![3, ROWS] } else { vec![3, 4] };
        t.push(&ids, &vec![1.0; 2 * DIM]).unwrap_err()
    });
    for e in errs {
        assert_eq!(e.status, status::OUT_OF_RANGE);
        assert!(e.message.contains("rank 1") && e.message.contains("id 200 at position 1"), "{}", e.message);
    }
}

#[test]
fn a_checkpoint_loads_into_another_world_size_and_rule() {
    let dir = TempDir::new("emb-ckpt");
    let path = dir.join("ckpt");
    with_ranks("emb-save", 3, |comm| {
        let mut t = ShardedEmbedding::new(&comm, &options(Sharding::Hash), None).unwrap();
        train(&mut t, comm.rank(), 3, 0..2);
        t.save(&path).unwrap();
        train(&mut t, comm.rank(), 3, 2..3);
        t.save_incremental(&path).unwrap(); // a layer of the rows pushed since
    });
    let parts = with_ranks("emb-load", 2, |comm| {
        let mut t = ShardedEmbedding::new(&comm, &options(Sharding::Contiguous), None).unwrap();
        t.load(&path).unwrap();
        assert_eq!(t.steps().unwrap(), 3);
        t.local_state().unwrap()
    });
    assert_eq!(bits(&assemble(parts)), bits(&reference(3)));
}

/// One process's Adam: the accumulator's apply with a `rows x (2·dim + 1)` state table.
fn reference_adam(steps: u64) -> (Vec<f32>, Vec<f32>) {
    let width = 2 * DIM + 1;
    let init = TableOptions::new().init(TableInit::Uniform { seed: 9, lo: -0.1, hi: 0.1 });
    let mut params = Table::anonymous_with(ROWS, DIM as i64, &init).unwrap();
    let mut state = Table::anonymous(ROWS, width as i64).unwrap();
    let accum = Accumulator::anonymous_with(ROWS, DIM as i64, &AccumOptions::new().concurrency(Concurrency::Owner))
        .unwrap();
    for s in 0..steps {
        let (ids, grads) = batch(s);
        accum.add_batch(&ids, &grads).unwrap();
        let adam = Optimizer::Adam { lr: 0.05, eps: 0.0, beta1: 0.9, beta2: 0.999 };
        accum.apply(&mut params, adam, Some(&mut state)).unwrap();
    }
    let all: Vec<i64> = (0..ROWS).collect();
    let mut values = vec![0f32; ROWS as usize * DIM];
    params.gather(&all, &mut values).unwrap();
    let mut st = vec![0f32; ROWS as usize * width];
    state.gather(&all, &mut st).unwrap();
    (values, st)
}

#[test]
fn adam_is_bitwise_equal_to_one_process_with_its_row_state() {
    let width = RowOptimizer::Adam.state_width(DIM);
    let (values, state) = reference_adam(3);
    for size in 1..=3 {
        let parts = with_ranks("emb-adam", size, |comm| {
            let opts = EmbeddingOptions { optimizer: RowOptimizer::Adam, ..options(Sharding::Hash) };
            let mut t = ShardedEmbedding::new(&comm, &opts, None).unwrap();
            train(&mut t, comm.rank(), size, 0..3);
            t.local_state().unwrap()
        });
        for (ids, _, st) in &parts {
            for (i, id) in ids.iter().enumerate() {
                let g = *id as usize;
                assert_eq!(bits(&st[i * width..(i + 1) * width]), bits(&state[g * width..(g + 1) * width]));
            }
        }
        assert_eq!(bits(&assemble(parts)), bits(&values), "{} ranks", size);
    }
    // row 0 is hot (pushed at every step): its update count is 3
    assert_eq!(state[2 * DIM], 3.0);
}

#[test]
fn reshard_grows_in_memory_and_changes_the_rule_in_place() {
    // 3 ranks train, grow to 4 with a joiner thread whose rows come from the members in memory,
    // change to the hash rule in place, and train on: bitwise one process's table.
    let join_name = common::unique("emb-grow-join");
    let joiner_name = join_name.clone();
    let joiner = std::thread::spawn(move || {
        let (grown, info) =
            gradsync::Communicator::join(&gradsync::CommOptions::new(&joiner_name, 0, 1).timeout_ms(30_000)).unwrap();
        assert_eq!((info.old_size, info.new_size), (3, 4));
        let mut t = ShardedEmbedding::new(&grown, &options(Sharding::Contiguous), None).unwrap();
        let (moved, restored) = t.reshard(&grown, None, None).unwrap();
        assert!(moved > 0 && !restored);
        assert_eq!(t.steps().unwrap(), 2);
        train(&mut t, grown.rank(), 4, 2..3);
        t.reshard(&grown, Some(Sharding::Hash), None).unwrap();
        train(&mut t, grown.rank(), 4, 3..4);
        t.local_state().unwrap()
    });
    let mut parts = with_ranks("emb-grow", 3, |comm| {
        let mut t = ShardedEmbedding::new(&comm, &options(Sharding::Contiguous), None).unwrap();
        train(&mut t, comm.rank(), 3, 0..2);
        let (grown, _) = comm.grow(&join_name, 1).unwrap();
        let (_, restored) = t.reshard(&grown, None, None).unwrap();
        assert!(!restored);
        train(&mut t, grown.rank(), 4, 2..3);
        t.reshard(&grown, Some(Sharding::Hash), None).unwrap();
        train(&mut t, grown.rank(), 4, 3..4);
        let rows = t.local_state().unwrap();
        drop(t);
        rows
    });
    parts.push(joiner.join().unwrap());
    assert_eq!(bits(&assemble(parts)), bits(&reference(4)));
}
