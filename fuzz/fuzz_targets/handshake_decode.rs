//! Feeds arbitrary bytes to the handshake decoder: as a whole frame, and as the body of
//! every frame kind. It must return an error or a frame, never panic or over-allocate.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = pagewire_transport::fuzzing::decode_handshake(data);
    pagewire_transport::fuzzing::decode_bodies(data);
});
