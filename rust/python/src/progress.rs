//! A progress sink over Python's `sys.stderr`, so progress lands wherever Python's stderr goes
//! (a terminal, a log, pytest's capture). Off a terminal, cursor moves are dropped and every
//! redraw becomes one plain line.

use std::io;

use dataset_rt_core::progress::{ProgressSink, TermLike};
use pyo3::prelude::*;

/// Columns assumed when a terminal does not report its size.
const FALLBACK_COLUMNS: u16 = 80;

#[derive(Debug)]
pub struct PyStderr {
    tty: bool,
    columns: u16,
}

impl PyStderr {
    pub fn new(py: Python<'_>) -> Self {
        let tty = stderr(py)
            .and_then(|s| s.call_method0("isatty"))
            .and_then(|v| v.extract::<bool>())
            .unwrap_or(false);
        let columns = if tty { terminal_columns(py) } else { None };
        PyStderr {
            tty,
            columns: columns.unwrap_or(FALLBACK_COLUMNS),
        }
    }

    fn write(&self, s: &str) -> io::Result<()> {
        Python::attach(|py| {
            stderr(py)?.call_method1("write", (s,))?;
            Ok::<_, PyErr>(())
        })
        .map_err(io::Error::other)
    }
}

fn stderr(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    py.import("sys")?.getattr("stderr")
}

/// The width of the terminal behind stderr; `COLUMNS` wins, as in `shutil.get_terminal_size`
/// (which asks stdout's terminal, not stderr's).
fn terminal_columns(py: Python<'_>) -> Option<u16> {
    let from_env = std::env::var("COLUMNS")
        .ok()
        .and_then(|c| c.trim().parse::<u16>().ok())
        .filter(|&c| c > 0);
    if from_env.is_some() {
        return from_env;
    }
    let fd = stderr(py).ok()?.call_method0("fileno").ok()?;
    let size = py
        .import("os")
        .ok()?
        .call_method1("get_terminal_size", (fd,))
        .ok()?;
    let columns: i64 = size.getattr("columns").ok()?.extract().ok()?;
    u16::try_from(columns).ok().filter(|&c| c > 0)
}

impl ProgressSink for PyStderr {
    fn is_terminal(&self) -> bool {
        self.tty
    }
}

impl TermLike for PyStderr {
    fn width(&self) -> u16 {
        // One column short of the edge: indicatif pads the line to this width, and a line that
        // filled the last column would leave the cursor waiting to wrap.
        self.columns.saturating_sub(1).max(1)
    }
    fn move_cursor_up(&self, n: usize) -> io::Result<()> {
        if self.tty && n > 0 {
            self.write(&format!("\x1b[{n}A"))?;
        }
        Ok(())
    }
    fn move_cursor_down(&self, n: usize) -> io::Result<()> {
        if self.tty && n > 0 {
            self.write(&format!("\x1b[{n}B"))?;
        }
        Ok(())
    }
    fn move_cursor_right(&self, n: usize) -> io::Result<()> {
        if self.tty && n > 0 {
            self.write(&format!("\x1b[{n}C"))?;
        }
        Ok(())
    }
    fn move_cursor_left(&self, n: usize) -> io::Result<()> {
        if self.tty && n > 0 {
            self.write(&format!("\x1b[{n}D"))?;
        }
        Ok(())
    }
    fn write_line(&self, s: &str) -> io::Result<()> {
        self.write_str(s)?;
        if self.tty {
            self.write("\n")?;
        }
        Ok(())
    }
    fn write_str(&self, s: &str) -> io::Result<()> {
        if self.tty {
            return self.write(s);
        }
        // A log gets each redraw as one line, without the padding meant for a terminal.
        let line = s.trim_end();
        if line.is_empty() {
            return Ok(());
        }
        self.write(&format!("{line}\n"))
    }
    fn clear_line(&self) -> io::Result<()> {
        if self.tty {
            self.write("\r\x1b[2K")?;
        }
        Ok(())
    }
    fn flush(&self) -> io::Result<()> {
        Python::attach(|py| {
            stderr(py)?.call_method0("flush")?;
            Ok::<_, PyErr>(())
        })
        .map_err(io::Error::other)
    }
}
