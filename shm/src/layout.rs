//! Byte offsets of the control segment and of a ring slot (see `LAYOUT_VERSION`). `shm/LAYOUT.md` is the
//! specification; this file must agree with it byte for byte. Every integer is little-endian
//! (the only byte order DatasetRT builds for) and naturally aligned.

pub const CTL_MAGIC: &[u8; 8] = b"DRTCTL\0\0";
pub const SLOT_MAGIC: &[u8; 8] = b"DRTBATCH";
pub const LAYOUT_VERSION: u32 = 6;

pub const SHM_DIR: &str = "/dev/shm";

pub const PAGE: u64 = 4096;
/// Payloads start on this boundary inside a slot (SIMD loads, `numpy.frombuffer` of any dtype).
pub const PAYLOAD_ALIGN: u64 = 64;
/// Smallest slot the loader sizes from the data (an explicit `slot_size_bytes` may be smaller).
pub const MIN_SLOT_SIZE: u64 = 16 * PAGE;

// ---- control segment header (all offsets in bytes) ----
pub const C_MAGIC: usize = 0; // [u8; 8]
pub const C_VERSION: usize = 8; // u32
pub const C_NUM_SLOTS: usize = 12; // u32
pub const C_SLOT_SIZE: usize = 16; // u64
pub const C_RING_BYTES: usize = 24; // u64
pub const C_MAX_CONSUMERS: usize = 32; // u32
pub const C_ATTACHED: usize = 36; // u32 atomic: parties that mapped both segments
pub const C_EXPECTED_ATTACH: usize = 40; // u32
pub const C_STOP: usize = 44; // u32 atomic: 1 = everyone exits
pub const C_PRODUCER_WAKE: usize = 48; // u32 futex word, bumped on every release / delivery
pub const C_ERROR_KIND: usize = 52; // u32 atomic: 0 none, 255 being written, else a kind code
pub const C_ERROR_BATCH: usize = 56; // u64: first batch the error affects
pub const C_OWNER_PID: usize = 64; // u64
pub const C_PRODUCER_PID: usize = 72; // u64 atomic
pub const C_PRODUCER_HEARTBEAT: usize = 80; // u64 atomic, CLOCK_MONOTONIC ns
pub const C_TOTAL_BATCHES: usize = 88; // u64
pub const C_BATCH_SIZE: usize = 96; // u64
pub const C_RANK_SAMPLES: usize = 104; // u64: samples this rank reads in this pass
pub const C_EPOCH: usize = 112; // u64
pub const C_START: usize = 120; // u64: global position the pass starts at
pub const C_EPOCH_LEN: usize = 128; // u64
pub const C_RANK: usize = 136; // u64
pub const C_WORLD_SIZE: usize = 144; // u64
pub const C_POLICY: usize = 152; // u32: POLICY_PAD or POLICY_DROP
pub const C_PRODUCED: usize = 160; // u64 atomic: batches published
pub const C_NEXT_TICKET: usize = 168; // u64 atomic: (generation << 32) | next batch a consumer takes
pub const C_DELIVERED: usize = 176; // u64 atomic: batches the training loop received
pub const C_POSITION: usize = 184; // u64 atomic: global position after the delivered batches
pub const C_GENERATION: usize = 192; // u32 futex word: passes started before the current one
pub const C_PASS_TICKETS: usize = 200; // u64 atomic: (generation << 32) | total batches
pub const C_ERROR_ERRNO: usize = 208; // u32: errno of the recorded error, 0 when none
pub const C_ERROR_LEN: usize = 256; // u32
pub const C_ERROR_TEXT: usize = 260; // [u8; ERROR_TEXT_MAX], UTF-8
pub const ERROR_TEXT_MAX: usize = 1020;
pub const C_SLOTS: usize = 1280; // slot table
pub const SLOT_ENTRY: usize = 64;
pub const S_WORD: usize = 0; // u32 futex word: (seq mod 2^30) << 2 | state
pub const S_SEQ: usize = 8; // u64: batch in the slot (diagnostics)
pub const S_USED: usize = 16; // u64: bytes of the slot in use
pub const S_HOLDER: usize = 24; // u64: pid of the consumer holding it (TAKEN)
pub const CONSUMER_ENTRY: usize = 64; // after the slot table
pub const P_PID: usize = 0; // u64
pub const P_HEARTBEAT: usize = 8; // u64, CLOCK_MONOTONIC ns
pub const P_TICKET: usize = 16; // u64: batch being processed, u64::MAX when none
/// A heartbeat word holding this value: the party finished its work and needs no watching.
pub const HEARTBEAT_DONE: u64 = u64::MAX;

pub const FREE: u32 = 0;
pub const FILLING: u32 = 1;
pub const READY: u32 = 2;
pub const TAKEN: u32 = 3;

/// How an epoch is split over ranks (`C_POLICY`): the rank's share is padded to the same
/// length as every other rank's, or the remainder is dropped.
pub const POLICY_PAD: u32 = 0;
pub const POLICY_DROP: u32 = 1;

/// The error kind word's two values of its own; every other value is the code of a kind from the
/// error-kind table of whoever records the error (the producer's: `shm/LAYOUT.md`, "Error
/// kinds"), which the transport carries without reading.
pub const ERR_NONE: u32 = 0;
pub const ERR_WRITING: u32 = 255;

/// The futex word of a slot holding batch `seq` in `state`. The sequence bits make every fill
/// a new value, so a waiter can never sleep through a full FREE → READY cycle (no ABA).
pub fn slot_word(seq: u64, state: u32) -> u32 {
    (((seq as u32) & 0x3FFF_FFFF) << 2) | state
}

pub fn word_state(word: u32) -> u32 {
    word & 3
}

pub fn ctl_len(num_slots: u32, max_consumers: u32) -> u64 {
    let raw = C_SLOTS as u64
        + SLOT_ENTRY as u64 * u64::from(num_slots)
        + CONSUMER_ENTRY as u64 * u64::from(max_consumers);
    raw.div_ceil(PAGE) * PAGE
}

// ---- slot content ----
pub const B_MAGIC: usize = 0; // [u8; 8]
pub const B_SEQ: usize = 8; // u64
pub const B_NUM_SAMPLES: usize = 16; // u32
pub const B_VERSION: usize = 20; // u32
pub const B_USED: usize = 24; // u64
pub const B_HEADER_LEN: u64 = 64;
/// Per sample: global index u64, cache u32, meta_len u32, row u64, meta_off u64, data_off u64,
/// data_len u64 (offsets from the slot's start), payload kind u32, shard u32.
pub const B_ENTRY_LEN: u64 = 56;
/// Payload kinds of an offsets entry: the bytes are in the slot at `data_off`, or they are
/// bytes `data_off .. data_off + data_len` of shard file `shard` of the entry's cache.
pub const PAYLOAD_IN_SLOT: u32 = 0;
pub const PAYLOAD_SHARD_REF: u32 = 1;

pub const META_BOOL: u8 = 0;
pub const META_INT: u8 = 1;
pub const META_FLOAT: u8 = 2;
pub const META_STR: u8 = 3;

pub fn align(x: u64, to: u64) -> u64 {
    x.div_ceil(to) * to
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC: &str = include_str!("../LAYOUT.md");

    /// The rows `| offset | type | field |` of the table under `heading`.
    fn table(heading: &str) -> Vec<(usize, String, String)> {
        let start = SPEC.find(heading).expect("heading in LAYOUT.md");
        SPEC[start..]
            .lines()
            .skip_while(|l| !l.starts_with("| offset"))
            .skip(2)
            .take_while(|l| l.starts_with('|'))
            // The consumer table's offset depends on num_slots ("…"): checked by the size line.
            .filter(|l| !l.starts_with("| … |"))
            .map(|l| {
                let cells: Vec<&str> = l.trim_matches('|').split('|').map(str::trim).collect();
                let offset = cells[0].parse().expect("a byte offset");
                (offset, cells[1].to_owned(), cells[2].to_owned())
            })
            .collect()
    }

    /// Checks every `(field description prefix, type, constant)` against the table, and that
    /// the table has no row the list lacks.
    fn check(rows: &[(usize, String, String)], expected: &[(&str, &str, usize)]) {
        for (offset, ty, field) in rows {
            let Some((_, want_ty, want)) = expected.iter().find(|(p, _, _)| field.starts_with(p))
            else {
                panic!("LAYOUT.md field {field:?} at {offset} has no constant");
            };
            assert_eq!(offset, want, "offset of {field:?}");
            assert_eq!(ty, want_ty, "type of {field:?}");
        }
        assert_eq!(
            rows.len(),
            expected.len(),
            "fields in LAYOUT.md vs constants"
        );
    }

    #[test]
    fn control_segment_offsets_match_layout_md() {
        let error_text = format!("[u8; {ERROR_TEXT_MAX}]");
        check(
            &table("## Control segment"),
            &[
                ("magic", "[u8; 8]", C_MAGIC),
                ("layout version", "u32", C_VERSION),
                ("num_slots", "u32", C_NUM_SLOTS),
                ("slot_size", "u64", C_SLOT_SIZE),
                ("ring bytes", "u64", C_RING_BYTES),
                ("max_consumers", "u32", C_MAX_CONSUMERS),
                ("attached", "u32", C_ATTACHED),
                ("expected_attach", "u32", C_EXPECTED_ATTACH),
                ("stop", "u32", C_STOP),
                ("producer wake", "u32", C_PRODUCER_WAKE),
                ("error kind", "u32", C_ERROR_KIND),
                ("error batch", "u64", C_ERROR_BATCH),
                ("owner pid", "u64", C_OWNER_PID),
                ("producer pid", "u64", C_PRODUCER_PID),
                ("producer heartbeat", "u64", C_PRODUCER_HEARTBEAT),
                ("total batches", "u64", C_TOTAL_BATCHES),
                ("batch size", "u64", C_BATCH_SIZE),
                ("rank samples", "u64", C_RANK_SAMPLES),
                // Longer prefixes first: "epoch length" before "epoch", and so on.
                ("epoch length", "u64", C_EPOCH_LEN),
                ("epoch", "u64", C_EPOCH),
                ("start", "u64", C_START),
                ("rank policy", "u32", C_POLICY),
                ("rank", "u64", C_RANK),
                ("world size", "u64", C_WORLD_SIZE),
                ("produced", "u64", C_PRODUCED),
                ("next ticket", "u64", C_NEXT_TICKET),
                ("delivered", "u64", C_DELIVERED),
                ("position", "u64", C_POSITION),
                ("generation", "u32", C_GENERATION),
                ("pass tickets", "u64", C_PASS_TICKETS),
                ("error errno", "u32", C_ERROR_ERRNO),
                ("error text length", "u32", C_ERROR_LEN),
                ("error text", &error_text, C_ERROR_TEXT),
                ("slot table", "64 × num_slots", C_SLOTS),
            ],
        );
    }

    #[test]
    fn slot_content_offsets_match_layout_md() {
        check(
            &table("## Slot content"),
            &[
                ("magic", "[u8; 8]", B_MAGIC),
                ("batch", "u64", B_SEQ),
                ("number of samples", "u32", B_NUM_SAMPLES),
                ("layout version", "u32", B_VERSION),
                ("bytes used", "u64", B_USED),
                ("offsets table", "56 × n", B_HEADER_LEN as usize),
            ],
        );
        assert_eq!(B_ENTRY_LEN, 56);
        assert!(SPEC.contains(&format!(
            "payload kind: {PAYLOAD_IN_SLOT} in the slot, {PAYLOAD_SHARD_REF} a shard reference"
        )));
    }

    /// `+offset type` pairs of an inline entry description, e.g. "`+8 u64` batch in the slot".
    fn entry_fields(after: &str) -> Vec<(usize, String)> {
        let start = SPEC.find(after).expect("entry description in LAYOUT.md");
        let paragraph = SPEC[start..].split("\n\n").next().unwrap();
        paragraph
            .split('`')
            .skip(1)
            .step_by(2)
            .filter_map(|code| {
                let (offset, ty) = code.strip_prefix('+')?.split_once(' ')?;
                Some((offset.parse().ok()?, ty.to_owned()))
            })
            .collect()
    }

    #[test]
    fn table_entries_match_layout_md() {
        let slot_entry = [
            (S_WORD, "u32"),
            (S_SEQ, "u64"),
            (S_USED, "u64"),
            (S_HOLDER, "u64"),
        ];
        let consumer_entry = [(P_PID, "u64"), (P_HEARTBEAT, "u64"), (P_TICKET, "u64")];
        let offsets_entry = [
            (0, "u64"),
            (8, "u32"),
            (12, "u32"),
            (16, "u64"),
            (24, "u64"),
            (32, "u64"),
            (40, "u64"),
            (48, "u32"),
            (52, "u32"),
        ];
        let fields = entry_fields("Slot table entry (64 bytes)");
        let want: Vec<(usize, String)> = slot_entry
            .iter()
            .chain(&consumer_entry)
            .map(|(o, t)| (*o, t.to_string()))
            .collect();
        assert_eq!(fields, want);
        assert_eq!((SLOT_ENTRY, CONSUMER_ENTRY), (64, 64));
        let fields = entry_fields("Offsets table entry (56 bytes");
        let want: Vec<(usize, String)> = offsets_entry
            .iter()
            .map(|(o, t)| (*o, t.to_string()))
            .collect();
        assert_eq!(fields, want);
    }

    #[test]
    fn version_codes_and_sizes_match_layout_md() {
        let title = format!("byte layout, version {LAYOUT_VERSION}");
        assert!(
            SPEC.contains(&title),
            "LAYOUT.md title says another version"
        );
        assert_eq!(
            SPEC.matches(&format!("layout version = {LAYOUT_VERSION} |"))
                .count(),
            2
        );
        assert!(SPEC.contains(&format!(
            "Size: `{C_SLOTS} + {SLOT_ENTRY} × num_slots + {CONSUMER_ENTRY} × max_consumers`"
        )));
        assert!(SPEC.contains(&format!(
            "| … | {CONSUMER_ENTRY} × max_consumers | consumer table |"
        )));
        assert!(SPEC.contains(&format!(
            "state FREE {FREE}, FILLING {FILLING}, READY {READY}, TAKEN {TAKEN}"
        )));
        assert!(SPEC.contains(&format!(
            "error kind: {ERR_NONE} none, {ERR_WRITING} being written, else"
        )));
        assert_eq!(C_ERROR_TEXT + ERROR_TEXT_MAX, C_SLOTS);
        assert_eq!(
            (&CTL_MAGIC[..], &SLOT_MAGIC[..]),
            (&b"DRTCTL\0\0"[..], &b"DRTBATCH"[..])
        );
        assert!(SPEC.contains("magic `DRTCTL\\0\\0`") && SPEC.contains("magic `DRTBATCH`"));
    }

    #[test]
    fn ctl_len_rounds_up_to_pages() {
        assert_eq!(ctl_len(4, 2), 4096);
        assert_eq!(ctl_len(43, 1), 4096); // 1280 + 43 × 64 + 64 bytes exactly
        assert_eq!(ctl_len(44, 1), 8192);
    }

    #[test]
    fn slot_words_carry_the_batch_and_the_state() {
        for (seq, state) in [(0, FREE), (1, FILLING), (7, READY), (1 << 29, TAKEN)] {
            let word = slot_word(seq, state);
            assert_eq!(word_state(word), state);
            assert_eq!(u64::from(word >> 2), seq & 0x3FFF_FFFF);
        }
        // The batch wraps at 2^30: two fills of one slot differ unless 2^30 batches apart.
        assert_eq!(slot_word(1 << 30, READY), slot_word(0, READY));
        assert_ne!(slot_word(4, READY), slot_word(8, READY));
        assert_eq!(align(65, 64), 128);
        assert_eq!(align(64, 64), 64);
    }
}
