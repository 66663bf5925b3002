//! Feeds arbitrary bytes to the store's control-protocol decoder: as a whole frame, and as
//! the body of every frame kind in both directions. It must return an error or a message,
//! never panic or allocate more than the input can justify.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = pagewire_store::fuzzing::decode_frame(data);
    pagewire_store::fuzzing::decode_bodies(data);
});
