//! Processes, for the tests of what is judged by a pid.

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
