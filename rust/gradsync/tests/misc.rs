// SPDX-License-Identifier: Apache-2.0
//! Errors (status, message naming the C function, read on the failing thread), atomics, codecs,
//! data-parallel helpers, and the Send/Sync decisions.
use gradsync::{
    codec, partition, split_round_robin, status, weighted_merge, weighted_merge_f64, AbortHandle, Accumulator, Codec, Communicator, Counter,
    Counter32, Error, Flag, Mutex, ShardedParameter, Table,
};

#[test]
fn error_propagation_status_and_message_with_the_function_name() {
    let err = partition(10, 3, 5).unwrap_err();
    assert_eq!(err.status, status::OUT_OF_RANGE);
    assert!(err.message.contains("gradsync_partition"), "{}", err.message);
    assert!(err.message.contains("out of range"), "{}", err.message);
    assert!(err.status_string().starts_with("GRADSYNC_E_OUT_OF_RANGE"), "{}", err.status_string());
    let shown = err.to_string();
    assert!(shown.starts_with("GRADSYNC_E_OUT_OF_RANGE (-14): gradsync_partition"), "{}", shown);
    let boxed: Box<dyn std::error::Error + Send + Sync> = Box::new(err);
    assert!(boxed.to_string().contains("gradsync_partition"));

    assert_eq!(partition(10, 3, 1).unwrap(), (4, 3));
    assert_eq!(split_round_robin(10, 3, 0).unwrap(), vec![0, 3, 6, 9]);
    let err = split_round_robin(10, 0, 0).unwrap_err();
    assert_eq!(err.status, status::INVALID_ARG);
    assert!(err.message.contains("gradsync_split_round_robin"), "{}", err.message);
}

#[test]
fn each_thread_gets_the_message_of_its_own_failure() {
    // Many threads fail different calls at once; each error carries its own call's message.
    std::thread::scope(|s| {
        for k in 0..8u32 {
            s.spawn(move || {
                for _ in 0..200 {
                    let err: Error = if k % 2 == 0 {
                        partition(10, 3, 3 + k).unwrap_err()
                    } else {
                        Table::anonymous(0, 4).unwrap_err()
                    };
                    if k % 2 == 0 {
                        assert!(err.message.contains("gradsync_partition"), "{}", err.message);
                        assert!(err.message.contains(&format!("part {}", 3 + k)), "{}", err.message);
                    } else {
                        assert!(err.message.contains("gradsync_table_open"), "{}", err.message);
                    }
                    assert!(partition(10, 3, 0).is_ok()); // a success in between changes nothing
                }
            });
        }
    });
}

#[test]
fn counters_flags_and_mutexes_from_many_threads() {
    let counter = Counter::new(0).unwrap();
    let small = Counter32::new(i32::MAX).unwrap();
    let flag = Flag::new().unwrap();
    let mutex = Mutex::new().unwrap();
    let inside = std::sync::atomic::AtomicI32::new(0);
    std::thread::scope(|s| {
        for t in 0..4 {
            let (counter, flag, mutex, inside) = (&counter, &flag, &mutex, &inside);
            s.spawn(move || {
                for _ in 0..1000 {
                    counter.fetch_add(1).unwrap();
                }
                flag.conditional_set(t == 2).unwrap();
                for _ in 0..50 {
                    let _guard = mutex.lock().unwrap();
                    assert_eq!(inside.fetch_add(1, std::sync::atomic::Ordering::SeqCst), 0);
                    inside.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                }
            });
        }
    });
    assert_eq!(counter.load().unwrap(), 4000);
    assert_eq!(small.fetch_add(1).unwrap(), (i32::MAX, i32::MIN)); // wraps, defined
    assert!(flag.check().unwrap());
    flag.reset().unwrap();
    assert!(!flag.check().unwrap());
    counter.store(-5).unwrap();
    assert_eq!(counter.load().unwrap(), -5);

    let guard = mutex.lock().unwrap();
    let err = mutex.lock().unwrap_err(); // not recursive: the library refuses, no deadlock
    assert_eq!(err.status, status::MISUSE);
    assert!(err.message.contains("gradsync_mutex_lock"), "{}", err.message);
    std::thread::scope(|s| {
        s.spawn(|| assert!(mutex.try_lock().unwrap().is_none()));
    });
    drop(guard);
    assert!(mutex.try_lock().unwrap().is_some());
}

#[test]
fn codecs_and_weighted_merge() {
    let src = [1.0f32, -2.5, 0.1, 65504.0];
    let mut wire = [0u16; 4];
    codec::encode(Codec::Fp16, &src, &mut wire).unwrap();
    let mut back = [0f32; 4];
    codec::decode(Codec::Fp16, &wire, 0, &mut back).unwrap();
    assert_eq!(back[..2], [1.0, -2.5]);
    assert!((back[2] - 0.1).abs() < 1e-4);
    let mut sum = [1.0f32; 4];
    codec::accumulate(Codec::Fp16, &mut sum, 0, &wire).unwrap();
    assert_eq!(sum[..2], [2.0, -1.5]);
    let err = codec::encode(Codec::Bf16, &src, &mut [0u16; 3]).unwrap_err();
    assert_eq!(err.status, status::BUFS);
    assert!(err.message.contains("gradsync_codec_encode"), "{}", err.message);

    let mut out = [0f32; 2];
    let merged = weighted_merge(&[&[1.0, 2.0], &[4.0, 8.0]], &[1, 3], Some(&[1.0, 2.0]), &mut out).unwrap();
    assert_eq!(out, [3.25, 6.5]);
    assert_eq!(merged.total_count, 4);
    assert_eq!(merged.mean_loss, Some(1.75));
    // f64: counts near 2^33, where f32 rounds the mean to 2.0
    let mut wide = [0f64];
    let big = 1u64 << 33;
    let m = weighted_merge_f64(&[&[2.0], &[3.0]], &[big, 1], None, &mut wide).unwrap();
    assert_eq!(m.total_count, big + 1);
    let exact = 2.0 + 1.0 / (big as f64 + 1.0);
    assert!((wide[0] - exact).abs() <= 1e-12 * exact && wide[0] != 2.0, "{}", wide[0]);
    let err = weighted_merge(&[&[1.0], &[1.0]], &[0, 0], None, &mut [0.0]).unwrap_err();
    assert_eq!(err.status, status::ZERO_WEIGHT);
}

#[test]
fn library_version_and_features() {
    assert_eq!(gradsync::abi_version(), gradsync::sys::GRADSYNC_ABI_VERSION);
    assert!(!gradsync::version().is_empty());
    assert!(gradsync::has_feature(gradsync::Feature::ThreadTransport));
    assert_eq!(gradsync::DType::I64.size(), 8);
    assert_eq!(gradsync::set_log_level(9).unwrap_err().status, status::INVALID_ARG);
}

// The Send/Sync decisions, checked at compile time (the negative ones are compile_fail doctests).
fn send<T: Send>() {}
fn sync<T: Sync>() {}

#[test]
fn send_and_sync_follow_the_headers() {
    send::<Communicator>();
    send::<AbortHandle<'static>>();
    sync::<AbortHandle<'static>>();
    send::<Table>();
    sync::<Table>();
    send::<Accumulator>();
    sync::<Accumulator>();
    send::<ShardedParameter>();
    send::<Counter>();
    sync::<Counter>();
    send::<Counter32>();
    sync::<Counter32>();
    send::<Flag>();
    sync::<Flag>();
    send::<Mutex>();
    sync::<Mutex>();
    send::<Error>();
    sync::<Error>();
}
