//! Framing: how one message travels on one QUIC stream.
//!
//! A frame is a 12-byte prefix — magic `SY`, wire version, reserved byte, the header's length
//! and the payload's length, little-endian — then the header (postcard) and the payload (raw
//! bytes; `f32` tensors travel as their little-endian bytes, read straight into the tensor's
//! memory). The stream's end (FIN) ends the frame: anything after the payload is an error.
//! Every length is checked against [`Limits`] before any buffer is allocated.
//!
//! [`decode_frame`] is the pure decoder over a whole buffer (fuzzed, and used in tests);
//! [`read_head`] and the `read_payload_*` functions do the same checks while reading from a stream.

use serde::{de::DeserializeOwned, Serialize};

#[cfg(target_endian = "big")]
compile_error!("the wire format sends f32 tensors as their in-memory bytes, which must be little-endian");

/// First two bytes of every frame.
pub const MAGIC: [u8; 2] = *b"SY";
/// Wire format version; bumped on any incompatible change to a message.
pub const WIRE_VERSION: u8 = 1;
/// Bytes before the header.
pub const PREFIX_LEN: usize = 12;

/// The largest frame parts a reader accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest header, in bytes.
    pub max_header: usize,
    /// Largest payload, in bytes.
    pub max_payload: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_header: 1 << 20, max_payload: 1 << 30 }
    }
}

/// A frame that cannot be read. The connection it came on is closed with this text.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The frame does not start with `SY`.
    #[error("not a Syncopate frame (bad magic {0:02x?})")]
    BadMagic([u8; 2]),
    /// The peer speaks another wire version.
    #[error("wire version {got}, this node speaks {WIRE_VERSION}")]
    Version {
        /// The peer's version.
        got: u8,
    },
    /// A length over the limit.
    #[error("{what} of {len} bytes exceeds the limit of {limit} bytes")]
    TooLarge {
        /// Which part.
        what: &'static str,
        /// Its declared length.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// The stream ended inside the frame.
    #[error("truncated frame: the stream ended {missing} bytes early")]
    Truncated {
        /// How many bytes were missing (at least).
        missing: usize,
    },
    /// Bytes after the payload.
    #[error("{0} unexpected bytes after the frame")]
    Trailing(usize),
    /// The header did not decode as the expected message (unknown kind, bad field).
    #[error("malformed {kind} header: {source}")]
    Header {
        /// The message type expected.
        kind: &'static str,
        /// The decoder's error.
        source: postcard::Error,
    },
    /// A tensor payload whose length is not a whole number of `f32`s.
    #[error("tensor payload of {0} bytes is not a whole number of f32 values")]
    Misaligned(usize),
    /// The stream failed.
    #[error("stream error: {0}")]
    Stream(String),
}

/// Encodes a frame prefix and header into `out` (cleared first). The payload is written after
/// it by the caller, without copying it into `out`.
pub fn encode_head<H: Serialize>(header: &H, payload_len: usize, out: &mut Vec<u8>) {
    out.clear();
    out.extend_from_slice(&[0; PREFIX_LEN]);
    // Serializing our own message types into a Vec cannot fail.
    let mut buf = std::mem::take(out);
    buf = postcard::to_extend(header, buf).expect("postcard encodes into a Vec");
    *out = buf;
    let header_len = (out.len() - PREFIX_LEN) as u32;
    let payload_len = u32::try_from(payload_len).expect("payloads are under 4 GiB");
    out[0..2].copy_from_slice(&MAGIC);
    out[2] = WIRE_VERSION;
    out[3] = 0;
    out[4..8].copy_from_slice(&header_len.to_le_bytes());
    out[8..12].copy_from_slice(&payload_len.to_le_bytes());
}

/// A whole frame in one buffer (tests, tools and small messages).
pub fn encode_frame<H: Serialize>(header: &H, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    encode_head(header, payload.len(), &mut out);
    out.extend_from_slice(payload);
    out
}

/// Checks a frame prefix; returns the header and payload lengths.
pub fn parse_prefix(prefix: &[u8; PREFIX_LEN], limits: &Limits) -> Result<(usize, usize), WireError> {
    let magic = [prefix[0], prefix[1]];
    if magic != MAGIC {
        return Err(WireError::BadMagic(magic));
    }
    if prefix[2] != WIRE_VERSION {
        return Err(WireError::Version { got: prefix[2] });
    }
    let header = u32::from_le_bytes(prefix[4..8].try_into().expect("4 bytes")) as usize;
    let payload = u32::from_le_bytes(prefix[8..12].try_into().expect("4 bytes")) as usize;
    if header > limits.max_header {
        return Err(WireError::TooLarge { what: "header", len: header, limit: limits.max_header });
    }
    if payload > limits.max_payload {
        return Err(WireError::TooLarge { what: "payload", len: payload, limit: limits.max_payload });
    }
    Ok((header, payload))
}

/// Decodes a header of type `H`, which must use every byte.
pub fn decode_header<H: DeserializeOwned>(bytes: &[u8]) -> Result<H, WireError> {
    let kind = std::any::type_name::<H>().rsplit("::").next().unwrap_or("message");
    let (h, rest) = postcard::take_from_bytes(bytes).map_err(|source| WireError::Header { kind, source })?;
    if !rest.is_empty() {
        return Err(WireError::Trailing(rest.len()));
    }
    Ok(h)
}

/// Decodes a whole frame held in `bytes`: the header and the payload's bytes.
pub fn decode_frame<'a, H: DeserializeOwned>(
    bytes: &'a [u8],
    limits: &Limits,
) -> Result<(H, &'a [u8]), WireError> {
    let prefix: &[u8; PREFIX_LEN] = bytes
        .get(..PREFIX_LEN)
        .and_then(|p| p.try_into().ok())
        .ok_or(WireError::Truncated { missing: PREFIX_LEN - bytes.len().min(PREFIX_LEN) })?;
    let (header_len, payload_len) = parse_prefix(prefix, limits)?;
    let body = &bytes[PREFIX_LEN..];
    let total = header_len + payload_len;
    if body.len() < total {
        return Err(WireError::Truncated { missing: total - body.len() });
    }
    if body.len() > total {
        return Err(WireError::Trailing(body.len() - total));
    }
    let header = decode_header(&body[..header_len])?;
    Ok((header, &body[header_len..]))
}

/// Views a tensor as the bytes that travel.
pub fn f32_bytes(values: &[f32]) -> &[u8] {
    bytemuck::cast_slice(values)
}

/// Copies a payload into a tensor (for payloads already in memory).
pub fn f32_from_bytes(bytes: &[u8]) -> Result<Vec<f32>, WireError> {
    if !bytes.len().is_multiple_of(4) {
        return Err(WireError::Misaligned(bytes.len()));
    }
    let mut v = vec![0f32; bytes.len() / 4];
    bytemuck::cast_slice_mut(&mut v).copy_from_slice(bytes);
    Ok(v)
}

/// A frame read from a stream: its header and where its payload is.
#[derive(Debug)]
pub struct Incoming<H> {
    /// The header.
    pub header: H,
    /// Payload length in bytes, not yet read.
    pub payload_len: usize,
}

fn read_err(e: quinn::ReadExactError) -> WireError {
    match e {
        quinn::ReadExactError::FinishedEarly(read) => WireError::Truncated { missing: read.max(1) },
        quinn::ReadExactError::ReadError(e) => WireError::Stream(e.to_string()),
    }
}

/// Reads a frame's prefix and header from `recv`. `scratch` is reused for the header bytes. The
/// payload is read next with [`read_payload_into`] (sized by [`f32_count`]) or
/// [`read_payload_bytes`], then [`expect_end`].
pub async fn read_head<H: DeserializeOwned>(
    recv: &mut quinn::RecvStream,
    limits: &Limits,
    scratch: &mut Vec<u8>,
) -> Result<Incoming<H>, WireError> {
    let mut prefix = [0u8; PREFIX_LEN];
    recv.read_exact(&mut prefix).await.map_err(read_err)?;
    let (header_len, payload_len) = parse_prefix(&prefix, limits)?;
    scratch.clear();
    scratch.resize(header_len, 0);
    recv.read_exact(scratch).await.map_err(read_err)?;
    let header = decode_header(scratch)?;
    Ok(Incoming { header, payload_len })
}

/// How many `f32` values a payload of `len` bytes holds.
pub fn f32_count(len: usize) -> Result<usize, WireError> {
    if !len.is_multiple_of(4) {
        return Err(WireError::Misaligned(len));
    }
    Ok(len / 4)
}

/// Reads a payload of `len` bytes straight into `out`, which must be exactly as long.
pub async fn read_payload_into(
    recv: &mut quinn::RecvStream,
    len: usize,
    out: &mut [f32],
) -> Result<(), WireError> {
    if len != out.len() * 4 {
        return Err(WireError::Stream(format!("expected a tensor of {} values, got {len} bytes", out.len())));
    }
    recv.read_exact(bytemuck::cast_slice_mut(out)).await.map_err(read_err)
}

/// Reads a payload of `len` bytes.
pub async fn read_payload_bytes(recv: &mut quinn::RecvStream, len: usize) -> Result<Vec<u8>, WireError> {
    let mut v = vec![0u8; len];
    recv.read_exact(&mut v).await.map_err(read_err)?;
    Ok(v)
}

/// Checks that the stream ends here.
pub async fn expect_end(recv: &mut quinn::RecvStream) -> Result<(), WireError> {
    match recv.read_chunk(64, true).await {
        Ok(None) => Ok(()),
        Ok(Some(chunk)) => Err(WireError::Trailing(chunk.bytes.len())),
        Err(e) => Err(WireError::Stream(e.to_string())),
    }
}

/// Reads a whole frame with a payload that the caller discards or does not expect.
pub async fn read_message<H: DeserializeOwned>(
    recv: &mut quinn::RecvStream,
    limits: &Limits,
) -> Result<(H, Vec<u8>), WireError> {
    let mut scratch = Vec::new();
    let head = read_head::<H>(recv, limits, &mut scratch).await?;
    let payload = read_payload_bytes(recv, head.payload_len).await?;
    expect_end(recv).await?;
    Ok((head.header, payload))
}

/// A frame's payload, as the writer holds it.
#[derive(Clone, Debug)]
pub enum Payload<'a> {
    /// Bytes the caller keeps: QUIC copies them into its send buffer.
    Borrowed(&'a [u8]),
    /// A buffer handed over: QUIC sends it as it is and drops it once the peer has it.
    Shared(bytes::Bytes),
}

impl Payload<'_> {
    /// No payload.
    pub const EMPTY: Payload<'static> = Payload::Borrowed(&[]);

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        match self {
            Payload::Borrowed(b) => b,
            Payload::Shared(b) => b,
        }
    }

    /// Bytes `range` of it, shared again rather than copied when it is shared.
    pub fn slice(&self, range: std::ops::Range<usize>) -> Payload<'_> {
        match self {
            Payload::Borrowed(b) => Payload::Borrowed(&b[range]),
            Payload::Shared(b) => Payload::Shared(b.slice(range)),
        }
    }
}

impl<'a> From<&'a [u8]> for Payload<'a> {
    fn from(bytes: &'a [u8]) -> Self {
        Payload::Borrowed(bytes)
    }
}

impl From<bytes::Bytes> for Payload<'_> {
    fn from(bytes: bytes::Bytes) -> Self {
        Payload::Shared(bytes)
    }
}

/// Payloads up to this size leave in one write with their header (one copy of a few bytes
/// beats a second write).
const COALESCE: usize = 16 * 1024;

/// Writes a frame (header, then payload) and finishes the stream. A shared payload goes to QUIC
/// without a copy.
pub async fn write_frame<H: Serialize>(
    send: &mut quinn::SendStream,
    header: &H,
    payload: Payload<'_>,
    scratch: &mut Vec<u8>,
) -> Result<(), WireError> {
    write_frame_open(send, header, payload, scratch).await?;
    send.finish().map_err(|e| WireError::Stream(e.to_string()))
}

/// Writes a frame and leaves the stream open for more (a stream of frames, such as a shard's
/// replication stream; the reader takes each with [`read_head`] and its payload).
pub async fn write_frame_open<H: Serialize>(
    send: &mut quinn::SendStream,
    header: &H,
    payload: Payload<'_>,
    scratch: &mut Vec<u8>,
) -> Result<(), WireError> {
    let stream = |e: quinn::WriteError| WireError::Stream(e.to_string());
    let bytes = payload.as_slice();
    encode_head(header, bytes.len(), scratch);
    if bytes.len() <= COALESCE {
        scratch.extend_from_slice(bytes);
        send.write_all(scratch).await.map_err(stream)?;
    } else {
        send.write_all(scratch).await.map_err(stream)?;
        match payload {
            Payload::Borrowed(b) => send.write_all(b).await.map_err(stream)?,
            Payload::Shared(b) => send.write_chunk(b).await.map_err(stream)?,
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_reject_damage() {
        let limits = Limits::default();
        let payload = f32_bytes(&[1.0, -2.5]).to_vec();
        let frame = encode_frame(&(7u32, String::from("x")), &payload);
        let (h, p): ((u32, String), &[u8]) = decode_frame(&frame, &limits).unwrap();
        assert_eq!(h, (7, "x".to_string()));
        assert_eq!(f32_from_bytes(p).unwrap(), vec![1.0, -2.5]);
        assert!(matches!(
            decode_frame::<(u32, String)>(&frame[..frame.len() - 1], &limits),
            Err(WireError::Truncated { missing: 1 })
        ));
        let mut long = frame.clone();
        long.push(0);
        assert!(matches!(decode_frame::<(u32, String)>(&long, &limits), Err(WireError::Trailing(1))));
        let mut bad = frame.clone();
        bad[0] = b'X';
        assert!(matches!(decode_frame::<(u32, String)>(&bad, &limits), Err(WireError::BadMagic(_))));
        let tight = Limits { max_header: 1, max_payload: 1 << 20 };
        assert!(matches!(decode_frame::<(u32, String)>(&frame, &tight), Err(WireError::TooLarge { .. })));
    }
}
