//! The control and ring segments as a party that attaches reads them: segments with the
//! input's bytes are created in /dev/shm under a name of this process, attached, and every
//! header field an attached party uses is read; then the first batch is taken from its slot
//! when the header says it is ready, and the slot's table and metadata are decoded.
//!
//! Input: a flags byte, the ring's length in 64-byte units (u16), the control segment's length
//! (u16), then the control segment's bytes and the ring's bytes (zero-padded). Flags repair
//! what would stop attach early: bit 0 the magic, bit 1 the layout version, bit 2 the owner
//! pid, bit 3 the ring's length (slot size × slots, when at most 1 MiB), bit 4 the control
//! segment's length.
#![no_main]

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use dataset_rt_fuzz::guarded;
use dataset_rt_loader::batch::{decode_metadata, read_batch, Payload};
use dataset_rt_loader::lifecycle;
use dataset_rt_loader::lifecycle::NAME_PREFIX;
use dataset_rt_shm::layout::*;
use dataset_rt_shm::ring::Role;
use dataset_rt_shm::segment;
use libfuzzer_sys::fuzz_target;

const MAX_LEN: u64 = 1 << 20;

fn u32_at(b: &[u8], at: usize) -> u32 {
    b.get(at..at + 4)
        .map_or(0, |s| u32::from_le_bytes(s.try_into().unwrap()))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    b.get(at..at + 8)
        .map_or(0, |s| u64::from_le_bytes(s.try_into().unwrap()))
}

fn put(b: &mut [u8], at: usize, v: &[u8]) {
    if let Some(d) = b.get_mut(at..at + v.len()) {
        d.copy_from_slice(v);
    }
}

/// Removes both names when dropped, whatever the attach did.
struct Names(String, String);

impl Drop for Names {
    fn drop(&mut self) {
        segment::unlink(&self.0);
        segment::unlink(&self.1);
    }
}

fuzz_target!(|data: &[u8]| {
    guarded(|| {
        let [flags, r0, r1, c0, c1, rest @ ..] = data else {
            return;
        };
        let pid = u64::from(std::process::id());
        let mut ctl_len = u64::from(u16::from_le_bytes([*c0, *c1]));
        let ctl_given = rest.len().min(ctl_len as usize);
        let mut ctl = rest[..ctl_given].to_vec();
        let ring_given = &rest[ctl_given..];
        if flags & 16 != 0 {
            let want = ctl_len_of(&ctl);
            if want <= MAX_LEN {
                ctl_len = want;
            }
        }
        ctl.resize(ctl_len as usize, 0);
        if flags & 1 != 0 {
            put(&mut ctl, C_MAGIC, CTL_MAGIC);
        }
        if flags & 2 != 0 {
            put(&mut ctl, C_VERSION, &LAYOUT_VERSION.to_le_bytes());
        }
        if flags & 4 != 0 {
            put(&mut ctl, C_OWNER_PID, &pid.to_le_bytes());
        }
        let mut ring_len = u64::from(u16::from_le_bytes([*r0, *r1])) * 64;
        if flags & 8 != 0 {
            let want = u64_at(&ctl, C_SLOT_SIZE).checked_mul(u64::from(u32_at(&ctl, C_NUM_SLOTS)));
            if let Some(want) = want.filter(|&w| w <= MAX_LEN) {
                ring_len = want;
            }
        }
        let mut ring = ring_given.to_vec();
        ring.resize(ring_len as usize, 0);

        static N: AtomicU64 = AtomicU64::new(0);
        let stem = format!(
            "{NAME_PREFIX}{pid}-fuzz{}",
            N.fetch_add(1, Ordering::Relaxed)
        );
        let names = Names(format!("{stem}-ctl"), format!("{stem}-ring"));
        std::fs::write(segment::path_of(&names.0), &ctl).expect("write the control segment");
        std::fs::write(segment::path_of(&names.1), &ring).expect("write the ring segment");

        let Ok(r) = lifecycle::attach(&names.0) else {
            return;
        };
        // What attach accepted, every later access relies on.
        let g = r.geometry();
        assert!(g.num_slots > 0 && g.slot_size > 0);
        assert_eq!(r.ring_len(), g.slot_size * u64::from(g.num_slots));
        assert_eq!(r.owner_pid(), pid);
        let pass = r.pass();
        std::hint::black_box((r.error(), r.progress(), r.all_attached()));
        std::hint::black_box(r.stalls(Duration::ZERO));
        std::hint::black_box((r.produced(), r.delivered(), r.producer_pid()));
        // The producer's arithmetic over the pass (producer::fill) stays in range.
        let split = dataset_rt_loader::plan::split_of(&pass);
        assert!(pass.world_size > 0 && pass.rank < pass.world_size);
        assert!(pass.start <= pass.epoch_len);
        assert_eq!(
            pass.rank_samples,
            split.rank_len(pass.epoch_len, pass.start)
        );
        assert!(pass.batch_size > 0);
        let batches = pass.rank_samples.div_ceil(pass.batch_size);
        assert!(pass.total_batches <= batches, "{pass:?}");
        for b in [0, pass.total_batches.saturating_sub(1)] {
            if b < pass.total_batches {
                let k0 = b * pass.batch_size;
                let k1 = (k0 + pass.batch_size).min(pass.rank_samples);
                for k in [k0, k1.saturating_sub(1)] {
                    if k < pass.rank_samples {
                        assert!(
                            split.global_position(pass.epoch_len, pass.start, k) < pass.epoch_len
                        );
                    }
                }
            }
        }
        // A consumer takes batch 0 when its slot says READY, and decodes it.
        if let Ok(true) = r.wait_ready(0, Duration::ZERO, Role::Owner, None) {
            let slot = r.slot(0);
            // Two caches of a few shards: references are checked against these sizes.
            let shard_lens = [vec![4096, 1 << 20], vec![64]];
            if let Ok(entries) = read_batch(slot, 0, &shard_lens) {
                for e in entries {
                    let start = e.meta_off as usize;
                    let meta = &slot[start..start + e.meta_len as usize];
                    std::hint::black_box(decode_metadata(meta).map(|m| m.len()).ok());
                    match e.payload {
                        Payload::Slot { off, len } => {
                            std::hint::black_box(slot[off as usize..(off + len) as usize].len());
                        }
                        Payload::Shard(r) => {
                            let size = shard_lens[e.cache as usize][r.shard as usize];
                            assert!(r.offset + r.len <= size, "{r:?} past {size}");
                        }
                    }
                }
            }
            let _ = r.release(0, None);
        }
    });
});

/// The control segment length its own geometry fields call for.
fn ctl_len_of(ctl: &[u8]) -> u64 {
    ctl_len(u32_at(ctl, C_NUM_SLOTS), u32_at(ctl, C_MAX_CONSUMERS))
}
