//! Is a caller's range ordinary, readable and writable memory of this process?
//!
//! The TCP and loopback backends move bytes with the CPU, so registering a pointer that
//! is not mapped (a stale or made-up address) or not host memory (a GPU pointer, mapped
//! `---p` in the host) would crash a transport thread at the first transfer. A C caller
//! can pass anything, so the C ABI checks the range against `/proc/self/maps` once, at
//! registration, and refuses it there.

use std::io::{BufRead, BufReader};

/// Whether `[addr, addr+len)` lies in mappings that are readable and writable, with no
/// gap. `len > 0`; errors reading the maps count as "no".
pub(crate) fn is_host_rw(addr: u64, len: u64) -> bool {
    let Some(end) = addr.checked_add(len) else {
        return false;
    };
    let Ok(f) = std::fs::File::open("/proc/self/maps") else {
        return false;
    };
    let mut covered = addr;
    for line in BufReader::new(f).lines() {
        let Ok(line) = line else { return false };
        let Some((lo, hi, perms)) = parse(&line) else {
            continue;
        };
        // Mappings are listed in address order.
        if hi <= covered {
            continue;
        }
        if lo > covered || !perms.starts_with("rw") {
            return false;
        }
        covered = hi;
        if covered >= end {
            return true;
        }
    }
    false
}

fn parse(line: &str) -> Option<(u64, u64, &str)> {
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

    #[test]
    fn heap_yes_null_and_text_no() {
        let v = vec![1u8; 3 << 20];
        assert!(is_host_rw(v.as_ptr() as u64, v.len() as u64));
        assert!(!is_host_rw(0, 4096));
        assert!(!is_host_rw(u64::MAX - 10, 100));
        // Code is mapped r-x: not writable.
        let f = is_host_rw as fn(u64, u64) -> bool;
        assert!(!is_host_rw(f as usize as u64, 16));
        assert_eq!(
            parse("7f00-7f10 rw-p 00000000 00:00 0"),
            Some((0x7f00, 0x7f10, "rw-p"))
        );
    }
}
