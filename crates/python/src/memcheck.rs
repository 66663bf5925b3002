//! Is a raw `(address, length)` from Python really writable memory of this process?
//!
//! A registered region is written by the engine's own threads (TCP, loopback) or by the
//! NIC (verbs). An integer that does not point at writable memory (a typo, a freed
//! buffer, a GPU pointer in a build without GPU support) would make the first incoming
//! WRITE crash the process instead of failing the registration, so raw addresses are
//! checked against `/proc/self/maps` before they are registered. Registration is rare;
//! the file is read once per call.

/// `Ok` when every byte of `[addr, addr + len)` lies in mappings that are readable and
/// writable; otherwise says which part is not.
pub(crate) fn check_writable(addr: u64, len: u64) -> Result<(), String> {
    let end = addr
        .checked_add(len)
        .ok_or_else(|| format!("range {addr:#x}+{len} overflows"))?;
    if len == 0 {
        return Ok(());
    }
    let maps = std::fs::read_to_string("/proc/self/maps")
        .map_err(|e| format!("cannot read /proc/self/maps to check the range: {e}"))?;
    check_in(&maps, addr, end)
}

/// The check against the text of a maps file (separate for the unit tests).
fn check_in(maps: &str, addr: u64, end: u64) -> Result<(), String> {
    let mut cursor = addr;
    // The file is sorted by address; walk the mappings that cover the range in order.
    for line in maps.lines() {
        let mut fields = line.split_ascii_whitespace();
        let (Some(range), Some(perms)) = (fields.next(), fields.next()) else {
            continue;
        };
        let Some((lo, hi)) = range.split_once('-') else {
            continue;
        };
        let (Ok(lo), Ok(hi)) = (u64::from_str_radix(lo, 16), u64::from_str_radix(hi, 16)) else {
            continue;
        };
        if hi <= cursor {
            continue;
        }
        if lo > cursor {
            return Err(format!("address {cursor:#x} is not mapped"));
        }
        let p = perms.as_bytes();
        if p.len() < 2 || p[0] != b'r' || p[1] != b'w' {
            return Err(format!(
                "address {cursor:#x} is in a mapping without read/write access ({perms})"
            ));
        }
        cursor = hi;
        if cursor >= end {
            return Ok(());
        }
    }
    Err(format!("address {cursor:#x} is not mapped"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
00400000-00452000 r-xp 00000000 08:02 173521 /usr/bin/x
7f0000000000-7f0000002000 rw-p 00000000 00:00 0
7f0000002000-7f0000004000 rw-p 00000000 00:00 0
7f0000005000-7f0000006000 ---p 00000000 00:00 0
";

    #[test]
    fn covered_by_adjacent_writable_mappings() {
        assert!(check_in(MAPS, 0x7f00_0000_0000, 0x7f00_0000_4000).is_ok());
        assert!(check_in(MAPS, 0x7f00_0000_1000, 0x7f00_0000_3000).is_ok());
    }

    #[test]
    fn gaps_read_only_and_protected_are_refused() {
        assert!(check_in(MAPS, 0x7f00_0000_3000, 0x7f00_0000_5000).is_err()); // gap
        assert!(check_in(MAPS, 0x0040_0000, 0x0040_1000).is_err()); // r-x
        assert!(check_in(MAPS, 0x7f00_0000_5000, 0x7f00_0000_5800).is_err()); // ---
        assert!(check_in(MAPS, 0x10, 0x20).is_err()); // below everything
        assert!(check_in(MAPS, 0x7fff_0000_0000, 0x7fff_0000_1000).is_err()); // above
    }

    #[test]
    fn own_heap_is_writable() {
        let v = vec![0u8; 1 << 16];
        assert!(check_writable(v.as_ptr() as u64, v.len() as u64).is_ok());
        assert!(check_writable(8, 8).is_err());
    }
}
