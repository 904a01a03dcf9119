//! How one thread can keep many reads in flight, measured against each other on a cold page
//! cache: the choice behind DatasetRT's read planner (`docs/runtime-model.md`).
//!
//! It writes one flat file of fixed-size records (reused when it is there), then, round by
//! round, evicts it from the page cache (`posix_fadvise(DONTNEED)`, checked with `mincore`) before
//! each contender, which reads its own random share of the records (its own seed), checking
//! every record's first and last 8 bytes. Contenders:
//!
//! - `pread x64` (the ceiling): 64 threads, each one `pread` at a time;
//! - `pread x1`: one thread, one `pread` at a time (one read in flight);
//! - `fadvise`: one thread that advises `POSIX_FADV_WILLNEED` on the next `depth` records, then
//!   `pread`s each (what `DATASET_RT_IO=fadvise`, the default, does ahead of the pool's threads);
//! - `madvise`: the same through a shared map (`MADV_RANDOM` on it, `MADV_WILLNEED` ahead) and the
//!   record read from the map, as DatasetRT reads raw records (`DATASET_RT_IO=madvise`);
//! - `io_uring`: one thread with `depth` buffered reads in flight in one ring, each completion
//!   checked and its buffer given to the next read. Skipped, with the reason, where the kernel
//!   refuses `io_uring_setup` (seccomp, old kernels).
//!
//! The disk of a virtual machine changes pace from one second to the next, so every round
//! measures the ceiling again, and the table gives medians of the per-round ratios.
//!
//! ```text
//! cargo run --release --manifest-path bench/io_depth/Cargo.toml -- --gib 4 --record 4096
//! ```
//!
//! `io-depth-probe ceiling PLAN THREADS FILE...` is the ceiling of `bench/bench_cold.py`:
//! `THREADS` threads of `pread` over the records that `PLAN` lists, in its order, each as four
//! little-endian `u64` (the file's number among `FILE...`, the record's index, its offset, its
//! length). Every record is checked as the benchmark checks it (magic, index, length, and the
//! digest of its body: CRC-32 up to 16 KiB, the wrapping sum of its words above). It prints the
//! seconds from the first request to each record's arrival, one per line, sorted. No
//! interpreter stands between the threads and the disk, so it is the disk's rate at that depth
//! for those byte ranges: the flat file's records, or the payloads inside a DatasetRT cache's
//! shards.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use io_uring::{opcode, types, IoUring};

struct Args {
    dir: PathBuf,
    gib: u64,
    record: u64,
    reads: usize,
    rounds: usize,
    depth: usize,
    keep: bool,
}

fn usage(problem: &str) -> ! {
    eprintln!(
        "io-depth-probe: {problem}\n\
         usage: io-depth-probe [--dir DIR] [--gib N] [--record BYTES] [--reads K] [--rounds R] \
         [--depth D] [--keep]"
    );
    std::process::exit(2)
}

fn parse_args() -> Args {
    let mut args = Args {
        dir: std::env::temp_dir().join("dataset-rt-io-depth"),
        gib: 4,
        record: 4096,
        reads: 20_000,
        rounds: 3,
        depth: 64,
        keep: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--keep" {
            args.keep = true;
            continue;
        }
        let Some(value) = it.next() else {
            usage(&format!("{flag} needs a value"))
        };
        let number = || -> u64 {
            value
                .parse()
                .unwrap_or_else(|_| usage(&format!("{flag} takes a whole number, not {value:?}")))
        };
        match flag.as_str() {
            "--dir" => args.dir = PathBuf::from(&value),
            "--gib" => args.gib = number(),
            "--record" => args.record = number(),
            "--reads" => args.reads = number() as usize,
            "--rounds" => args.rounds = number() as usize,
            "--depth" => args.depth = number() as usize,
            _ => usage(&format!("unknown flag {flag}")),
        }
    }
    if args.record < 16 || !args.record.is_multiple_of(8) {
        usage("--record must be a multiple of 8, at least 16");
    }
    if args.gib == 0 || args.reads == 0 || args.rounds == 0 || args.depth == 0 {
        usage("--gib, --reads, --rounds and --depth must be positive");
    }
    args
}

/// The 8-byte word that fills record `i`.
fn word(i: u64) -> u64 {
    i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5DEE_CE66_D1CE_B00C
}

fn check(buf: &[u8], i: u64) {
    let w = word(i).to_le_bytes();
    let n = buf.len();
    assert!(
        buf[..8] == w && buf[n - 8..] == w,
        "record {i} read back wrong: the probe is broken or the file changed"
    );
}

/// The flat file: `records` records of `record` bytes, record `i` filled with `word(i)`.
fn flat_file(args: &Args) -> (File, PathBuf, u64) {
    std::fs::create_dir_all(&args.dir).expect("create the probe's directory");
    let records = (args.gib << 30) / args.record;
    let path = args.dir.join(format!("flat-{}.bin", args.record));
    let size = records * args.record;
    if std::fs::metadata(&path).map(|m| m.len()).ok() != Some(size) {
        eprintln!(
            "writing {} ({:.1} GiB)",
            path.display(),
            size as f64 / (1u64 << 30) as f64
        );
        let mut f = File::create(&path).expect("create the flat file");
        let per_chunk = ((8u64 << 20) / args.record).max(1);
        let mut chunk = Vec::with_capacity((per_chunk * args.record) as usize);
        let mut i = 0;
        while i < records {
            chunk.clear();
            for j in i..(i + per_chunk).min(records) {
                for _ in 0..args.record / 8 {
                    chunk.extend_from_slice(&word(j).to_le_bytes());
                }
            }
            f.write_all(&chunk).expect("write the flat file");
            i += per_chunk;
        }
        f.sync_all().expect("sync the flat file");
    }
    let f = OpenOptions::new()
        .read(true)
        .open(&path)
        .expect("open the flat file");
    (f, path, records)
}

/// Drops the file from the page cache and returns the share of its pages still resident.
fn evict(f: &File, size: u64) -> f64 {
    // SAFETY: fadvise reads only its arguments; the descriptor is open.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    resident(f, size)
}

fn resident(f: &File, size: u64) -> f64 {
    let page = page_size();
    let pages = size.div_ceil(page) as usize;
    // SAFETY: a read-only shared map of the whole open file, unmapped below; mincore writes one
    // byte per page into `vec`, which has one per page.
    unsafe {
        let map = libc::mmap(
            std::ptr::null_mut(),
            size as usize,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        );
        assert!(map != libc::MAP_FAILED, "mmap the flat file");
        let mut vec = vec![0u8; pages];
        let rc = libc::mincore(map, size as usize, vec.as_mut_ptr());
        libc::munmap(map, size as usize);
        assert_eq!(rc, 0, "mincore");
        vec.iter().filter(|v| **v & 1 == 1).count() as f64 / pages as f64
    }
}

fn page_size() -> u64 {
    // SAFETY: sysconf reads a constant of the system.
    (unsafe { libc::sysconf(libc::_SC_PAGESIZE) }) as u64
}

/// `n` record numbers below `records`, from a splitmix64 stream seeded by `seed`.
fn share(records: u64, n: usize, seed: u64) -> Vec<u64> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            (z ^ (z >> 31)) % records
        })
        .collect()
}

fn pread_threads(f: &File, share: &[u64], record: u64, threads: usize) -> Duration {
    let next = AtomicUsize::new(0);
    let start = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                let mut buf = vec![0u8; record as usize];
                loop {
                    let k = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&i) = share.get(k) else { break };
                    f.read_exact_at(&mut buf, i * record).expect("pread");
                    check(&buf, i);
                }
            });
        }
    });
    start.elapsed()
}

fn fadvise_ahead(f: &File, share: &[u64], record: u64, depth: usize) -> Duration {
    let mut buf = vec![0u8; record as usize];
    let start = Instant::now();
    let mut advised = 0;
    for (k, &i) in share.iter().enumerate() {
        while advised < share.len() && advised < k + depth {
            // SAFETY: fadvise reads only its arguments; the descriptor is open.
            unsafe {
                libc::posix_fadvise(
                    f.as_raw_fd(),
                    (share[advised] * record) as libc::off_t,
                    record as libc::off_t,
                    libc::POSIX_FADV_WILLNEED,
                )
            };
            advised += 1;
        }
        f.read_exact_at(&mut buf, i * record).expect("pread");
        check(&buf, i);
    }
    start.elapsed()
}

fn madvise_ahead(f: &File, size: u64, share: &[u64], record: u64, depth: usize) -> Duration {
    let page = page_size();
    // SAFETY: a read-only shared map of the whole open file, unmapped at the end; every slice
    // below lies inside it, and madvise changes no byte of it.
    unsafe {
        let map = libc::mmap(
            std::ptr::null_mut(),
            size as usize,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        );
        assert!(map != libc::MAP_FAILED, "mmap the flat file");
        libc::madvise(map, size as usize, libc::MADV_RANDOM);
        let base = map as *const u8;
        let start = Instant::now();
        let mut advised = 0;
        for (k, &i) in share.iter().enumerate() {
            while advised < share.len() && advised < k + depth {
                let at = share[advised] * record;
                let from = at / page * page;
                let len = at + record - from;
                libc::madvise(
                    base.add(from as usize) as *mut libc::c_void,
                    len as usize,
                    libc::MADV_WILLNEED,
                );
                advised += 1;
            }
            let bytes =
                std::slice::from_raw_parts(base.add((i * record) as usize), record as usize);
            check(bytes, i);
        }
        let took = start.elapsed();
        libc::munmap(map, size as usize);
        took
    }
}

fn uring(f: &File, share: &[u64], record: u64, depth: usize) -> std::io::Result<Duration> {
    let mut ring = IoUring::new((depth as u32).next_power_of_two())?;
    let mut bufs: Vec<Vec<u8>> = (0..depth).map(|_| vec![0u8; record as usize]).collect();
    // Which record each buffer holds in flight.
    let mut holds = vec![0u64; depth];
    let fd = types::Fd(f.as_raw_fd());
    let start = Instant::now();
    let mut next = 0;
    let mut in_flight = 0;
    let submit = |ring: &mut IoUring, slot: usize, i: u64, bufs: &mut [Vec<u8>]| {
        let read = opcode::Read::new(fd, bufs[slot].as_mut_ptr(), record as u32)
            .offset(i * record)
            .build()
            .user_data(slot as u64);
        // SAFETY: the buffer of `slot` stays alive and untouched until its completion is reaped.
        unsafe {
            ring.submission()
                .push(&read)
                .expect("a full submission queue")
        };
    };
    while next < share.len() && in_flight < depth {
        holds[in_flight] = share[next];
        submit(&mut ring, in_flight, share[next], &mut bufs);
        next += 1;
        in_flight += 1;
    }
    while in_flight > 0 {
        ring.submit_and_wait(1)?;
        let done: Vec<(usize, i32)> = ring
            .completion()
            .map(|c| (c.user_data() as usize, c.result()))
            .collect();
        for (slot, result) in done {
            if result < 0 {
                return Err(std::io::Error::from_raw_os_error(-result));
            }
            assert_eq!(result as u64, record, "a short read");
            check(&bufs[slot], holds[slot]);
            in_flight -= 1;
            if next < share.len() {
                holds[slot] = share[next];
                submit(&mut ring, slot, share[next], &mut bufs);
                next += 1;
                in_flight += 1;
            }
        }
    }
    Ok(start.elapsed())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// `bench_cold`'s record header: magic, index, length, digest of the body.
const COLD_MAGIC: u64 = 0x444C_4F43_5F52_5444;
const COLD_HEADER: usize = 32;
const COLD_CRC_MAX: usize = 16 * 1024;

fn le_word(b: &[u8], k: usize) -> u64 {
    u64::from_le_bytes(b[8 * k..8 * k + 8].try_into().expect("8 bytes"))
}

/// Checks one record of `bench_cold`'s flat file; the error says what is wrong.
fn check_cold(buf: &[u8], index: u64) -> Result<(), String> {
    if buf.len() < COLD_HEADER {
        return Err(format!(
            "record {index}: {} bytes, shorter than its header",
            buf.len()
        ));
    }
    let (magic, got, len, digest) = (
        le_word(buf, 0),
        le_word(buf, 1),
        le_word(buf, 2),
        le_word(buf, 3),
    );
    if magic != COLD_MAGIC || got != index || len != buf.len() as u64 {
        return Err(format!(
            "record {index}: header says magic {magic:#x}, index {got}, length {len}"
        ));
    }
    let body = &buf[COLD_HEADER..];
    let sum = if buf.len() <= COLD_CRC_MAX {
        u64::from(crc32fast::hash(body))
    } else {
        body.chunks_exact(8)
            .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
            .fold(0u64, u64::wrapping_add)
    };
    if sum != digest {
        return Err(format!("record {index}: digest mismatch"));
    }
    Ok(())
}

/// `bench_cold`'s ceiling (see the module's docs); exits 1 with the first wrong record.
fn cold_ceiling(args: &[String]) {
    let [plan, threads, files @ ..] = args else {
        usage("ceiling takes PLAN THREADS FILE...")
    };
    let threads: usize = threads.parse().ok().filter(|&t| t > 0).unwrap_or_else(|| {
        usage(&format!(
            "THREADS must be a positive number, not {threads:?}"
        ))
    });
    let files: Vec<File> = files
        .iter()
        .map(|f| File::open(f).unwrap_or_else(|e| usage(&format!("cannot open {f}: {e}"))))
        .collect();
    let plan = std::fs::read(plan).unwrap_or_else(|e| usage(&format!("cannot read {plan}: {e}")));
    if plan.len() % 32 != 0 {
        usage("PLAN must hold (file, index, offset, length) quadruples of little-endian u64");
    }
    let records: Vec<(&File, u64, u64, u64)> = plan
        .chunks_exact(32)
        .map(|t| {
            let file = files.get(le_word(t, 0) as usize).unwrap_or_else(|| {
                usage(&format!(
                    "PLAN names file {}, of {} given",
                    le_word(t, 0),
                    files.len()
                ))
            });
            (file, le_word(t, 1), le_word(t, 2), le_word(t, 3))
        })
        .collect();
    let next = AtomicUsize::new(0);
    let start = Instant::now();
    let results: Vec<Result<Vec<f64>, String>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut arrivals = Vec::new();
                    let mut buf = Vec::new();
                    loop {
                        let k = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&(f, index, offset, len)) = records.get(k) else {
                            return Ok(arrivals);
                        };
                        buf.resize(len as usize, 0);
                        f.read_exact_at(&mut buf, offset)
                            .map_err(|e| format!("record {index}: pread: {e}"))?;
                        check_cold(&buf, index)?;
                        arrivals.push(start.elapsed().as_secs_f64());
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("a reading thread panicked"))
            .collect()
    });
    let mut arrivals = Vec::with_capacity(records.len());
    for r in results {
        match r {
            Ok(a) => arrivals.extend(a),
            Err(e) => {
                eprintln!("io-depth-probe ceiling: {e}");
                std::process::exit(1);
            }
        }
    }
    arrivals.sort_by(|a, b| a.total_cmp(b));
    let mut out = String::with_capacity(arrivals.len() * 12);
    for a in arrivals {
        out.push_str(&format!("{a:.6}\n"));
    }
    std::io::stdout()
        .write_all(out.as_bytes())
        .expect("write the arrivals");
}

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some("ceiling") {
        return cold_ceiling(&argv[2..]);
    }
    let args = parse_args();
    let (f, path, records) = flat_file(&args);
    let size = records * args.record;
    let uring_refused = match IoUring::new(8) {
        Ok(_) => None,
        Err(e) => Some(e.to_string()),
    };
    if let Some(why) = &uring_refused {
        eprintln!("io_uring is refused here ({why}): its contender is skipped");
    }
    const NAMES: [&str; 5] = [
        "pread x64 (ceiling)",
        "pread x1",
        "fadvise",
        "madvise",
        "io_uring",
    ];
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); NAMES.len()];
    let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); NAMES.len()];
    let mut worst_resident: f64 = 0.0;
    for round in 0..args.rounds {
        let mut round_rates = vec![f64::NAN; NAMES.len()];
        for (c, name) in NAMES.iter().enumerate() {
            if c == 4 && uring_refused.is_some() {
                continue;
            }
            let seed = (round * NAMES.len() + c) as u64 + 1;
            let share = share(records, args.reads, seed);
            worst_resident = worst_resident.max(evict(&f, size));
            let took = match c {
                0 => pread_threads(&f, &share, args.record, 64),
                1 => pread_threads(&f, &share, args.record, 1),
                2 => fadvise_ahead(&f, &share, args.record, args.depth),
                3 => madvise_ahead(&f, size, &share, args.record, args.depth),
                _ => match uring(&f, &share, args.record, args.depth) {
                    Ok(t) => t,
                    Err(e) => {
                        eprintln!("round {round}: io_uring failed ({e}): skipped");
                        continue;
                    }
                },
            };
            round_rates[c] = args.reads as f64 / took.as_secs_f64();
            eprintln!("round {round}: {name}: {:.0} records/s", round_rates[c]);
        }
        for c in 0..NAMES.len() {
            if round_rates[c].is_finite() {
                rates[c].push(round_rates[c]);
                ratios[c].push(round_rates[c] / round_rates[0]);
            }
        }
    }
    println!(
        "{} reads of {} B from {} records ({:.1} GiB), depth {}, {} rounds; at most {:.2}% of \
         the file resident after an eviction (mincore)",
        args.reads,
        args.record,
        records,
        size as f64 / (1u64 << 30) as f64,
        args.depth,
        args.rounds,
        worst_resident * 100.0
    );
    println!();
    println!("| contender | records/s (median) | x ceiling (median of rounds) |");
    println!("| --- | ---: | ---: |");
    for (c, name) in NAMES.iter().enumerate() {
        if rates[c].is_empty() {
            println!("| {name} | refused | - |");
            continue;
        }
        println!(
            "| {name} | {:.0} | {:.2} |",
            median(rates[c].clone()),
            median(ratios[c].clone())
        );
    }
    if !args.keep {
        let _ = std::fs::remove_file(&path);
    }
}
