//! pagewire's C ABI: `libtransfer_engine.so`.
//!
//! One library, two headers (both in `crates/capi/include/`):
//!
//! * `transfer_engine_c.h`: the 27 functions of Mooncake's Transfer Engine C API with
//!   Mooncake's types, byte for byte, so that programs built against Mooncake (NIXL's
//!   Mooncake backend links `-ltransfer_engine`) run on pagewire unchanged. Mooncake's
//!   return conventions are kept; what Mooncake leaves undefined (an unknown, freed or
//!   `INVALID_BATCH` batch id, a null pointer, a use before creation) returns an error
//!   here. Segment names are `host:port` of the peer engine (P2P handshake).
//! * `pagewire.h`: pagewire's own API, with opaque handles (engine, region, peer, batch),
//!   the layout functions, and errors as an enum plus a message.
//!
//! Every handle is a table index with a generation, never a pointer, and every entry
//! point catches panics, so no input from C can make the library dereference freed
//! memory or unwind into C. See `docs/c-api.md` for the function table and a C example.
//!
//! The functions are plain `extern "C"` and can be called from Rust too, which is what
//! this example does (C programs do the same through the header):
//!
//! ```
//! use std::ffi::{CStr, c_char};
//! use transfer_engine::mooncake::*;
//!
//! // SAFETY: every pointer passed below is valid for the call, and `pool` outlives its
//! // registration.
//! unsafe {
//!     let (meta, host) = (c"P2PHANDSHAKE", c"127.0.0.1");
//!     let a = createTransferEngine(meta.as_ptr(), host.as_ptr(), c"".as_ptr(), 0, 1);
//!     let b = createTransferEngine(meta.as_ptr(), host.as_ptr(), c"".as_ptr(), 0, 1);
//!     assert!(!a.is_null() && !b.is_null());
//!
//!     // b exposes a pool; a opens b's segment by its "host:port" name.
//!     let mut pool = vec![0u8; 1 << 16];
//!     assert_eq!(registerLocalMemory(b, pool.as_mut_ptr().cast(), pool.len(), c"*".as_ptr(), 1), 0);
//!     let mut name = [0 as c_char; 64];
//!     assert_eq!(getLocalIpAndPort(b, name.as_mut_ptr(), name.len()), 0);
//!     let seg = openSegment(a, name.as_ptr());
//!     assert!(seg > 0, "{:?}", CStr::from_ptr(name.as_ptr()));
//!
//!     let mut src = b"pagewire".to_vec();
//!     assert_eq!(registerLocalMemory(a, src.as_mut_ptr().cast(), src.len(), c"*".as_ptr(), 0), 0);
//!     let batch = allocateBatchID(a, 4);
//!     assert_ne!(batch, INVALID_BATCH);
//!     let mut req = transfer_request {
//!         opcode: OPCODE_WRITE,
//!         source: src.as_mut_ptr().cast(),
//!         target_id: seg,
//!         target_offset: pool.as_ptr() as u64 + 100,
//!         length: src.len() as u64,
//!     };
//!     assert_eq!(submitTransfer(a, batch, &mut req, 1), 0);
//!     let mut st = transfer_status { status: 0, transferred_bytes: 0 };
//!     loop {
//!         assert_eq!(getTransferStatus(a, batch, 0, &mut st), 0);
//!         if st.status != STATUS_WAITING && st.status != STATUS_PENDING {
//!             break;
//!         }
//!         std::thread::yield_now();
//!     }
//!     assert_eq!(st.status, STATUS_COMPLETED);
//!     assert_eq!(freeBatchID(a, batch), 0);
//!     // Freed (or never issued) ids are errors, not crashes.
//!     assert_ne!(getTransferStatus(a, batch, 0, &mut st), 0);
//!     assert_ne!(freeBatchID(a, INVALID_BATCH), 0);
//!
//!     destroyTransferEngine(a);
//!     destroyTransferEngine(b);
//!     assert_eq!(&pool[100..108], b"pagewire");
//! }
//! ```

mod handles;
mod native;

pub mod ffi;

pub use ffi::mooncake;
pub use ffi::pagewire;

use std::cell::RefCell;
use std::ffi::CString;

thread_local! {
    /// The text of the last failure on this thread (`pw_last_error`).
    static LAST_ERROR: RefCell<Option<CString>> = const { RefCell::new(None) };
}

/// Records `msg` as this thread's last error.
pub(crate) fn set_last_error(msg: impl std::fmt::Display) {
    let text = msg.to_string().replace('\0', " ");
    let c = CString::new(text).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = Some(c));
}

/// Forgets this thread's last error (at the start of every entry point).
pub(crate) fn clear_last_error() {
    LAST_ERROR.with(|e| *e.borrow_mut() = None);
}

/// Whether a failure was recorded since the last `clear_last_error`.
pub(crate) fn has_last_error() -> bool {
    LAST_ERROR.with(|e| e.borrow().is_some())
}

/// Runs `f` with this thread's last error text (`None` when there is none).
pub(crate) fn with_last_error<R>(f: impl FnOnce(Option<&CString>) -> R) -> R {
    LAST_ERROR.with(|e| f(e.borrow().as_ref()))
}
