//! Write progress: committed samples/s and MB/s of the active source, and for several sources
//! which one of how many and the ETA over the remaining sources. Drawn by indicatif onto any
//! terminal-like sink (the bindings pass Python's `sys.stderr`), never from a thread of its own.

use std::time::{Duration, Instant};

pub use indicatif::TermLike;
use indicatif::{
    DecimalBytes, HumanCount, HumanDuration, ProgressBar, ProgressDrawTarget, ProgressStyle,
};

/// Redraws per second; a log file (not a terminal) gets one line per redraw.
const REFRESH_HZ: u8 = 2;
const UPDATE_EVERY: Duration = Duration::from_millis(100);

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
    pub fn source(&mut self, term: Box<dyn TermLike>, index: usize, name: &str) -> SourceProgress {
        // Styled while hidden, so the first line drawn is already complete.
        let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::hidden());
        bar.set_style(ProgressStyle::with_template("{prefix}{msg}").expect("static template"));
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
        let mut line = SourceProgress {
            bar,
            started: Instant::now(),
            last_update: None,
            eta,
        };
        line.update(0, 0);
        line.bar
            .set_draw_target(ProgressDrawTarget::term_like_with_hz(term, REFRESH_HZ));
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

pub struct SourceProgress {
    bar: ProgressBar,
    started: Instant,
    last_update: Option<Instant>,
    eta: Eta,
}

/// The ETA over the remaining sources of a multi-source write: unknown until one was written.
#[derive(Clone, Copy)]
enum Eta {
    SingleSource,
    Unknown,
    Known(Duration),
}

impl SourceProgress {
    fn message(&self, samples: u64, bytes: u64) -> String {
        let secs = self.started.elapsed().as_secs_f64().max(1e-9);
        let mut msg = format!(
            "{} samples, {} | {:.0} samples/s, {:.1} MB/s",
            HumanCount(samples),
            DecimalBytes(bytes),
            samples as f64 / secs,
            bytes as f64 / secs / 1e6,
        );
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

    /// Called often; redraws at most every 100 ms (and the draw target rate-limits further).
    pub fn update(&mut self, samples: u64, bytes: u64) {
        let now = Instant::now();
        if self.last_update.is_some_and(|t| now - t < UPDATE_EVERY) {
            return;
        }
        self.last_update = Some(now);
        self.bar.set_message(self.message(samples, bytes));
    }

    /// Draws the final line of this source.
    pub fn finish(self, samples: u64, bytes: u64, outcome: &str) {
        let msg = format!(
            "{} | {outcome} in {:.2?}",
            self.message(samples, bytes),
            self.started.elapsed()
        );
        self.bar.finish_with_message(msg);
    }

    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }
}
