//! Processes: a pid that runs nothing, for the tests of what is judged by a pid, and a
//! directory that lives exactly as long as the test process.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// A pid that belonged to a process that has exited (until the system reuses it, which the
/// tests that take one must not depend on).
pub fn dead_pid() -> u32 {
    let mut child = std::process::Command::new("true")
        .spawn()
        .expect("start `true`");
    let pid = child.id();
    child.wait().expect("wait for `true`");
    pid
}

static PROCESS_DIR: OnceLock<PathBuf> = OnceLock::new();

extern "C" fn remove_process_dir() {
    if let Some(dir) = PROCESS_DIR.get() {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// A temporary directory shared by the tests of this process, removed when the process exits,
/// whether its tests pass or fail. It is for fixtures kept in a `static`: statics are never
/// dropped, so a `tempfile::TempDir` held in one is left behind by every test process.
pub fn process_dir() -> &'static Path {
    PROCESS_DIR.get_or_init(|| {
        let dir = tempfile::Builder::new()
            .prefix("dataset-rt-test-")
            .tempdir()
            .expect("create the test process's directory")
            .keep();
        // SAFETY: registers a plain function without arguments, which runs once at exit.
        let registered = unsafe { libc::atexit(remove_process_dir) };
        assert_eq!(
            registered,
            0,
            "atexit refused the removal of {}",
            dir.display()
        );
        dir
    })
}
