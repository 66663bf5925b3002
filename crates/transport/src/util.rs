//! Small helpers with no home of their own: lock recovery, the token compare, random
//! numbers and size parsing (one copy each). Imports only std.

use std::io::Read;

/// Locks `m`, recovering the guard of a poisoned mutex: a panic on one thread must not
/// wedge every later caller.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Constant-time comparison (the token is a secret).
pub(crate) fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// 64 random bits from the OS (falls back to std's randomly keyed hasher).
pub(crate) fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .is_ok()
    {
        return u64::from_le_bytes(b);
    }
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

/// A random 24-bit packet sequence number (verbs QPs).
#[cfg_attr(not(feature = "verbs"), allow(dead_code))] // verbs QPs only
pub(crate) fn random_psn() -> u32 {
    (random_u64() & 0x00ff_ffff) as u32
}

/// Parses `4096`, `64K`, `1M`, `2G` (powers of 1024); `Err` says what is expected.
pub(crate) fn parse_size(v: &str) -> Result<u64, &'static str> {
    let t = v.trim();
    let (num, mul) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let mul: u64 = match c.to_ascii_uppercase() {
                'K' => 1 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                _ => return Err("size suffix must be K, M or G"),
            };
            (&t[..i], mul)
        }
        _ => (t, 1),
    };
    let n: u64 = num
        .trim()
        .parse()
        .map_err(|_| "expected a size like 4096, 64K, 1M")?;
    n.checked_mul(mul).ok_or("size overflows u64")
}
