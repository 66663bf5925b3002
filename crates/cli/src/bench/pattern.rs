//! Seeded byte patterns for `--verify`: the sender fills, the receiver checks.
//!
//! Byte `i` is byte `i % 8` of splitmix64(seed + i / 8), so any shifted, truncated,
//! stale or zero-filled range is caught, and both ends derive it from the seed alone.

use pagewire_transport::HostBuffer;

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The seed for one size of one test: both sides compute the same value.
pub fn seed_for(test: &str, size: u64, direction: u8) -> u64 {
    let t = test.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    splitmix64(t ^ size.rotate_left(17) ^ u64::from(direction) << 56)
}

/// Fills `buf` with the pattern for `seed`, as if it started at pattern offset `base`
/// (a multiple of 8).
pub fn fill_at(buf: &mut [u8], seed: u64, base: u64) {
    debug_assert_eq!(base % 8, 0);
    let word0 = base / 8;
    let full_words = (buf.len() / 8) as u64;
    let mut chunks = buf.chunks_exact_mut(8);
    for (k, c) in (&mut chunks).enumerate() {
        c.copy_from_slice(&splitmix64(seed.wrapping_add(word0 + k as u64)).to_le_bytes());
    }
    let rest = chunks.into_remainder();
    if !rest.is_empty() {
        let w = splitmix64(seed.wrapping_add(word0 + full_words)).to_le_bytes();
        let n = rest.len();
        rest.copy_from_slice(&w[..n]);
    }
}

/// Fills `buf` with the pattern bytes that start at any offset `at` (not only multiples of 8).
pub fn fill_at_byte(buf: &mut [u8], seed: u64, at: u64) {
    let base = at / 8 * 8;
    let skip = (at - base) as usize;
    let mut tmp = vec![0u8; skip + buf.len()];
    fill_at(&mut tmp, seed, base);
    buf.copy_from_slice(&tmp[skip..]);
}

/// Fills `buf` (our own bytes, not a registered buffer) with the pattern from offset 0.
#[cfg(test)]
pub fn fill(buf: &mut [u8], seed: u64) {
    fill_at(buf, seed, 0);
}

/// The first byte that differs from the pattern.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mismatch {
    pub offset: u64,
    pub want: u8,
    pub got: u8,
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "byte {} is {:#04x}, expected {:#04x}",
            self.offset, self.got, self.want
        )
    }
}

/// Checks `buf` against the pattern that [`fill_at`] would write at `base`.
pub fn check_at(buf: &[u8], seed: u64, base: u64) -> Result<(), Mismatch> {
    let word0 = base / 8;
    for (k, c) in buf.chunks(8).enumerate() {
        let w = splitmix64(seed.wrapping_add(word0 + k as u64)).to_le_bytes();
        if c != &w[..c.len()] {
            let j = c
                .iter()
                .zip(w.iter())
                .position(|(a, b)| a != b)
                .expect("chunks differ");
            return Err(Mismatch {
                offset: base + (k * 8 + j) as u64,
                want: w[j],
                got: c[j],
            });
        }
    }
    Ok(())
}

#[cfg(test)]
pub fn check(buf: &[u8], seed: u64) -> Result<(), Mismatch> {
    check_at(buf, seed, 0)
}

/// Bytes moved per copy between a registered buffer and a pattern.
const STEP: usize = 64 << 10;

/// Writes the pattern for `seed` into `buf[at..at + len]` (pattern offset 0 at `at`). A
/// registered buffer is shared with the engine and its peer, so the pattern is made in a
/// small scratch buffer and copied in, never written through a slice of `buf`.
pub fn fill_buf(buf: &mut HostBuffer, at: usize, len: usize, seed: u64) {
    let mut tmp = vec![0u8; STEP.min(len)];
    let mut off = 0;
    while off < len {
        let k = (len - off).min(STEP);
        fill_at(&mut tmp[..k], seed, off as u64);
        buf.write_at(at + off, &tmp[..k]);
        off += k;
    }
}

/// Checks `buf[at..at + len]` against the pattern [`fill_buf`] writes, copying it out
/// piece by piece; offsets in the mismatch count from `at`.
pub fn check_buf(buf: &HostBuffer, at: usize, len: usize, seed: u64) -> Result<(), Mismatch> {
    let mut tmp = vec![0u8; STEP.min(len)];
    let mut off = 0;
    while off < len {
        let k = (len - off).min(STEP);
        buf.read_at(at + off, &mut tmp[..k]);
        check_at(&tmp[..k], seed, off as u64)?;
        off += k;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_then_check_and_detect_a_flip() {
        for len in [1usize, 2, 7, 8, 9, 4096, 65537] {
            let mut b = vec![0u8; len];
            let s = seed_for("write", len as u64, 0);
            fill(&mut b, s);
            assert_eq!(check(&b, s), Ok(()));
            b[len / 2] ^= 1;
            let m = check(&b, s).unwrap_err();
            assert_eq!(m.offset, (len / 2) as u64);
            assert!(check(&vec![0u8; len], s).is_err() || len == 0);
        }
        assert_ne!(seed_for("write", 64, 0), seed_for("write", 64, 1));
        assert_ne!(seed_for("write", 64, 0), seed_for("read", 64, 0));
    }

    #[test]
    fn through_a_host_buffer() {
        let len = 3 * STEP + 13;
        let mut b = HostBuffer::new(len + 100).unwrap();
        fill_buf(&mut b, 100, len, 7);
        let mut plain = vec![0u8; len];
        fill(&mut plain, 7);
        assert_eq!(b.read_vec(100..100 + len), plain);
        assert_eq!(check_buf(&b, 100, len, 7), Ok(()));
        b.write_at(100 + 2 * STEP + 5, &[plain[2 * STEP + 5] ^ 1]);
        let m = check_buf(&b, 100, len, 7).unwrap_err();
        assert_eq!(m.offset, (2 * STEP + 5) as u64);
    }

    #[test]
    fn offsets_compose() {
        let s = 42;
        let mut whole = vec![0u8; 64];
        fill(&mut whole, s);
        assert_eq!(check_at(&whole[16..40], s, 16), Ok(()));
        let mut part = vec![0u8; 24];
        fill_at(&mut part, s, 16);
        assert_eq!(&part[..], &whole[16..40]);
    }
}
