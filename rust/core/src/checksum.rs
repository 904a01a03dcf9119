//! The checksums of the format: xxh3-64 over bytes, written as 16 hex digits. A leaf module (it
//! imports nothing of this crate), so that both the format and the files written with a running
//! checksum (`hashed_file`) use it without importing each other.

use xxhash_rust::xxh3::xxh3_64;

pub const CHECKSUM_ALGO: &str = "xxh3-64";

pub fn checksum_hex(value: u64) -> String {
    format!("{value:016x}")
}

pub fn hash_bytes(bytes: &[u8]) -> u64 {
    xxh3_64(bytes)
}
