//! The writer when the pool cannot run its work, and the removal of dead writers' leftovers:
//! every failure is an error that returns, never a hang, and leaves nothing behind.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use dataset_rt_core::format::Compression;
use dataset_rt_core::metadata::MetaValue;
use dataset_rt_core::pool::Pool;
use dataset_rt_core::writer::{
    reap_dead_leftovers, CacheLock, CacheWriter, SampleInput, WriterOptions,
};
use dataset_rt_core::Error;

fn options() -> WriterOptions {
    WriterOptions {
        prefetch_size: 4,
        compression: Compression::NONE,
        validate: false,
        shard_size: 1 << 20,
    }
}

fn sample(i: i64) -> SampleInput {
    SampleInput {
        data: i.to_le_bytes().to_vec(),
        metadata: vec![("i".into(), MetaValue::Int(i))],
    }
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

fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
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
    assert_eq!(entries(dir.path()), [".c.lock"]);
}

#[test]
fn a_pool_closed_mid_write_fails_the_write_without_hanging_or_leftovers() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().to_owned();
    let (push_err, finish_err) = within_a_minute("writing with a closed pool", move || {
        let pool = Pool::new(2).unwrap();
        let lock = CacheLock::acquire(&base, "c").unwrap();
        let mut writer = CacheWriter::create(pool.clone(), lock, options()).unwrap();
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
    assert_eq!(entries(dir.path()), [".c.lock"]);
}

#[test]
fn dropping_a_writer_whose_batch_was_refused_returns_and_cleans_up() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().to_owned();
    within_a_minute("dropping the writer", move || {
        let pool = Pool::new(1).unwrap();
        let lock = CacheLock::acquire(&base, "c").unwrap();
        let mut writer = CacheWriter::create(pool.clone(), lock, options()).unwrap();
        pool.close();
        assert!((0..8).any(|i| writer.push(sample(i)).is_err()));
        drop(writer);
    });
    assert_eq!(entries(dir.path()), [".c.lock"]);
}

/// A pid that belonged to a process that has exited.
fn dead_pid() -> u32 {
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    pid
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
    let lock = CacheLock::acquire(base, "c").unwrap();
    let mut writer = CacheWriter::create(pool, lock, options()).unwrap();
    writer.push(sample(0)).unwrap();
    writer.finish().unwrap();
    assert!(!stale.exists());
    assert!(other_name.exists());
}
