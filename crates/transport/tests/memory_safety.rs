//! What the engine promises about memory, deadlines and errors, each checked through the
//! public API by attacking it the way a hostile peer or a careless application would:
//!
//! * `HostBuffer::new` refuses lengths it cannot allocate (no wrapped size).

use pagewire_transport::{Error, HostBuffer};

// ----------------------------------------------------------------- HostBuffer::new

/// Issue 19, defect 1: a length whose page-rounded size overflows (or is not a valid
/// layout) is an error, never a buffer whose `len()` exceeds its allocation.
#[test]
fn host_buffer_new_refuses_impossible_lengths() {
    let align = HostBuffer::ALIGN;
    for len in [
        usize::MAX,
        usize::MAX - 1,
        usize::MAX - align + 2,
        usize::MAX - align + 1,
        usize::MAX - 2 * align,
        isize::MAX as usize,
        isize::MAX as usize - align + 2,
        isize::MAX as usize + 1,
    ] {
        match HostBuffer::new(len) {
            Err(Error::InvalidRange { .. }) | Err(Error::Registration { .. }) => {}
            Err(e) => panic!("HostBuffer::new({len:#x}): unexpected error {e}"),
            Ok(b) => panic!(
                "HostBuffer::new({len:#x}) returned a buffer of len {:#x}",
                b.len()
            ),
        }
    }
    // Large but representable: refused by the allocator, or allocated for real.
    if let Ok(b) = HostBuffer::new(1 << 40) {
        assert_eq!(b.len(), 1 << 40);
    }
    assert!(matches!(
        HostBuffer::new(0),
        Err(Error::InvalidRange { .. })
    ));
    assert_eq!(HostBuffer::new(1).expect("one byte").len(), 1);
}
