//! Is a caller's `(address, length)` ordinary, readable and writable memory of this
//! process?
//!
//! The TCP and loopback backends move bytes with the CPU, so registering a pointer that
//! is not mapped (a stale or made-up address) or not host memory (a GPU pointer, mapped
//! `---p` in the host) would crash a transport thread at the first transfer instead of
//! failing the registration. C and Python callers can pass any integer, so the range is
//! checked against `/proc/self/maps` once, at registration (which is rare: the file is
//! read once per call).

/// `Ok` when every byte of `[addr, addr + len)` lies in mappings that are readable and
/// writable, with no gap; otherwise says which address is not. `len == 0` is `Ok`.
pub fn check_host_rw(addr: u64, len: u64) -> Result<(), String> {
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
        let Some((lo, hi, perms)) = parse_line(line) else {
            continue;
        };
        if hi <= cursor {
            continue;
        }
        if lo > cursor {
            return Err(format!("address {cursor:#x} is not mapped"));
        }
        if !perms.starts_with("rw") {
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

fn parse_line(line: &str) -> Option<(u64, u64, &str)> {
    let mut it = line.split_ascii_whitespace();
    let (lo, hi) = it.next()?.split_once('-')?;
    let perms = it.next()?;
    Some((
        u64::from_str_radix(lo, 16).ok()?,
        u64::from_str_radix(hi, 16).ok()?,
        perms,
    ))
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
        assert_eq!(
            parse_line("7f00-7f10 rw-p 00000000 00:00 0"),
            Some((0x7f00, 0x7f10, "rw-p"))
        );
    }

    #[test]
    fn this_process() {
        let v = vec![1u8; 3 << 20];
        assert!(check_host_rw(v.as_ptr() as u64, v.len() as u64).is_ok());
        assert!(check_host_rw(0, 4096).is_err());
        assert!(check_host_rw(8, 8).is_err());
        assert!(check_host_rw(u64::MAX - 10, 100).is_err());
        // Code is mapped r-x: not writable.
        let f = check_host_rw as fn(u64, u64) -> Result<(), String>;
        assert!(check_host_rw(f as usize as u64, 16).is_err());
    }
}
