//! How a write's progress line behaves on a terminal and in a log, through a recording sink.

use std::io;
use std::sync::{Arc, Mutex};
use std::thread::sleep;
use std::time::{Duration, Instant};

use dataset_rt_core::progress::{ProgressSink, TermLike, WriteProgress};

#[derive(Debug, Default)]
struct Recorder {
    terminal: bool,
    columns: u16,
    out: Mutex<String>,
    /// When each line was cleared to be drawn again (a terminal's redraws).
    clears: Mutex<Vec<Instant>>,
}

impl Recorder {
    fn new(terminal: bool, columns: u16) -> Arc<Self> {
        Arc::new(Recorder {
            terminal,
            columns,
            out: Mutex::new(String::new()),
            clears: Mutex::new(Vec::new()),
        })
    }

    fn text(&self) -> String {
        self.out.lock().unwrap().clone()
    }

    fn push(&self, s: &str) {
        self.out.lock().unwrap().push_str(s);
    }
}

impl ProgressSink for Recorder {
    fn is_terminal(&self) -> bool {
        self.terminal
    }
}

// Like the Python stderr sink: a terminal gets escapes, a log gets one trimmed line per draw.
impl TermLike for Recorder {
    fn width(&self) -> u16 {
        self.columns - 1
    }
    fn move_cursor_up(&self, _: usize) -> io::Result<()> {
        Ok(())
    }
    fn move_cursor_down(&self, _: usize) -> io::Result<()> {
        Ok(())
    }
    fn move_cursor_right(&self, _: usize) -> io::Result<()> {
        Ok(())
    }
    fn move_cursor_left(&self, _: usize) -> io::Result<()> {
        Ok(())
    }
    fn write_line(&self, s: &str) -> io::Result<()> {
        self.write_str(s)?;
        if self.terminal {
            self.push("\n");
        }
        Ok(())
    }
    fn write_str(&self, s: &str) -> io::Result<()> {
        if self.terminal {
            self.push(s);
        } else if !s.trim_end().is_empty() {
            self.push(&format!("{}\n", s.trim_end()));
        }
        Ok(())
    }
    fn clear_line(&self) -> io::Result<()> {
        if self.terminal {
            self.push("\r\x1b[2K");
            self.clears.lock().unwrap().push(Instant::now());
        }
        Ok(())
    }
    fn flush(&self) -> io::Result<()> {
        Ok(())
    }
}

/// Feeds a source's line for `duration`, every 10 ms, then finishes it.
fn write_source(progress: &mut WriteProgress, sink: Arc<Recorder>, index: usize, ms: u64) {
    let mut line = progress.source(sink, index, "images");
    for step in 0..ms / 10 {
        line.update(step * 1000, step * 4_096_000);
        sleep(Duration::from_millis(10));
    }
    let took = line.elapsed();
    line.finish(ms / 10 * 1000, ms / 10 * 4_096_000, "written");
    progress.source_written(took);
}

#[test]
fn a_terminal_line_fits_the_width_and_ends_with_a_newline() {
    let sink = Recorder::new(true, 40);
    let mut progress = WriteProgress::new(1);
    write_source(&mut progress, Arc::clone(&sink), 0, 700);
    let text = sink.text();
    assert!(text.ends_with('\n'), "{text:?}");
    // Every redraw while running starts after a clear and fits in 39 columns: no wrap, no scroll.
    let draws: Vec<&str> = text.split("\r\x1b[2K").collect();
    assert!(draws.len() >= 3, "expected several redraws: {text:?}");
    for draw in &draws[..draws.len() - 1] {
        assert!(
            draw.chars().count() <= 39,
            "{draw:?} is wider than the terminal"
        );
        assert!(!draw.contains('\n'), "{draw:?} scrolls");
    }
    // The finished line is whole (nothing redraws it) and followed by one newline.
    let last = draws.last().unwrap();
    assert!(last.trim_end().contains("written in"), "{last:?}");
    assert_eq!(last.matches('\n').count(), 1, "{last:?}");
}

#[test]
fn a_terminal_line_is_redrawn_at_most_twice_a_second() {
    let sink = Recorder::new(true, 120);
    let mut progress = WriteProgress::new(1);
    write_source(&mut progress, Arc::clone(&sink), 0, 2_300);
    let clears = sink.clears.lock().unwrap().clone();
    // The redraws while running; the last clear draws the finished line.
    let running = &clears[..clears.len() - 1];
    assert!(running.len() >= 3, "{} redraws in 2.3 s", running.len());
    for (i, &at) in running.iter().enumerate() {
        let within = running[i..]
            .iter()
            .take_while(|&&t| t - at < Duration::from_secs(1))
            .count();
        assert!(
            within <= 2,
            "{within} redraws within a second of redraw {i}"
        );
    }
}

#[test]
fn a_log_gets_at_most_one_line_a_second_and_no_stale_eta() {
    let sink = Recorder::new(false, 120);
    let mut progress = WriteProgress::new(2);
    write_source(&mut progress, Arc::clone(&sink), 0, 300);
    write_source(&mut progress, Arc::clone(&sink), 1, 2_300);
    let text = sink.text();
    let lines: Vec<&str> = text.lines().collect();
    // First source: 0.3 s, so its finished line only. Second: lines at ~1 s and ~2 s, then its
    // finished line; never two equal lines in a row, and no line is a terminal's escape.
    assert!(lines[0].starts_with("[1/2] images: ") && lines[0].contains("written in"));
    let second: Vec<&str> = lines[1..].to_vec();
    assert!(
        (2..=4).contains(&second.len()),
        "{} lines for a 2.3 s source: {second:?}",
        second.len()
    );
    for pair in lines.windows(2) {
        assert_ne!(pair[0], pair[1], "duplicated line");
    }
    assert!(second[..second.len() - 1]
        .iter()
        .all(|l| l.contains("ETA") && !l.contains("written")));
    for finished in [lines[0], *second.last().unwrap()] {
        assert!(finished.contains("written in"), "{finished}");
        assert!(
            !finished.contains("ETA"),
            "a finished source shows no ETA: {finished}"
        );
    }
    assert!(!text.contains('\x1b') && !text.contains('\r'));
}

#[test]
fn the_eta_covers_the_remaining_sources_once_one_was_written() {
    let sink = Recorder::new(true, 200);
    let mut progress = WriteProgress::new(3);
    for index in 0..3 {
        write_source(&mut progress, Arc::clone(&sink), index, 300);
    }
    let text = sink.text();
    let draws: Vec<&str> = text
        .split(['\r', '\n'])
        .map(|d| d.trim_start_matches("\x1b[2K").trim_end())
        .collect();
    let running = |prefix: &str| -> Vec<&str> {
        draws
            .iter()
            .copied()
            .filter(|d| d.starts_with(prefix) && !d.contains("written in"))
            .collect()
    };
    // Nothing to estimate from before the first source is written; then the mean source time.
    let first = running("[1/3] images: ");
    assert!(
        !first.is_empty() && first.iter().all(|d| d.ends_with("| ETA -")),
        "{first:?}"
    );
    for prefix in ["[2/3] images: ", "[3/3] images: "] {
        let later = running(prefix);
        assert!(!later.is_empty(), "{text:?}");
        for draw in later {
            let eta = draw.rsplit_once("| ETA ").map(|(_, eta)| eta).unwrap_or("");
            assert!(
                eta.split(' ')
                    .next()
                    .is_some_and(|n| n.parse::<u64>().is_ok()),
                "{draw:?} has no ETA in time units"
            );
        }
    }
    let finished: Vec<&str> = draws
        .iter()
        .copied()
        .filter(|d| d.contains("written in"))
        .collect();
    assert_eq!(finished.len(), 3, "{finished:?}");
    assert!(finished.iter().all(|d| !d.contains("ETA")), "{finished:?}");
}

#[test]
fn a_set_has_one_line_with_its_parts_and_an_eta_over_the_parts_left() {
    let sink = Recorder::new(true, 200);
    let mut progress = WriteProgress::new(1);
    // 4 parts, 1 published before: nothing to estimate from until a part is written here.
    let mut line = progress.set(sink.clone(), 0, "train", 4, 1);
    for step in 1..=30u64 {
        // The parts finished in this call: the line adds the one published before.
        line.update_parts(step * 100, step * 409_600, (step / 10) as usize);
        // 1.5 s in all: a terminal takes new figures twice a second.
        sleep(Duration::from_millis(50));
    }
    line.finish(3000, 12_288_000, "written");
    let text = sink.text();
    let draws: Vec<&str> = text
        .split(['\r', '\n'])
        .map(|d| d.trim_start_matches("\x1b[2K").trim_end())
        .filter(|d| !d.is_empty())
        .collect();
    assert!(
        draws.iter().all(|d| d.starts_with("train: parts ")),
        "{draws:?}"
    );
    let running: Vec<&str> = draws
        .iter()
        .copied()
        .filter(|d| !d.contains("written in"))
        .collect();
    assert!(
        running
            .first()
            .is_some_and(|d| d.starts_with("train: parts 1/4 ") && d.ends_with("| ETA -")),
        "{running:?}"
    );
    assert!(
        running
            .iter()
            .any(|d| d.starts_with("train: parts 2/4 ") && !d.ends_with("ETA -")),
        "no ETA once a part was written: {running:?}"
    );
    assert!(running
        .iter()
        .all(|d| d.contains("samples/s") && d.contains("MB/s")));
    let last = draws.last().unwrap();
    assert!(
        last.starts_with("train: parts 4/4 | 3,000 samples") && last.contains("written in"),
        "{last}"
    );
    assert!(!last.contains("ETA"), "{last}");
}

#[test]
fn a_sets_eta_counts_the_time_the_parts_being_written_have_had() {
    let sink = Recorder::new(false, 200);
    let mut progress = WriteProgress::new(1);
    let mut line = progress.set(sink.clone(), 0, "train", 3, 0);
    // One part done after 0.6 s: 0.6 s a part, two left. At 1 s the two being written have
    // had 0.4 s of their 1.2 s, at 2 s all of it: the ETA falls, it never grows to 2 s or 4 s.
    for step in 0..=22u64 {
        let finished = usize::from(step >= 6);
        line.update_parts(step * 100, step * 409_600, finished);
        sleep(Duration::from_millis(100));
    }
    line.finish(2300, 9_420_800, "written");
    let text = sink.text();
    let etas: Vec<u64> = text
        .lines()
        .filter(|l| l.contains("parts 1/3"))
        .filter_map(|l| l.split("ETA ").nth(1))
        .map(|eta| eta.split(' ').next().unwrap().parse().unwrap())
        .collect();
    assert!(!etas.is_empty(), "{text}");
    assert!(etas.iter().all(|&s| s <= 1), "{etas:?} in {text}");
}

#[test]
fn a_log_never_gets_the_same_line_twice_while_nothing_moves() {
    let sink = Recorder::new(false, 200);
    let mut progress = WriteProgress::new(1);
    // Workers still starting: nothing written for 2.3 s, then the set is done.
    let mut line = progress.set(sink.clone(), 0, "train", 2, 0);
    for _ in 0..23 {
        line.update_parts(0, 0, 0);
        sleep(Duration::from_millis(100));
    }
    line.finish(10, 40_960, "written");
    let text = sink.text();
    let lines: Vec<&str> = text.lines().collect();
    for pair in lines.windows(2) {
        assert_ne!(pair[0], pair[1], "duplicated line in {text}");
    }
    assert!(lines.last().unwrap().contains("written in"), "{text}");
}
