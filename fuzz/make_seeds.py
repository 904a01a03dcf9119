"""Writes the seed corpus of the fuzz targets into fuzz/corpus/<target>/ (committed; rerun only
when a target's input format changes). Uses the golden cache and the stdlib only."""

from __future__ import annotations

import struct
from pathlib import Path

HERE = Path(__file__).resolve().parent
GOLDEN = HERE.parent / "tests" / "data" / "golden_v1" / "golden"
CORPUS = HERE / "corpus"


def seed(target: str, name: str, data: bytes) -> None:
    d = CORPUS / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data)


def manifest() -> None:
    text = (GOLDEN / "manifest.json").read_bytes()
    seed("manifest", "golden", b"\x00" + text)
    seed("manifest", "golden-resigned-full", b"\x03" + text)


def metadata_arrow() -> None:
    # Schema 0 is the golden cache's; 6 rows.
    seed("metadata_arrow", "golden", b"\x00\x06" + (GOLDEN / "metadata.arrow").read_bytes())


def cache_resigned() -> None:
    # start selector (u16 LE), keep flags, then no damage: the fuzzer adds it.
    for sel in (0x0B, 0x1D, 0x2E, 0x3C, 0x4F, 0x9B, 0xDF, 256):
        seed("cache_resigned", f"start-{sel:03x}", struct.pack("<HB", sel, 0))


STATE = (
    '{"format_version":1,"sampler_version":3,"fingerprint":"@FP@",'
    '"weights_fingerprint":"@WFP@","seed":7,"shuffle":%s,"epoch_len":%d,"epoch":%d,'
    '"position":%d,"rank":%d,"world_size":%d}'
)


def state_json() -> None:
    # flags: bit 0 shuffle, bits 1-2 epoch length (6 = all, 1, 4, 13), bit 3 drop, bit 4 weights.
    cases = [
        ("plain", 0x00, 0x00, ("false", 6, 0, 3, 0, 1)),
        ("shuffled-13", 0x07, 0x11, ("true", 13, 2, 5, 1, 2)),
        ("weighted-drop", 0x18 | 0x04, 0x23, ("false", 4, 9, 4, 2, 4)),
    ]
    for name, flags, ranks, values in cases:
        seed("state_json", name, bytes([flags, ranks]) + (STATE % values).encode())


def ring_attach() -> None:
    # A control segment as Ring::create writes it (LAYOUT.md), 2 slots of one page, batch 0
    # READY, and the batch in slot 0 as write_batch lays it out.
    num_slots, slot_size, consumers = 2, 4096, 1
    ctl = bytearray(4096)

    def put(fmt: str, at: int, *v: int) -> None:
        struct.pack_into("<" + fmt, ctl, at, *v)

    ctl[0:8] = b"DRTCTL\0\0"
    put("I", 8, 2)  # layout version
    put("I", 12, num_slots)
    put("Q", 16, slot_size)
    put("Q", 24, slot_size * num_slots)
    put("I", 32, consumers)
    put("I", 40, 2)  # expected attach
    # owner pid at 64 is repaired by the flags
    put("Q", 88, 2)  # total batches
    put("Q", 96, 2)  # batch size
    put("Q", 104, 4)  # rank samples
    put("Q", 128, 4)  # epoch length
    put("Q", 144, 1)  # world size
    put("Q", 160, 1)  # produced
    put("I", 1280, 2)  # slot 0: batch 0 READY
    slot = bytearray(slot_size)
    meta = struct.pack("<IH", 1, 5) + b"label" + b"\x01" + struct.pack("<q", -3)
    meta_at, data_at = 64 + 56, 256
    data = b"payload!"
    used = data_at + len(data)
    slot[0:8] = b"DRTBATCH"
    struct.pack_into("<QIIQ", slot, 8, 0, 1, 2, used)
    # The payload in the slot (kind 0, shard 0).
    struct.pack_into("<QIIQQQQII", slot, 64, 7, 0, len(meta), 7, meta_at, data_at, len(data), 0, 0)
    slot[meta_at : meta_at + len(meta)] = meta
    slot[data_at:used] = data
    ring = bytes(slot) + bytes(slot_size)
    head = struct.pack("<BHH", 0x1F, len(ring) // 64, len(ctl))
    seed("ring_attach", "one-batch", head + bytes(ctl) + ring[:used])


if __name__ == "__main__":
    manifest()
    metadata_arrow()
    cache_resigned()
    state_json()
    ring_attach()
