//! Write progress: committed samples/s and MB/s of the active source, and for several sources
//! which one of how many and the ETA over the remaining sources. Drawn by indicatif onto a
//! [`ProgressSink`] (the bindings pass Python's `sys.stderr`), never from a thread of its own.
//!
//! On a terminal a source's line is redrawn in place, fits the terminal's width and ends with a
//! newline once the source is finished. Anywhere else (a log file, a pipe, a test's capture)
//! each redraw is one plain line, at most one per second, and the finished line is the last.

use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use indicatif::TermLike;
use indicatif::{
    DecimalBytes, HumanCount, HumanDuration, ProgressBar, ProgressDrawTarget, ProgressStyle,
};

/// Redraws per second on a terminal.
const REFRESH_HZ: u8 = 2;
/// How often a terminal's line takes new figures: paced here, as indicatif's rate limiter allows
/// bursts, so that it is redrawn at most twice a second.
const UPDATE_EVERY: Duration = Duration::from_millis(1000 / REFRESH_HZ as u64);
/// How often a log gets a line: indicatif's rate limiter allows bursts, so logs are paced here.
const LOG_EVERY: Duration = Duration::from_secs(1);

/// Where progress lines go: indicatif's [`TermLike`] plus whether it is a terminal.
pub trait ProgressSink: TermLike {
    /// A terminal redraws the line in place; anything else gets plain lines.
    fn is_terminal(&self) -> bool;
}

/// The draw target indicatif owns: the same sink that [`SourceProgress`] keeps for its newline.
#[derive(Debug)]
struct SharedSink(Arc<dyn ProgressSink>);

impl TermLike for SharedSink {
    fn width(&self) -> u16 {
        self.0.width()
    }
    fn height(&self) -> u16 {
        self.0.height()
    }
    fn move_cursor_up(&self, n: usize) -> io::Result<()> {
        self.0.move_cursor_up(n)
    }
    fn move_cursor_down(&self, n: usize) -> io::Result<()> {
        self.0.move_cursor_down(n)
    }
    fn move_cursor_right(&self, n: usize) -> io::Result<()> {
        self.0.move_cursor_right(n)
    }
    fn move_cursor_left(&self, n: usize) -> io::Result<()> {
        self.0.move_cursor_left(n)
    }
    fn write_line(&self, s: &str) -> io::Result<()> {
        self.0.write_line(s)
    }
    fn write_str(&self, s: &str) -> io::Result<()> {
        self.0.write_str(s)
    }
    fn clear_line(&self) -> io::Result<()> {
        self.0.clear_line()
    }
    fn flush(&self) -> io::Result<()> {
        self.0.flush()
    }
}

/// Progress over all the sources of one `from_cache_sources` call.
pub struct WriteProgress {
    source_count: usize,
    started: Instant,
    writes_done: u32,
    write_time: Duration,
}

impl WriteProgress {
    pub fn new(source_count: usize) -> Self {
        WriteProgress {
            source_count,
            started: Instant::now(),
            writes_done: 0,
            write_time: Duration::ZERO,
        }
    }

    /// Starts the line of source `index` (0-based).
    pub fn source(
        &mut self,
        sink: Arc<dyn ProgressSink>,
        index: usize,
        name: &str,
    ) -> SourceProgress {
        // Styled while hidden, so the first line drawn is already complete. On a terminal,
        // `wide_msg` cuts the running figures to its width, so the line never wraps and is
        // redrawn in place.
        let terminal = sink.is_terminal();
        let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::hidden());
        bar.set_style(if terminal {
            running_style()
        } else {
            whole_style()
        });
        let prefix = if self.source_count > 1 {
            format!("[{}/{}] {name}: ", index + 1, self.source_count)
        } else {
            format!("{name}: ")
        };
        bar.set_prefix(prefix);
        // ETA over whole sources: the mean time of the sources written so far.
        let remaining = (self.source_count - index) as u32;
        let eta = match (self.source_count > 1, self.writes_done) {
            (false, _) => Eta::SingleSource,
            (true, 0) => Eta::Unknown,
            (true, done) => Eta::Known(self.write_time / done * remaining),
        };
        let line = SourceProgress {
            bar,
            started: Instant::now(),
            last_update: None,
            every: if terminal { UPDATE_EVERY } else { LOG_EVERY },
            eta,
            parts: None,
            last_counts: (0, 0),
            last_message: String::new(),
            sink: Arc::clone(&sink),
        };
        if terminal {
            // A terminal shows the line at once; a log gets its first line after a second, or
            // only the finished one.
            line.bar.set_message(line.message(0, 0));
        }
        line.bar
            .set_draw_target(ProgressDrawTarget::term_like_with_hz(
                Box::new(SharedSink(sink)),
                REFRESH_HZ,
            ));
        line
    }

    /// Starts the one line of source `index`, a cache set of `total` parts of which `published`
    /// were published before this call: parts done of all, samples/s and MB/s over the whole
    /// set (whoever writes its parts) and an ETA over the parts left.
    pub fn set(
        &mut self,
        sink: Arc<dyn ProgressSink>,
        index: usize,
        name: &str,
        total: usize,
        published: usize,
    ) -> SourceProgress {
        let mut line = self.source(sink, index, name);
        line.parts = Some(Parts {
            total,
            published,
            done: published,
            last_done_after: Duration::ZERO,
        });
        if line.sink.is_terminal() {
            line.bar.set_message(line.message(0, 0));
        }
        line
    }

    /// Records that a source was written in `took`.
    pub fn source_written(&mut self, took: Duration) {
        self.writes_done += 1;
        self.write_time += took;
    }

    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }
}

fn running_style() -> ProgressStyle {
    ProgressStyle::with_template("{prefix}{wide_msg}").expect("static template")
}

fn whole_style() -> ProgressStyle {
    ProgressStyle::with_template("{prefix}{msg}").expect("static template")
}

pub struct SourceProgress {
    bar: ProgressBar,
    started: Instant,
    last_update: Option<Instant>,
    every: Duration,
    eta: Eta,
    /// For a cache set: its parts, and the ETA is over the parts left.
    parts: Option<Parts>,
    /// The samples and bytes of the last update.
    last_counts: (u64, u64),
    /// The figures drawn last: a log never gets the same line twice.
    last_message: String,
    sink: Arc<dyn ProgressSink>,
}

/// The parts of a set: all of them, those published before this call, and those done now.
#[derive(Clone, Copy)]
struct Parts {
    total: usize,
    published: usize,
    done: usize,
    /// When the line's part count last grew (since the line started): the parts written so
    /// far took that long.
    last_done_after: Duration,
}

impl Parts {
    fn describe(&self) -> String {
        format!("parts {}/{}", self.done, self.total)
    }

    /// The mean time of the parts written so far (which ran side by side) times the parts
    /// left, less the time since the last one was done (which the parts being written have had
    /// already).
    fn eta(&self, elapsed: Duration) -> Option<Duration> {
        let written = self.done.saturating_sub(self.published) as u32;
        let left = self.total.saturating_sub(self.done) as u32;
        (written > 0).then(|| {
            let since = elapsed.saturating_sub(self.last_done_after);
            (self.last_done_after / written * left).saturating_sub(since)
        })
    }
}

/// The ETA over the remaining sources of a multi-source write: unknown until one was written.
#[derive(Clone, Copy)]
enum Eta {
    SingleSource,
    Unknown,
    Known(Duration),
}

impl SourceProgress {
    fn figures(&self, samples: u64, bytes: u64) -> String {
        let secs = self.started.elapsed().as_secs_f64().max(1e-9);
        format!(
            "{} samples, {} | {:.0} samples/s, {:.1} MB/s",
            HumanCount(samples),
            DecimalBytes(bytes),
            samples as f64 / secs,
            bytes as f64 / secs / 1e6,
        )
    }

    fn message(&self, samples: u64, bytes: u64) -> String {
        let mut msg = self.figures(samples, bytes);
        if let Some(parts) = &self.parts {
            let eta = parts.eta(self.started.elapsed());
            let eta = eta.map_or("-".to_owned(), |d| HumanDuration(d).to_string());
            return format!("{} | {msg} | ETA {eta}", parts.describe());
        }
        match self.eta {
            Eta::SingleSource => {}
            Eta::Unknown => msg.push_str(" | ETA -"),
            Eta::Known(eta) => {
                let left = eta.saturating_sub(self.started.elapsed());
                msg.push_str(&format!(" | ETA {}", HumanDuration(left)));
            }
        }
        msg
    }

    /// Called often; takes new figures at most twice a second on a terminal (the first at
    /// once) and once a second in a log (the first after a second).
    pub fn update(&mut self, samples: u64, bytes: u64) {
        self.last_counts = (samples, bytes);
        let now = Instant::now();
        match self.last_update {
            Some(t) if now - t < self.every => return,
            // A log's first line waits a whole second: a quick source shows only its last line.
            None if !self.sink.is_terminal() && now - self.started < self.every => return,
            _ => {}
        }
        self.last_update = Some(now);
        let message = self.message(samples, bytes);
        if message != self.last_message {
            self.bar.set_message(message.clone());
            self.last_message = message;
        }
    }

    /// For a set's line: `samples` and `bytes` written so far by all its writers, and the parts
    /// they finished in this call (the line adds those published before it). Redrawn as
    /// [`update`](Self::update) does.
    pub fn update_parts(&mut self, samples: u64, bytes: u64, finished_now: usize) {
        if let Some(parts) = &mut self.parts {
            let done = parts
                .published
                .saturating_add(finished_now)
                .min(parts.total);
            if done > parts.done {
                parts.last_done_after = self.started.elapsed();
            }
            parts.done = done;
        }
        self.update(samples, bytes);
    }

    /// Draws the final line of this source, without an ETA (the source is done), and on a
    /// terminal ends it with a newline, so what is printed next starts on a row of its own.
    pub fn finish(self, samples: u64, bytes: u64, outcome: &str) {
        let parts = self
            .parts
            .map(|p| format!("{} | ", p.describe()))
            .unwrap_or_default();
        let msg = format!(
            "{parts}{} | {outcome} in {:.2?}",
            self.figures(samples, bytes),
            self.started.elapsed()
        );
        // The finished line is drawn whole: nothing redraws it, so it may wrap.
        self.bar.set_style(whole_style());
        self.bar.finish_with_message(msg);
        if self.sink.is_terminal() {
            // Progress is best effort: a failed write must not fail the cache write.
            let _ = self.sink.write_str("\n");
            let _ = self.sink.flush();
        }
    }

    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// The samples and bytes of the last [`update`](Self::update).
    pub fn last_counts(&self) -> (u64, u64) {
        self.last_counts
    }
}
