//! The writer when the pool cannot run its work, when a commit fails, when it is interrupted,
//! when its lock file was planted, and the removal of dead writers' leftovers: every failure is
//! an error that returns, never a hang, and leaves nothing behind.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use dataset_rt_core::pool::Pool;
use dataset_rt_core::writer::{
    reap_dead_leftovers, validate_name, CacheLock, CacheWriter, Claim, InterruptCheck, SampleInput,
    WriterOptions, MAX_NAME_BYTES,
};
use dataset_rt_core::Error;
use dataset_rt_testkit::{cache_writer, dead_pid, dir_entries, numbered, write_cache, CacheFiles};

fn options() -> WriterOptions {
    WriterOptions {
        validate: false,
        ..dataset_rt_testkit::writer_options()
    }
}

fn sample(i: u64) -> SampleInput {
    numbered(i, i.to_le_bytes().to_vec())
}

/// Runs `f` on its own thread and fails the test if it does not return within a minute.
fn within_a_minute<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("{what} hung"))
}

#[test]
fn a_closed_pool_fails_create_before_any_directory_is_made() {
    let dir = tempfile::tempdir().unwrap();
    let pool = Pool::new(1).unwrap();
    pool.close();
    let lock = CacheLock::acquire(dir.path(), "c").unwrap();
    let err = CacheWriter::create(pool, lock, options())
        .err()
        .expect("a closed pool cannot write");
    assert!(matches!(err, Error::Runtime(_)), "{err:?}");
    assert!(err.to_string().contains("closed"), "{err}");
    assert_eq!(dir_entries(dir.path()), [".c.lock"]);
}

#[test]
fn a_pool_closed_mid_write_fails_the_write_without_hanging_or_leftovers() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().to_owned();
    let (push_err, finish_err) = within_a_minute("writing with a closed pool", move || {
        let pool = Pool::new(2).unwrap();
        let mut writer = cache_writer(&pool, &base, "c", options());
        for i in 0..8 {
            writer.push(sample(i)).unwrap();
        }
        pool.close();
        // The next full batch cannot be submitted: the push fails ...
        let push_err = (8..16)
            .find_map(|i| writer.push(sample(i)).err())
            .expect("a push after close fails");
        // ... and so does finishing, without waiting for the batch that never ran.
        let finish_err = writer.finish().err().expect("nothing is published");
        (push_err.to_string(), finish_err.to_string())
    });
    assert!(push_err.contains("closed"), "{push_err}");
    assert!(finish_err.contains("closed"), "{finish_err}");
    // Dropping the failed writer removed its temporary directory.
    assert_eq!(dir_entries(dir.path()), [".c.lock"]);
}

#[test]
fn dropping_a_writer_whose_batch_was_refused_returns_and_cleans_up() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().to_owned();
    within_a_minute("dropping the writer", move || {
        let pool = Pool::new(1).unwrap();
        let mut writer = cache_writer(&pool, &base, "c", options());
        pool.close();
        assert!((0..8).any(|i| writer.push(sample(i)).is_err()));
        drop(writer);
    });
    assert_eq!(dir_entries(dir.path()), [".c.lock"]);
}

fn leftover(base: &Path, name: &str, pid: u32, nanos: u64) -> PathBuf {
    let dir = base.join(format!(".{name}.tmp-{pid}-{nanos}"));
    std::fs::create_dir_all(dir.join("shards")).unwrap();
    std::fs::write(dir.join("shards").join("000000.bin"), b"half a shard").unwrap();
    dir
}

#[test]
fn reaping_waits_for_the_lock_of_the_name_whatever_the_pids_say() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path();
    let dead = dead_pid();
    // A live writer of "c" holds its lock; its directory's pid looks dead (reused, or another
    // PID namespace), and so may an older one's. Nothing of "c" may go while the lock is held.
    let writer = CacheLock::acquire(base, "c").unwrap();
    let live = leftover(base, "c", dead, 1);
    let foreign = leftover(base, "c", 1, 2);
    assert_eq!(reap_dead_leftovers(base, "c"), 0);
    assert!(live.exists() && foreign.exists());
    drop(writer);

    // Nobody holds the lock: every directory of "c" is a leftover, whatever its pid (this
    // process's included); other names, and names that only look alike, stay.
    let ours = leftover(base, "c", std::process::id(), 3);
    let other_name = leftover(base, "c2", dead, 4);
    let not_a_leftover = base.join(format!(".c.tmp-{dead}-x"));
    std::fs::create_dir(&not_a_leftover).unwrap();
    assert_eq!(reap_dead_leftovers(base, "c"), 3);
    for gone in [&live, &foreign, &ours] {
        assert!(!gone.exists(), "{}", gone.display());
    }
    assert!(not_a_leftover.exists() && other_name.exists());
    // "c2" has no lock file: whether a writer of it lives is unknown, so nothing goes (the next
    // writer of "c2" removes its leftovers under the lock).
    assert_eq!(reap_dead_leftovers(base, "c2"), 0);
    assert!(other_name.exists());
    // Nothing to list is nothing to reap, not an error.
    assert_eq!(reap_dead_leftovers(&base.join("absent"), "c"), 0);
}

#[test]
fn a_new_writer_removes_every_leftover_of_its_name_under_the_lock() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path();
    let stale = leftover(base, "c", dead_pid(), 1);
    let other_name = leftover(base, "c2", dead_pid(), 1);
    let pool = Pool::new(1).unwrap();
    write_cache(&pool, base, "c", options(), [sample(0)]);
    assert!(!stale.exists());
    assert!(other_name.exists());
}

fn tmp_dir_of(base: &Path) -> PathBuf {
    let tmp: Vec<PathBuf> = std::fs::read_dir(base)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().contains(".tmp-"))
        .collect();
    assert_eq!(tmp.len(), 1, "{tmp:?}");
    tmp.into_iter().next().unwrap()
}

/// A commit fails (as on a full disk) and a later batch was already handed over when `finish`
/// returns the error: dropping the writer must not wait for commits that never come.
#[test]
fn a_failed_commit_with_a_later_batch_pending_ends_and_cleans_up() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().to_owned();
    let finish_err = within_a_minute("a write whose commit failed", move || {
        // One worker: a job submitted after another runs after it, so the order is fixed.
        let pool = Pool::new(1).unwrap();
        let barrier = |pool: &std::sync::Arc<Pool>| pool.run(|| Ok(())).unwrap();
        let mut writer = cache_writer(&pool, &base, "c", options());
        // The first shard cannot be created: the first commit fails.
        std::fs::remove_dir(tmp_dir_of(&base).join("shards")).unwrap();
        for i in 0..4 {
            let _ = writer.push(sample(i)); // batch 0 (prefetch_size 4)
        }
        barrier(&pool); // batch 0 failed to commit
        for i in 4..8 {
            let _ = writer.push(sample(i)); // batch 1: handed over, never committed
        }
        barrier(&pool);
        writer
            .finish()
            .err()
            .expect("nothing is published")
            .to_string()
    });
    assert!(finish_err.contains("shards"), "{finish_err}");
    assert_eq!(dir_entries(dir.path()), [".c.lock"]);
}

/// An interrupt check that starts failing once `flag` is set.
fn interrupt_when(flag: &Arc<AtomicBool>) -> InterruptCheck {
    let flag = flag.clone();
    Arc::new(move || {
        if flag.load(Ordering::SeqCst) {
            Err(Error::Interrupted("test interrupt".into()))
        } else {
            Ok(())
        }
    })
}

/// Occupies the pool's only worker until the returned sender is dropped or sent to.
fn block_pool(pool: &Arc<Pool>) -> mpsc::Sender<()> {
    let (tx, rx) = mpsc::channel::<()>();
    pool.submit(move || {
        let _ = rx.recv();
        Ok(())
    })
    .unwrap();
    tx
}

fn interrupt_soon(flag: &Arc<AtomicBool>) {
    let flag = flag.clone();
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        flag.store(true, Ordering::SeqCst);
    });
}

#[test]
fn an_interrupt_stops_a_push_waiting_for_commits_and_the_next_write_works() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().to_owned();
    let flag = Arc::new(AtomicBool::new(false));
    let check = interrupt_when(&flag);
    let err = within_a_minute("an interrupted push", move || {
        let pool = Pool::new(1).unwrap();
        let unblock = block_pool(&pool);
        let opts = WriterOptions {
            prefetch_size: 1,
            ..options()
        };
        let mut writer = cache_writer(&pool, &base, "c", opts);
        writer.set_interrupt(check);
        interrupt_soon(&flag);
        // Nothing commits while the worker is busy: the second push waits for room.
        let err = (0..4)
            .find_map(|i| writer.push(sample(i)).err())
            .expect("the interrupt stops the push");
        drop(unblock);
        drop(writer);
        // The lock is free and the next write of the name works.
        write_cache(&pool, &base, "c", options(), [sample(0)]);
        err
    });
    assert!(matches!(err, Error::Interrupted(_)), "{err:?}");
    assert_eq!(dir_entries(dir.path()), [".c.lock", "c"]);
}

#[test]
fn an_interrupt_stops_finish_waiting_for_commits_and_publishes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().to_owned();
    let flag = Arc::new(AtomicBool::new(false));
    let check = interrupt_when(&flag);
    let err = within_a_minute("an interrupted finish", move || {
        let pool = Pool::new(1).unwrap();
        let unblock = block_pool(&pool);
        let mut writer = cache_writer(&pool, &base, "c", options());
        writer.set_interrupt(check);
        writer.push(sample(0)).unwrap();
        interrupt_soon(&flag);
        let err = writer.finish().err().expect("the interrupt stops finish");
        drop(unblock);
        err
    });
    assert!(matches!(err, Error::Interrupted(_)), "{err:?}");
    assert_eq!(dir_entries(dir.path()), [".c.lock"]);
}

#[test]
fn an_interrupt_stops_waiting_for_a_lock_another_writer_holds() {
    let dir = tempfile::tempdir().unwrap();
    let held = CacheLock::acquire(dir.path(), "c").unwrap();
    let base = dir.path().to_owned();
    let flag = Arc::new(AtomicBool::new(false));
    let check = interrupt_when(&flag);
    interrupt_soon(&flag);
    let err = within_a_minute("an interrupted lock wait", move || {
        CacheLock::acquire_interruptible(&base, "c", &*check)
            .err()
            .expect("the lock is held elsewhere")
    });
    assert!(matches!(err, Error::Interrupted(_)), "{err:?}");
    drop(held);
    CacheLock::acquire(dir.path(), "c").unwrap();
}

#[test]
fn a_claim_writes_what_is_not_published_and_loads_what_is() {
    let dir = tempfile::tempdir().unwrap();
    let never = || -> dataset_rt_core::Result<()> { panic!("no other writer holds the lock") };
    match CacheLock::claim(dir.path(), "c", &never).unwrap() {
        Claim::Write(lock) => assert_eq!(lock.final_dir(), dir.path().join("c")),
        _ => panic!("nothing is published, so the claim is to write"),
    }
    write_cache(
        &Pool::new(1).unwrap(),
        dir.path(),
        "c",
        options(),
        [sample(0)],
    );
    match CacheLock::claim(dir.path(), "c", &never).unwrap() {
        Claim::Published(found) => assert_eq!(found, dir.path().join("c")),
        _ => panic!("the cache is published, so the claim is to load it"),
    }
    let err = CacheLock::claim(dir.path(), "../c", &never)
        .err()
        .expect("an invalid name");
    assert!(err.to_string().contains("../c"), "{err}");
}

#[test]
fn a_cache_published_while_a_claim_waits_for_the_lock_is_loaded_not_written_again() {
    let dir = tempfile::tempdir().unwrap();
    let held = CacheLock::acquire(dir.path(), "c").unwrap();
    let base = dir.path().to_owned();
    let (waiting, waits) = mpsc::channel();
    let claim = std::thread::spawn(move || {
        let asked = AtomicBool::new(false);
        let interrupt = || {
            if !asked.swap(true, Ordering::SeqCst) {
                waiting.send(()).unwrap();
            }
            Ok(())
        };
        CacheLock::claim(&base, "c", &interrupt).unwrap()
    });
    waits
        .recv_timeout(Duration::from_secs(60))
        .expect("the claim waits for the held lock");
    std::fs::create_dir(dir.path().join("c")).unwrap();
    drop(held);
    match claim.join().unwrap() {
        Claim::Published(found) => assert_eq!(found, dir.path().join("c")),
        _ => panic!("the other writer published it, so the claim is to load it"),
    }
}

#[test]
fn a_claim_whose_lock_cannot_be_taken_is_refused_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let held = CacheLock::acquire(dir.path(), "c").unwrap();
    let stop = || Err(Error::Interrupted("stop".into()));
    match CacheLock::claim(dir.path(), "c", &stop).unwrap() {
        Claim::Refused(Error::Interrupted(_)) => {}
        _ => panic!("the interrupt said stop while another writer held the lock"),
    }
    drop(held);
    // Under a regular file, whether "c" is published cannot be told: an error.
    let file = dir.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    let err = CacheLock::claim(&file, "c", &stop)
        .err()
        .expect("a file is no base");
    assert!(err.to_string().contains(&*file.to_string_lossy()), "{err}");
}

#[test]
fn a_symlink_planted_as_the_lock_file_is_refused_and_nothing_outside_is_created() {
    let dir = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let base = dir.path().join("base");
    std::fs::create_dir(&base).unwrap();
    let target = outside.path().join("created-by-the-writer");
    std::os::unix::fs::symlink(&target, base.join(".c.lock")).unwrap();
    let err = CacheLock::acquire(&base, "c").err().expect("refused");
    let msg = err.to_string();
    assert!(msg.contains("symbolic link"), "{msg}");
    assert!(
        msg.contains(&*base.join(".c.lock").to_string_lossy()),
        "{msg}"
    );
    assert!(!target.exists());
    assert_eq!(dir_entries(outside.path()), Vec::<String>::new());
}

#[test]
fn a_fifo_planted_as_the_lock_file_is_refused_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join(".c.lock");
    let c_path = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid, NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o644) }, 0);
    let base = dir.path().to_owned();
    let msg = within_a_minute("opening a FIFO lock", move || {
        CacheLock::acquire(&base, "c")
            .err()
            .expect("refused")
            .to_string()
    });
    assert!(msg.contains("not a regular file"), "{msg}");
}

#[test]
fn the_lock_file_is_created_with_mode_0644() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let _lock = CacheLock::acquire(dir.path(), "c").unwrap();
    let mode = std::fs::metadata(dir.path().join(".c.lock"))
        .unwrap()
        .permissions()
        .mode();
    // The umask may take bits away, never add them.
    assert_eq!(mode & !0o644 & 0o777, 0, "{mode:o}");
}

#[test]
fn a_base_directory_that_is_a_file_gets_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    for base in [file.clone(), file.join("below")] {
        let err = CacheLock::acquire(&base, "c").err().expect("refused");
        let msg = err.to_string();
        assert!(matches!(err, Error::InvalidConfig { .. }), "{err:?}");
        assert!(msg.contains("is not a directory"), "{msg}");
        assert!(msg.contains(&*file.to_string_lossy()), "{msg}");
    }
}

#[test]
fn a_slow_sources_samples_are_committed_within_a_second_and_written_as_a_fast_ones() {
    let dir = tempfile::tempdir().unwrap();
    let pool = Pool::new(1).unwrap();
    let opts = WriterOptions {
        prefetch_size: 64,
        ..options()
    };
    let mut writer = cache_writer(&pool, &dir.path().join("slow"), "c", opts);
    writer.push(sample(0)).unwrap();
    std::thread::sleep(Duration::from_millis(600));
    // Far fewer samples than a batch holds, but the first has waited long enough.
    writer.push(sample(1)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while writer.progress().0 < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(writer.progress().0, 2, "committed before the batch is full");
    for i in 2..10 {
        writer.push(sample(i)).unwrap();
    }
    let slow = writer.finish().unwrap().dir;
    let fast = write_cache(
        &pool,
        &dir.path().join("fast"),
        "c",
        opts,
        (0..10).map(sample),
    );
    assert!(
        CacheFiles::read(&slow) == CacheFiles::read(&fast),
        "the same bytes, wherever batches ended"
    );
}

#[test]
fn a_refused_name_says_which_rule_it_breaks() {
    for (name, why) in [
        ("", "it is empty"),
        (".hidden", "it starts with '.'"),
        ("..", "it starts with '.'"),
        ("a/b", "it contains '/'"),
        ("a\\b", "it contains a backslash"),
        ("a\0b", "it contains a NUL byte"),
    ] {
        let err = validate_name(name).expect_err(name).to_string();
        assert!(err.contains(why), "{name:?}: {err}");
        assert!(err.contains(&format!("{name:?}")), "{name:?}: {err}");
    }
    validate_name("a.b-c_d e").unwrap();
}

#[test]
fn names_are_limited_so_the_temporary_directory_name_fits() {
    let dir = tempfile::tempdir().unwrap();
    let longest = "n".repeat(MAX_NAME_BYTES);
    let pool = Pool::new(1).unwrap();
    write_cache(&pool, dir.path(), &longest, options(), [sample(0)]);
    assert!(dir.path().join(&longest).is_dir());

    for len in [MAX_NAME_BYTES + 1, 226, 255] {
        let name = "n".repeat(len);
        let err = validate_name(&name).expect_err("too long");
        assert!(matches!(err, Error::InvalidConfig { .. }), "{err:?}");
        assert!(
            err.to_string()
                .contains(&format!("at most {MAX_NAME_BYTES} bytes")),
            "{err}"
        );
    }
}
