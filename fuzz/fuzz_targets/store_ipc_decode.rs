//! Feeds arbitrary bytes to the decoder of the protocol between a standalone store client
//! and its dummy clients (a local socket, still hostile input): as a whole frame, and as the
//! body of every frame kind in both directions. It must return an error or a message, never
//! panic or allocate more than the input can justify.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = pagewire_store::fuzzing::decode_ipc_frame(data);
    pagewire_store::fuzzing::decode_ipc_bodies(data);
});
