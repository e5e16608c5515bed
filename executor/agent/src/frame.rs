//! Length-prefixed protobuf framing: u32 big-endian length, then the message.

use std::io::{self, Read, Write};

use prost::Message;

/// Largest frame either side accepts. Data-carrying messages are chunked well
/// below this so a single frame never needs to approach it.
pub const MAX_FRAME: usize = 4 * 1024 * 1024;

/// Payload size used when streaming file data and process output.
pub const CHUNK: usize = 256 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("peer closed the connection")]
    Closed,
    #[error("frame of {len} bytes exceeds the {max} byte limit")]
    TooLarge { len: usize, max: usize },
    #[error("malformed protobuf frame: {0}")]
    Decode(#[from] prost::DecodeError),
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
}

/// Reads one frame's raw bytes. A clean EOF before the length prefix is
/// `Closed`; an EOF inside a frame is an I/O error (truncated frame).
pub fn read_frame_bytes(r: &mut impl Read) -> Result<Vec<u8>, FrameError> {
    let len = read_frame_len(r)?;
    read_frame_body(r, len)
}

/// Reads a frame's length prefix and checks it against [`MAX_FRAME`].
pub fn read_frame_len(r: &mut impl Read) -> Result<usize, FrameError> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match r.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Err(FrameError::Closed),
            Ok(0) => return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(FrameError::TooLarge {
            len,
            max: MAX_FRAME,
        });
    }
    Ok(len)
}

/// Reads the `len` bytes of a frame's body. The buffer grows as bytes arrive, so a peer that
/// announces a large frame and then stalls holds only what it actually sent.
pub fn read_frame_body(r: &mut impl Read, len: usize) -> Result<Vec<u8>, FrameError> {
    let mut buf = Vec::with_capacity(len.min(CHUNK));
    r.take(len as u64).read_to_end(&mut buf)?;
    if buf.len() < len {
        return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
    }
    Ok(buf)
}

pub fn read_message<M: Message + Default>(r: &mut impl Read) -> Result<M, FrameError> {
    let bytes = read_frame_bytes(r)?;
    Ok(M::decode(bytes.as_slice())?)
}

pub fn write_message(w: &mut impl Write, msg: &impl Message) -> Result<(), FrameError> {
    w.write_all(&encode_frame(msg)?)?;
    w.flush()?;
    Ok(())
}

/// One frame: the length prefix, then the message.
pub fn encode_frame(msg: &impl Message) -> Result<Vec<u8>, FrameError> {
    let len = msg.encoded_len();
    if len > MAX_FRAME {
        return Err(FrameError::TooLarge {
            len,
            max: MAX_FRAME,
        });
    }
    let mut buf = Vec::with_capacity(4 + len);
    buf.extend_from_slice(&(len as u32).to_be_bytes());
    msg.encode(&mut buf).expect("Vec has capacity");
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb;

    #[test]
    fn round_trip_and_limits() {
        let msg = pb::Error {
            message: "hi".into(),
            code: 0,
        };
        let mut buf = Vec::new();
        write_message(&mut buf, &msg).unwrap();
        assert_eq!(&buf[..4], &4u32.to_be_bytes());
        let back: pb::Error = read_message(&mut buf.as_slice()).unwrap();
        assert_eq!(back.message, "hi");

        let big = ((MAX_FRAME + 1) as u32).to_be_bytes();
        let err = read_frame_bytes(&mut &big[..]).unwrap_err();
        assert!(matches!(err, FrameError::TooLarge { .. }), "{err}");

        let truncated = [0u8, 0, 0, 9, 1, 2];
        let err = read_frame_bytes(&mut &truncated[..]).unwrap_err();
        assert!(matches!(err, FrameError::Io(_)), "{err}");

        // A frame that announces the maximum but carries 3 bytes is truncated.
        let mut short = (MAX_FRAME as u32).to_be_bytes().to_vec();
        short.extend_from_slice(b"abc");
        let mut r = short.as_slice();
        let len = read_frame_len(&mut r).unwrap();
        assert_eq!(len, MAX_FRAME);
        assert!(matches!(
            read_frame_body(&mut r, len).unwrap_err(),
            FrameError::Io(_)
        ));
        assert!(matches!(
            read_frame_bytes(&mut &[][..]).unwrap_err(),
            FrameError::Closed
        ));
    }
}
