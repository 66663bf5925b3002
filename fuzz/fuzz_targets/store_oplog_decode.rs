//! Feeds arbitrary bytes to the decoder of the store's op-log batches (read back from
//! etcd, which anyone with access to it can write), then applies what decodes to an empty
//! master core. It must return an error or records, never panic or allocate more than the
//! input can justify.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = pagewire_store::fuzzing::decode_oplog(data);
});
