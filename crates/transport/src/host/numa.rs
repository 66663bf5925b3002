//! The NUMA node a page of host memory sits on (`move_pages` in query mode).

/// The NUMA node of the page holding `addr`, if the kernel reports one: `None` when the
/// page is not resident, the range is not ordinary memory (device memory, a PFN map), or
/// the kernel has no NUMA support (or a sandbox refuses the call).
///
/// Asked after the registration pinned the pages, so the answer is where they stay.
#[cfg_attr(not(feature = "verbs"), allow(dead_code))]
pub(crate) fn node_of(addr: usize) -> Option<u32> {
    let mut pages = [addr as *mut libc::c_void];
    let mut status: [libc::c_int; 1] = [-1];
    // SAFETY: move_pages(2) with a null `nodes` array only queries: it reads `count` (1)
    // pointers from `pages` and writes `count` ints to `status`, both live local arrays
    // of that length; it moves nothing and never dereferences `addr` on our behalf (an
    // unmapped or odd address yields a negative status, not a fault).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_pages,
            0 as libc::c_long,
            1 as libc::c_ulong,
            pages.as_mut_ptr(),
            std::ptr::null::<libc::c_int>(),
            status.as_mut_ptr(),
            0 as libc::c_int,
        )
    };
    (rc == 0 && status[0] >= 0).then(|| status[0] as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resident_memory_has_a_node_or_none() {
        let v = vec![1u8; 1 << 16];
        // A NUMA kernel says which node (any number it exposes); containers may refuse
        // the call. Either way no panic and no fault.
        if let Some(n) = node_of(v.as_ptr() as usize) {
            assert!(std::path::Path::new(&format!("/sys/devices/system/node/node{n}")).exists());
        }
        assert_eq!(node_of(0), None);
        assert_eq!(node_of(usize::MAX & !0xfff), None);
    }
}
