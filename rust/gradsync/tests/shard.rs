// SPDX-License-Identifier: Apache-2.0
//! A sharded parameter over a 2-thread group: the same weights on both ranks, and a bad argument
//! on one rank reported on both.
mod common;

use gradsync::{status, ShardOptimizer, ShardOptions, ShardedParameter, Slice};

#[test]
fn sgd_step_gives_the_same_weights_on_every_rank() {
    let out = common::with_ranks("shard", 2, |comm| {
        let opts = ShardOptions { optimizer: ShardOptimizer::Sgd, lr: 0.5, ..ShardOptions::default() };
        let mut shard = ShardedParameter::new(&comm, 5, &opts).unwrap();
        assert_eq!(shard.ranges().unwrap(), vec![(0, 3), (3, 2)]);
        let (offset, len) = shard.part(None).unwrap();
        shard.init(&[1.0; 5]).unwrap();
        // Gradients 1 and 3: mean 2, so w = 1 - 0.5 * 2 = 0.
        let grad = [1.0 + 2.0 * comm.rank() as f32; 5];
        let mut weights = [9.0f32; 5];
        shard.step(&grad, &mut weights, 1).unwrap();
        assert_eq!(shard.updates().unwrap(), 1);
        let mut mine = vec![0f32; len as usize];
        shard.read_slice(Slice::Gradient, &mut mine).unwrap();
        assert_eq!(mine, vec![2.0; len as usize]);

        // A gradient of the wrong length on rank 1: INVALID_ARG there, REMOTE on rank 0.
        let bad = if comm.rank() == 1 { vec![0.0f32; 4] } else { vec![0.0f32; 5] };
        let err = shard.step(&bad, &mut [0.0; 5], 1).unwrap_err();
        (offset, weights, err)
    });
    assert_eq!(out[0].1, [0.0; 5]);
    assert_eq!(out[0].1, out[1].1);
    assert_eq!((out[0].0, out[1].0), (0, 3));
    assert_eq!(out[1].2.status, status::INVALID_ARG, "{}", out[1].2);
    assert!(out[1].2.message.contains("gradient has 4 floats"), "{}", out[1].2);
    assert_eq!(out[0].2.status, status::REMOTE, "{}", out[0].2);
    assert!(out[0].2.message.contains("gradsync_shard_step"), "{}", out[0].2);
}

#[test]
fn restore_takes_each_ranks_slice_of_the_state_and_read_slice_gives_it_back() {
    let out = common::with_ranks("shard-restore", 2, |comm| {
        let opts = ShardOptions { optimizer: ShardOptimizer::Momentum, lr: 0.5, ..ShardOptions::default() };
        let mut shard = ShardedParameter::new(&comm, 5, &opts).unwrap();
        let velocity = [10.0, 11.0, 12.0, 13.0, 14.0];
        let short = shard.restore(&[1.0; 5], Some(&velocity[..4]), None, 3).unwrap_err();
        let adam_state = shard.restore(&[1.0; 5], Some(&velocity), Some(&velocity), 3).unwrap_err();
        shard.restore(&[1.0; 5], Some(&velocity), None, 3).unwrap();
        assert_eq!(shard.updates().unwrap(), 3);
        let (_, len) = shard.part(None).unwrap();
        let mut mine = vec![0f32; len as usize];
        shard.read_slice(Slice::State1, &mut mine).unwrap();
        let none = shard.read_slice(Slice::State2, &mut mine.clone()).unwrap_err();
        (mine, short, adam_state, none)
    });
    assert_eq!(out[0].0, vec![10.0, 11.0, 12.0]);
    assert_eq!(out[1].0, vec![13.0, 14.0]);
    assert!(out[0].1.message.contains("state1 holds 4 floats"), "{}", out[0].1);
    assert_eq!(out[0].2.status, status::INVALID_ARG, "{}", out[0].2);
    assert!(out[0].2.message.contains("keeps no second state, but one was given"), "{}", out[0].2);
    assert!(out[0].3.message.contains("the optimizer (momentum) keeps no second state"), "{}", out[0].3);
}
