//! The runtime and the store are made again in a forked child: a child of a process that has
//! used them fetches through them without hanging.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dataset_rt_remote::{FetchPolicy, RangeFetcher, RangeRequest, Remote, RemoteOptions};

#[test]
fn a_forked_child_fetches_with_its_own_runtime() {
    let dir = tempfile::tempdir().unwrap();
    let object: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::create_dir_all(dir.path().join("train/shards")).unwrap();
    std::fs::write(dir.path().join("train/shards/000000.bin"), &object).unwrap();
    let url = format!("file://{}/train", dir.path().display());
    let remote = Remote::open(&url, &RemoteOptions::default()).unwrap();
    let fetcher = RangeFetcher::new(Arc::new(remote), FetchPolicy::default()).unwrap();
    let requests = vec![
        RangeRequest::new("shards/000000.bin", 10..5000),
        RangeRequest::new("shards/000000.bin", 90_000..99_000),
    ];
    // The parent's runtime is running (the local store reads on its blocking threads).
    let got = fetcher.fetch_blocking(&requests, None).unwrap();
    assert_eq!(got[0].as_ref(), &object[10..5000]);

    // SAFETY: the child only fetches and then leaves with `_exit`, running no test-harness code.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let ok = match fetcher.fetch_blocking(&requests, None) {
            Ok(got) => got[1].as_ref() == &object[90_000..99_000],
            Err(_) => false,
        };
        // SAFETY: leaves the child at once, without running the parent's destructors.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut status = 0;
    loop {
        // SAFETY: waits for our own child; `status` is a valid out-pointer.
        let done = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if done == pid {
            break;
        }
        if Instant::now() > deadline {
            // SAFETY: kills our own child, which hung.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("the forked child hung");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "status {status}"
    );
    // The parent's runtime still works.
    fetcher.fetch_blocking(&requests, None).unwrap();
}
