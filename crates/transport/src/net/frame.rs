//! Control-plane frames over a stream: `core::wire` encodes and decodes bytes, this reads
//! and writes them (the header first, so the body's length is checked before anything is
//! allocated).

use std::io::{Read, Write};

use crate::core::wire::{Frame, HEADER_LEN, decode_body, decode_header};
use crate::error::HandshakeError;

/// Writes a frame.
pub(crate) fn write_frame(w: &mut impl Write, f: &Frame) -> Result<(), HandshakeError> {
    w.write_all(&f.encode())?;
    w.flush()?;
    Ok(())
}

/// Reads one frame, validating the header before reading (or allocating) the body.
pub(crate) fn read_frame(r: &mut impl Read, max: u32) -> Result<Frame, HandshakeError> {
    let mut h = [0u8; HEADER_LEN];
    r.read_exact(&mut h)?;
    let header = decode_header(&h, max)?;
    let mut body = vec![0u8; header.len as usize];
    r.read_exact(&mut body)?;
    decode_body(header.kind, &body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_written_frame_reads_back() {
        let mut buf = Vec::new();
        write_frame(&mut buf, &Frame::Ready).unwrap();
        let mut cur = std::io::Cursor::new(buf);
        assert_eq!(read_frame(&mut cur, 1 << 20).unwrap(), Frame::Ready);
    }
}
