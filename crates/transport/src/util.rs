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

/// A PCI address in sysfs spelling, `dddd:bb:dd.f` in lower case, from the forms tools
/// print: `0000:3b:00.0`, CUDA's `00000000:3B:00.0`, or `3b:00.0` (domain 0). `None` for
/// anything else.
pub(crate) fn pci_address(s: &str) -> Option<String> {
    let s = s.trim();
    let (rest, func) = s.rsplit_once('.')?;
    let mut parts: Vec<&str> = rest.split(':').collect();
    if parts.len() == 2 {
        parts.insert(0, "0");
    }
    let [dom, bus, dev] = parts[..] else {
        return None;
    };
    let hex = |t: &str, max: u32| {
        (!t.is_empty() && t.len() <= 8)
            .then(|| u32::from_str_radix(t, 16).ok())
            .flatten()
            .filter(|&v| v <= max)
    };
    let (dom, bus, dev, func) = (
        hex(dom, 0xffff)?,
        hex(bus, 0xff)?,
        hex(dev, 0x1f)?,
        hex(func, 7)?,
    );
    Some(format!("{dom:04x}:{bus:02x}:{dev:02x}.{func:x}"))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_addresses_normalise() {
        assert_eq!(pci_address("0000:3b:00.0").as_deref(), Some("0000:3b:00.0"));
        assert_eq!(
            pci_address("00000000:3B:00.0").as_deref(),
            Some("0000:3b:00.0")
        );
        assert_eq!(pci_address(" 3b:1f.7 ").as_deref(), Some("0000:3b:1f.7"));
        assert_eq!(pci_address("10000:00:00.0"), None);
        for bad in [
            "",
            "3b:00",
            "0000:3b:20.0",
            "0000:3b:00.8",
            "x:3b:00.0",
            "0:0:0:0.0",
        ] {
            assert_eq!(pci_address(bad), None, "{bad}");
        }
    }
}
