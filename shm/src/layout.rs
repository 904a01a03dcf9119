//! Byte offsets of the control segment and of a ring slot (version 1). `shm/LAYOUT.md` is the
//! specification; this file must agree with it byte for byte. Every integer is little-endian
//! (the only byte order DatasetRT builds for) and naturally aligned.

pub const CTL_MAGIC: &[u8; 8] = b"DRTCTL\0\0";
pub const SLOT_MAGIC: &[u8; 8] = b"DRTBATCH";
pub const LAYOUT_VERSION: u32 = 1;

/// Prefix of every segment name in /dev/shm: `dataset-rt-<owner pid>-<nonce>-{ctl,ring}`.
pub const NAME_PREFIX: &str = "dataset-rt-";
pub const SHM_DIR: &str = "/dev/shm";

pub const PAGE: u64 = 4096;
/// Payloads start on this boundary inside a slot (SIMD loads, `numpy.frombuffer` of any dtype).
pub const PAYLOAD_ALIGN: u64 = 64;

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
pub const C_ERROR_KIND: usize = 52; // u32 atomic: 0 none, 255 being written, else a kind
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
pub const C_POLICY: usize = 152; // u32: 0 pad, 1 drop
pub const C_PRODUCED: usize = 160; // u64 atomic: batches published
pub const C_NEXT_TICKET: usize = 168; // u64 atomic: next batch a consumer takes
pub const C_DELIVERED: usize = 176; // u64 atomic: batches the training loop received
pub const C_POSITION: usize = 184; // u64 atomic: global position after the delivered batches
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

pub const FREE: u32 = 0;
pub const FILLING: u32 = 1;
pub const READY: u32 = 2;
pub const TAKEN: u32 = 3;

pub const ERR_NONE: u32 = 0;
pub const ERR_IO: u32 = 1;
pub const ERR_MALFORMED: u32 = 2;
pub const ERR_CORRUPT_RECORD: u32 = 3;
pub const ERR_BATCH_TOO_LARGE: u32 = 4;
pub const ERR_STATE: u32 = 5;
pub const ERR_OTHER: u32 = 6;
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
/// data_len u64 (offsets from the slot's start).
pub const B_ENTRY_LEN: u64 = 48;

pub const META_BOOL: u8 = 0;
pub const META_INT: u8 = 1;
pub const META_FLOAT: u8 = 2;
pub const META_STR: u8 = 3;

pub fn align(x: u64, to: u64) -> u64 {
    x.div_ceil(to) * to
}
