//! Leftovers in /dev/shm are judged by their owner's lock, never by the pid in their name: a
//! pid may be reused, and means nothing across PID namespaces that share /dev/shm.

use std::path::PathBuf;

use dataset_rt_loader::lifecycle::{self, reap_leftovers};
use dataset_rt_shm::layout::POLICY_PAD;
use dataset_rt_shm::ring::{Geometry, Pass, Ring};
use dataset_rt_shm::segment::path_of;
use dataset_rt_testkit::dead_pid;

fn create_ring(owner_pid: u64) -> Ring {
    let pass = Pass {
        total_batches: 1,
        batch_size: 1,
        rank_samples: 1,
        epoch: 0,
        start: 0,
        epoch_len: 1,
        rank: 0,
        world_size: 1,
        policy: POLICY_PAD,
        expected_attach: 1,
    };
    let geometry = Geometry {
        num_slots: 2,
        slot_size: 4096,
        max_consumers: 1,
    };
    lifecycle::create_ring(owner_pid, geometry, pass).unwrap()
}

fn names_of(ring: &Ring) -> Vec<String> {
    let dir = lifecycle::private_dir(ring);
    let dir = dir.file_name().unwrap().to_str().unwrap();
    vec![
        ring.ctl_name().to_owned(),
        ring.ring_name().to_owned(),
        dir.to_owned(),
    ]
}

fn exists(name: &str) -> bool {
    path_of(name).symlink_metadata().is_ok()
}

/// A reaper removes every leftover in /dev/shm, its neighbours' included: the two cases run one
/// after the other, or each could reap the other's entries first.
#[test]
fn leftovers_are_judged_by_their_owners_lock() {
    a_live_owners_entries_are_kept_even_when_its_pid_looks_dead();
    an_entry_whose_lock_is_free_is_reaped_unless_its_pid_runs_here();
}

fn a_live_owners_entries_are_kept_even_when_its_pid_looks_dead() {
    // The owner (this process) holds the lock of every entry; the pid in the names is dead,
    // as it would look from another PID namespace.
    let ring = create_ring(u64::from(dead_pid()));
    let names = names_of(&ring);
    std::fs::write(lifecycle::private_dir(&ring).join("spec.json"), b"{}").unwrap();
    assert!(names.iter().all(|n| exists(n)), "{names:?}");
    let removed = reap_leftovers();
    assert!(
        names.iter().all(|n| exists(n) && !removed.contains(n)),
        "a live owner's entries were reaped: {removed:?}"
    );

    // The owner is gone (its locks went with it; the names were never removed): reaped.
    drop(ring);
    let removed = reap_leftovers();
    for name in &names {
        assert!(!exists(name) && removed.contains(name), "{name} stays");
    }
}

fn an_entry_whose_lock_is_free_is_reaped_unless_its_pid_runs_here() {
    // Nobody holds a lock on these, and their pid is dead: leftovers.
    let stem = format!("dataset-rt-{}-0badc0ffee{}", dead_pid(), std::process::id());
    let file = format!("{stem}-ctl");
    let dir = format!("{stem}-spec");
    std::fs::write(path_of(&file), b"x").unwrap();
    std::fs::create_dir(path_of(&dir)).unwrap();
    std::fs::write(path_of(&dir).join("spec.json"), b"{}").unwrap();
    // Unlocked but under a running pid (an older DatasetRT holds no lock): kept. Neither is a
    // symbolic link under a dead pid's name, nor a name that is not DatasetRT's, touched.
    let running = format!("dataset-rt-{}-0badc0ffee-ring", std::process::id());
    std::fs::write(path_of(&running), b"x").unwrap();
    let other = PathBuf::from(format!("/dev/shm/not-dataset-rt-{}", std::process::id()));
    std::fs::write(&other, b"x").unwrap();
    let link = format!("{stem}-link");
    std::os::unix::fs::symlink(&other, path_of(&link)).unwrap();

    let removed = reap_leftovers();
    let kept = (exists(&running), exists(&link), other.exists());
    for path in [path_of(&running), path_of(&link), other] {
        let _ = std::fs::remove_file(path);
    }
    assert!(
        removed.contains(&file) && removed.contains(&dir),
        "{removed:?}"
    );
    assert!(!exists(&file) && !exists(&dir));
    assert_eq!(kept, (true, true, true), "removed: {removed:?}");
}
