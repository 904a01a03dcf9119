//! What the fuzz targets share: the panic policy, a scratch directory, small valid caches to
//! start from and their damage (re-signing after it is `dataset_rt_testkit`'s, as in the Rust
//! tests), and reading everything an opened cache offers.

use std::cell::RefCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::Once;

pub mod exercise;
pub mod forge;

thread_local! {
    static LAST_PANIC: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Runs the body of one fuzz input. A panic that escapes it is a finding: the message is
/// printed and the process aborts, so libFuzzer keeps the input. A panic that the project
/// catches itself (a `catch_unwind` in the core, the pool's workers) is not one: libfuzzer-sys's
/// hook, which aborts on every panic, is replaced by a quiet one.
///
/// `DRT_FUZZ_TOLERATE` (comma-separated substrings of the panic message and location) lets a
/// run go on past panics that are already known and being fixed; unset, every escaped panic is
/// a finding.
pub fn guarded(body: impl FnOnce()) {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        std::panic::set_hook(Box::new(|info| {
            let message = format!("{info}");
            LAST_PANIC.with(|p| *p.borrow_mut() = Some(message));
        }))
    });
    if catch_unwind(AssertUnwindSafe(body)).is_ok() {
        return;
    }
    let message = LAST_PANIC
        .with(|p| p.borrow_mut().take())
        .unwrap_or_else(|| "a panic without a message".into());
    let tolerated = std::env::var("DRT_FUZZ_TOLERATE").unwrap_or_default();
    if tolerated
        .split(',')
        .any(|t| !t.is_empty() && message.contains(t))
    {
        eprintln!("dataset-rt fuzz: tolerated a known panic: {message}");
        return;
    }
    eprintln!("dataset-rt fuzz: a panic escaped: {message}");
    std::process::abort();
}

/// This process's scratch directory: `$DRT_FUZZ_SCRATCH`, else the temporary directory, in a
/// subdirectory named after the pid (libFuzzer's `-fork`/`-jobs` run several processes).
pub fn scratch() -> &'static Path {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let base = std::env::var_os("DRT_FUZZ_SCRATCH")
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        let dir = base.join(format!("drt-fuzz-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the fuzz scratch directory");
        dir
    })
}
