// SPDX-License-Identifier: Apache-2.0
//! The communicator over threads: the seed's cases (mean of [2,4] and [4,8]; a mismatch on both
//! ranks and a working next call), every collective and element type, abort and reset.
mod common;

use common::with_ranks;
use gradsync::{status, CommOptions, Communicator, ReduceOp, Transport};
use std::sync::mpsc;
use std::time::Duration;

#[test]
fn seed_two_threads_allreduce_mean() {
    let out = with_ranks("seed-mean", 2, |comm| {
        let k = (comm.rank() + 1) as f32;
        let send = [2.0 * k, 4.0 * k];
        let mut recv = [0f32; 2];
        comm.allreduce(&send, &mut recv, ReduceOp::Mean).unwrap();
        recv
    });
    assert_eq!(out, vec![[3.0, 6.0], [3.0, 6.0]]);
}

#[test]
fn seed_mismatch_fails_on_both_ranks_and_the_next_call_works() {
    let out = with_ranks("seed-mismatch", 2, |comm| {
        // Rank 0 sends 2 elements, rank 1 sends 3.
        let mut wrong = vec![1f32; 2 + comm.rank() as usize];
        let err = comm.allreduce_in_place(&mut wrong, ReduceOp::Sum).unwrap_err();
        let mut right = [2.0 * (comm.rank() + 1) as f32, 4.0 * (comm.rank() + 1) as f32];
        comm.allreduce_in_place(&mut right, ReduceOp::Mean).unwrap();
        (err, right)
    });
    for (err, right) in out {
        assert_eq!(err.status, status::MISMATCH, "{}", err);
        assert!(err.message.contains("gradsync_comm_allreduce"), "{}", err.message);
        assert_eq!(right, [3.0, 6.0]);
    }
}

#[test]
fn every_element_type_and_op() {
    with_ranks("dtypes", 2, |comm| {
        let r = comm.rank();
        let mut a = [r as f64 + 0.5, -(r as f64)];
        comm.allreduce_in_place(&mut a, ReduceOp::Sum).unwrap();
        assert_eq!(a, [2.0, -1.0]);
        let mut b = [r * 10, 7 - r];
        comm.allreduce_in_place(&mut b, ReduceOp::Max).unwrap();
        assert_eq!(b, [10, 7]);
        let mut c = [i64::MAX - 1 + r as i64, r as i64];
        comm.allreduce_in_place(&mut c, ReduceOp::Min).unwrap();
        assert_eq!(c, [i64::MAX - 1, 0]);
        let mut d = [3i32 + r, 4];
        comm.allreduce_in_place(&mut d, ReduceOp::Mean).unwrap(); // (3+4)/2 truncated
        assert_eq!(d, [3, 4]);
    });
}

#[test]
fn fused_broadcast_gather_scatter_alltoall_barrier() {
    with_ranks("collectives", 2, |comm| {
        let r = comm.rank();
        let size = comm.size();
        assert_eq!((size, comm.transport()), (2, Transport::Thread));

        let mut x = vec![r as f32; 3];
        let mut y = vec![1.0f32 + r as f32; 5];
        let mut empty: Vec<f32> = Vec::new();
        comm.allreduce_many(&mut [&mut x[..], &mut y[..], &mut empty[..]], ReduceOp::Sum).unwrap();
        assert_eq!((x, y), (vec![1.0; 3], vec![3.0; 5]));

        let mut b = if r == 1 { vec![9i64, 8, 7] } else { vec![0; 3] };
        comm.broadcast(&mut b, 1).unwrap();
        assert_eq!(b, [9, 8, 7]);

        // 5 elements over 2 ranks: parts (0,3) and (3,2).
        let (start, len) = comm.part(5, r);
        let mine: Vec<f64> = (start..start + len).map(|i| i as f64 * 10.0).collect();
        let mut all = vec![0f64; 5];
        comm.allgather(&mine, &mut all).unwrap();
        assert_eq!(all, [0.0, 10.0, 20.0, 30.0, 40.0]);

        let mut all2 = vec![-1i32; 5];
        all2[start..start + len].iter_mut().for_each(|v| *v = r + 100);
        comm.allgather_in_place(&mut all2).unwrap();
        assert_eq!(all2, [100, 100, 100, 101, 101]);

        let send = [1f32, 2.0, 3.0, 4.0, 5.0];
        let mut part = vec![0f32; len];
        comm.reduce_scatter(&send, &mut part, ReduceOp::Sum).unwrap();
        assert_eq!(part, send[start..start + len].iter().map(|v| v * 2.0).collect::<Vec<_>>());

        let mut inplace = send;
        comm.reduce_scatter_in_place(&mut inplace, ReduceOp::Max).unwrap();
        assert_eq!(&inplace[start..start + len], &send[start..start + len]);

        // alltoall of 4 elements: part j (2 elements) goes to rank j.
        let send: Vec<i32> = (0..4).map(|i| r * 10 + i).collect();
        let mut recv = vec![0i32; 4];
        comm.alltoall(&send, &mut recv).unwrap();
        let expect: Vec<i32> = if r == 0 { vec![0, 1, 10, 11] } else { vec![2, 3, 12, 13] };
        assert_eq!(recv, expect);

        let total = comm.weighted_mean(&[2.0f32 * (r + 1) as f32], &mut [0.0f32], 1 + r as u64).unwrap();
        assert_eq!(total, 3);

        comm.barrier().unwrap();
    });
}

#[test]
fn comm_buffers_work_in_collectives() {
    with_ranks("alloc", 2, |comm| {
        let mut buf = comm.alloc::<f32>(1000).unwrap();
        assert!(buf.iter().all(|&v| v == 0.0));
        buf.iter_mut().for_each(|v| *v = (comm.rank() + 1) as f32);
        comm.allreduce_in_place(&mut buf, ReduceOp::Sum).unwrap();
        assert!(buf.iter().all(|&v| v == 3.0));
        let err = comm.alloc::<f64>(0).unwrap_err();
        assert_eq!(err.status, status::INVALID_ARG);
        assert!(err.message.contains("gradsync_comm_alloc"), "{}", err.message);
    });
}

#[test]
fn local_length_errors_touch_nothing_and_the_group_goes_on() {
    with_ranks("lengths", 2, |comm| {
        let err = comm.allreduce(&[1f32, 2.0], &mut [0f32; 3], ReduceOp::Sum).unwrap_err();
        assert_eq!(err.status, status::INVALID_ARG);
        assert!(err.message.contains("Communicator::allreduce"), "{}", err.message);
        let err = comm.allgather(&[1f32; 4], &mut [0f32; 5]).unwrap_err();
        assert_eq!(err.status, status::INVALID_ARG);
        let err = comm.reduce_scatter(&[1f32; 5], &mut [0f32; 5], ReduceOp::Sum).unwrap_err();
        assert_eq!(err.status, status::INVALID_ARG);
        let err = comm.alltoall(&[1f32; 4], &mut [0f32; 3]).unwrap_err();
        assert_eq!(err.status, status::INVALID_ARG);
        comm.barrier().unwrap();
    });
}

#[test]
fn abort_from_another_thread_then_reset() {
    let (tx, rx) = mpsc::channel::<()>();
    let (tx, rx) = (std::sync::Mutex::new(tx), std::sync::Mutex::new(rx));
    with_ranks("abort", 2, |comm| {
        if comm.rank() == 0 {
            // Rank 1 is not coming yet: a watchdog thread aborts the barrier rank 0 waits in.
            let abort = comm.abort_handle();
            let err = std::thread::scope(|s| {
                s.spawn(move || {
                    std::thread::sleep(Duration::from_millis(200));
                    abort.abort().unwrap();
                });
                comm.barrier().unwrap_err()
            });
            assert_eq!(err.status, status::ABORTED, "{}", err);
            tx.lock().unwrap().send(()).unwrap();
        } else {
            rx.lock().unwrap().recv().unwrap();
            // The group is aborted: calls fail fast until every rank resets.
            let err = comm.barrier().unwrap_err();
            assert_eq!(err.status, status::ABORTED, "{}", err);
        }
        comm.reset().unwrap();
        let mut v = [comm.rank() as f32];
        comm.allreduce_in_place(&mut v, ReduceOp::Sum).unwrap();
        assert_eq!(v, [1.0]);
        comm.abort().unwrap();
        assert_eq!(comm.barrier().unwrap_err().status, status::ABORTED);
    });
}

#[test]
fn a_communicator_moves_to_another_thread() {
    let group = common::unique("send");
    let (a, b) = std::thread::scope(|s| {
        let h = s.spawn(|| Communicator::threads(&group, 1, 2).unwrap());
        let a = Communicator::threads(&group, 0, 2).unwrap();
        (a, h.join().unwrap())
    });
    // Both were created on other threads (b) or this one (a); use them from new threads.
    std::thread::scope(|s| {
        let t = s.spawn(move || {
            let mut v = [1i32];
            b.allreduce_in_place(&mut v, ReduceOp::Sum).map(|_| v)
        });
        let mut v = [2i32];
        a.allreduce_in_place(&mut v, ReduceOp::Sum).unwrap();
        assert_eq!(v, [3]);
        assert_eq!(t.join().unwrap().unwrap(), [3]);
    });
}

#[test]
fn bad_options_are_reported_by_create() {
    let err = Communicator::threads(&common::unique("bad"), 5, 2).unwrap_err();
    assert_eq!(err.status, status::OUT_OF_RANGE);
    assert!(err.message.contains("gradsync_comm_create"), "{}", err.message);
    let long = "x".repeat(64);
    let err = Communicator::threads(&long, 0, 1).unwrap_err();
    assert_eq!(err.status, status::INVALID_ARG);
    assert!(err.message.contains("63"), "{}", err.message);
}

#[test]
fn shared_memory_transport_when_available() {
    if !gradsync::has_feature(gradsync::Feature::ShmTransport) {
        return;
    }
    let group = common::unique("shm");
    let out: Vec<[f32; 2]> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                let group = &group;
                s.spawn(move || {
                    let opts = gradsync::CommOptions::new(group, rank, 2).transport(Transport::Shm).timeout_ms(30_000);
                    let comm = Communicator::new(&opts).unwrap();
                    assert_eq!(comm.transport(), Transport::Shm);
                    let k = (rank + 1) as f32;
                    let mut v = [2.0 * k, 4.0 * k];
                    comm.allreduce_in_place(&mut v, ReduceOp::Mean).unwrap();
                    v
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(out, vec![[3.0, 6.0], [3.0, 6.0]]);
}

#[test]
fn v_and_rooted_collectives() {
    with_ranks("v-rooted", 3, |comm| {
        let r = comm.rank() as usize;
        // allgatherv: rank r gives r elements.
        let counts = [0usize, 1, 2];
        let mine = vec![r as i64; r];
        let mut all = vec![0i64; 3];
        comm.allgatherv(&mine, &mut all, &counts).unwrap();
        assert_eq!(all, [1, 2, 2]);

        let send = [1f32, 2.0, 3.0];
        let mut part = vec![0f32; counts[r]];
        comm.reduce_scatterv(&send, &mut part, &counts, ReduceOp::Sum).unwrap();
        let start: usize = counts[..r].iter().sum();
        assert_eq!(part, send[start..start + counts[r]].iter().map(|v| v * 3.0).collect::<Vec<_>>());

        // alltoallv: rank s sends s + d elements to rank d, valued 10 * s + d.
        let send_counts: Vec<usize> = (0..3).map(|d| r + d).collect();
        let recv_counts: Vec<usize> = (0..3).map(|s| s + r).collect();
        let send: Vec<i32> = (0..3).flat_map(|d| vec![(10 * r + d) as i32; r + d]).collect();
        let mut recv = vec![0i32; recv_counts.iter().sum()];
        comm.alltoallv(&send, &send_counts, &mut recv, &recv_counts).unwrap();
        let want: Vec<i32> = (0..3).flat_map(|s| vec![(10 * s + r) as i32; s + r]).collect();
        assert_eq!(recv, want);
        let mut wrong = recv_counts.clone();
        if r == 2 {
            wrong[0] += 1;
        }
        let mut bigger = vec![0i32; wrong.iter().sum()];
        let err = comm.alltoallv(&send, &send_counts, &mut bigger, &wrong).unwrap_err();
        assert_eq!(err.status, status::MISMATCH);

        let x = [r as f64 + 1.0; 2];
        let mut total = if r == 1 { vec![0f64; 2] } else { Vec::new() };
        comm.reduce(&x, &mut total, ReduceOp::Sum, 1).unwrap();
        if r == 1 {
            assert_eq!(total, [6.0, 6.0]);
        }

        let mut rows = if r == 0 { vec![0f64; 6] } else { Vec::new() };
        comm.gather(&x, &mut rows, 0).unwrap();
        if r == 0 {
            assert_eq!(rows, [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]);
        }
        let mut back = [0f64; 2];
        comm.scatter(&rows, &mut back, 0).unwrap();
        assert_eq!(back, x);

        let mut packed = if r == 2 { vec![0i64; 3] } else { Vec::new() };
        comm.gatherv(&mine, &mut packed, &counts, 2).unwrap();
        if r == 2 {
            assert_eq!(packed, [1, 2, 2]);
        }
        let mut again = vec![0i64; r];
        comm.scatterv(&packed, &counts, &mut again, 2).unwrap();
        assert_eq!(again, mine);
    });
}

#[test]
fn split_by_color_and_key_and_topology_from_labels() {
    let name = format!("rs-split-{}", std::process::id());
    let out: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|r| {
                let name = name.clone();
                s.spawn(move || {
                    let opts = gradsync::CommOptions::new(&name, r, 4).timeout_ms(20000).host(if r % 2 == 0 { "a" } else { "b" });
                    let comm = Communicator::new(&opts).unwrap();
                    let topo = comm.topology().unwrap();
                    let sub = comm.split(Some(r % 2), -r).unwrap().expect("a color gives a subgroup");
                    let mut x = [(r + 1) as f32];
                    sub.allreduce_in_place(&mut x, ReduceOp::Sum).unwrap();
                    let none = comm.split(if r == 3 { None } else { Some(0) }, 0).unwrap();
                    drop(comm); // the subgroups outlive their parent
                    let mut y = [1f32];
                    sub.allreduce_in_place(&mut y, ReduceOp::Sum).unwrap();
                    (topo, sub.rank(), sub.size(), x[0], y[0], none.map(|c| c.size()), sub.topology().unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, (topo, sub_rank, sub_size, x, y, none, sub_topo)) in out.into_iter().enumerate() {
        assert_eq!(topo.rank_hosts, vec![0, 1, 0, 1]);
        assert_eq!((topo.host, topo.local_rank, topo.local_size, topo.num_hosts), (r as i32 % 2, r as i32 / 2, 2, 2));
        assert_eq!((sub_rank, sub_size), (if r < 2 { 1 } else { 0 }, 2));
        assert_eq!(x, if r % 2 == 0 { 4.0 } else { 6.0 });
        assert_eq!(y, 2.0);
        assert_eq!(none, if r == 3 { None } else { Some(3) });
        assert_eq!((sub_topo.num_hosts, sub_topo.local_size), (1, 2));
    }
}

#[test]
fn grow_by_a_joiner_thread() {
    let group = common::unique("grow");
    let join_name = format!("{}-join", group);
    let joiner = {
        let join_name = join_name.clone();
        std::thread::spawn(move || {
            let (comm, info) = Communicator::join(&CommOptions::new(&join_name, 0, 1).timeout_ms(60_000)).unwrap();
            assert_eq!((comm.rank(), comm.size(), comm.member_id().unwrap()), (2, 3, 2));
            let mut v = [comm.member_id().unwrap() as f64];
            comm.allreduce_in_place(&mut v, ReduceOp::Sum).unwrap();
            (info, v[0])
        })
    };
    let out = with_ranks(&group, 2, |comm| {
        let err = comm.grow(&join_name, 0).unwrap_err();
        assert_eq!(err.status, status::INVALID_ARG, "{}", err);
        let (grown, info) = comm.grow(&join_name, 1).unwrap();
        assert_eq!((grown.rank(), grown.size()), (comm.rank(), 3));
        assert_eq!(grown.member_id().unwrap(), comm.member_id().unwrap());
        let mut v = [grown.member_id().unwrap() as f64];
        grown.allreduce_in_place(&mut v, ReduceOp::Sum).unwrap();
        (info, v[0])
    });
    let (info, sum) = joiner.join().unwrap();
    assert_eq!((info.old_size, info.new_size, info.first_member_id), (2, 3, 2));
    assert_eq!(sum, 3.0);
    for (info, sum) in out {
        assert_eq!((info.old_size, info.new_size, info.first_member_id), (2, 3, 2));
        assert_eq!(sum, 3.0);
    }
}
