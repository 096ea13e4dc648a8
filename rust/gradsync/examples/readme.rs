// SPDX-License-Identifier: Apache-2.0
// The README's Rust example, as written there (tests/python/test_readme.py keeps them equal).
use gradsync::{Communicator, ReduceOp};

fn main() -> gradsync::Result<()> {
    // Two threads of this process form the group "train" (Communicator::shm: processes of a host).
    let means = std::thread::scope(|s| {
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                s.spawn(move || -> gradsync::Result<[f32; 2]> {
                    let comm = Communicator::threads("train", rank, 2)?;
                    let k = (rank + 1) as f32;
                    let mut grad = [2.0 * k, 4.0 * k];
                    comm.allreduce_in_place(&mut grad, ReduceOp::Mean)?;
                    Ok(grad)
                })
            })
            .collect();
        ranks.into_iter().map(|h| h.join().unwrap()).collect::<gradsync::Result<Vec<_>>>()
    })?;
    assert_eq!(means, [[3.0, 6.0], [3.0, 6.0]]); // same bits on both ranks, every run
    let err = gradsync::partition(10, 3, 5).unwrap_err();
    println!("{} {}", err.status, err.message); // -14 gradsync_partition: part 5 out of range [0, 3)
    Ok(())
}
