//! Lets clients that name the socket's path as `:authority` talk to the
//! plugin.
//!
//! Over a Unix socket there is no host to name, and clients disagree on
//! what to send: the kubelet (since Kubernetes 1.26) and grpc-go send
//! `localhost`, while gRPC's C core (Python's grpcio, and grpc-java, older
//! grpcurl) send the socket's path, plain or percent-encoded. hyper's HTTP/2
//! server (h2, under tonic) refuses the latter as a malformed request
//! (RST_STREAM, PROTOCOL_ERROR) before any service sees it, and has no
//! setting to accept it.
//!
//! So each connection of the plugin's socket goes through `FixAuthority`,
//! which rewrites the client's HTTP/2 header blocks on their way in: each
//! block is decoded with the client's HPACK state, an `:authority` that is
//! not a valid authority becomes `localhost`, and the block is encoded
//! again as literals that leave h2's dynamic table empty (so its state can
//! never disagree with the client's, which only this layer tracks). Every
//! other frame, and everything the server sends, passes untouched.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use loona_hpack::Decoder;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::codegen::http::uri::Authority;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// What the server (h2's defaults, which the plugin keeps) accepts as a
/// frame: SETTINGS_MAX_FRAME_SIZE. It also bounds what is held per
/// connection.
const MAX_FRAME: usize = 16_384;
/// The largest dynamic table a client may ask for. The server advertises
/// no SETTINGS_HEADER_TABLE_SIZE, so clients keep to the default 4096; a
/// little slack costs nothing.
const MAX_TABLE: usize = 65_536;
/// The largest header block (HEADERS and its CONTINUATIONs) held while it
/// is incomplete: far beyond what a gRPC call sends, and h2 would refuse
/// more than 16 KiB of headers anyway.
const MAX_BLOCK: usize = 1 << 20;
/// What replaces an authority that is not one.
const LOCALHOST: &[u8] = b"localhost";

enum Phase {
    /// Before the client's connection preface has passed.
    Preface,
    /// Frame by frame.
    Frames,
    /// Not HTTP/2 with prior knowledge: everything passes as it is, for
    /// the server to refuse.
    Raw,
}

/// A HEADERS frame whose block continues in CONTINUATION frames.
struct Open {
    stream: u32,
    flags: u8,
    priority: Option<[u8; 5]>,
    block: Vec<u8>,
}

/// An accepted connection, with the client's header blocks rewritten as the
/// module says. Writes go straight to the socket.
pub struct FixAuthority<S> {
    io: S,
    phase: Phase,
    decoder: Decoder<'static>,
    /// Bytes read from the client and not yet understood.
    input: Vec<u8>,
    /// Bytes ready for the server, from `output[taken..]`.
    output: Vec<u8>,
    taken: usize,
    open: Option<Open>,
    eof: bool,
}

impl<S> FixAuthority<S> {
    pub fn new(io: S) -> FixAuthority<S> {
        let mut decoder = Decoder::new();
        decoder.set_max_allowed_table_size(MAX_TABLE);
        FixAuthority {
            io,
            phase: Phase::Preface,
            decoder,
            input: Vec::new(),
            output: Vec::new(),
            taken: 0,
            open: None,
            eof: false,
        }
    }

    /// Moves what can be understood of `input` to `output`.
    fn process(&mut self) -> io::Result<()> {
        loop {
            match self.phase {
                Phase::Raw => {
                    self.output.append(&mut self.input);
                    return Ok(());
                }
                Phase::Preface => {
                    let n = self.input.len().min(PREFACE.len());
                    if self.input[..n] != PREFACE[..n] {
                        self.phase = Phase::Raw;
                        continue;
                    }
                    if n < PREFACE.len() {
                        return Ok(());
                    }
                    self.output.extend(self.input.drain(..n));
                    self.phase = Phase::Frames;
                }
                Phase::Frames => {
                    if self.input.len() < 9 {
                        return Ok(());
                    }
                    let h = &self.input[..9];
                    let len =
                        (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2]);
                    if len > MAX_FRAME {
                        // The server refuses it (FRAME_SIZE_ERROR) and
                        // closes: no need to hold up to 16 MiB for that.
                        self.phase = Phase::Raw;
                        continue;
                    }
                    if self.input.len() < 9 + len {
                        return Ok(());
                    }
                    let (kind, flags) = (h[3], h[4]);
                    let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
                    let frame: Vec<u8> = self.input.drain(..9 + len).collect();
                    self.frame(kind, flags, stream, frame)?;
                }
            }
        }
    }

    fn frame(&mut self, kind: u8, flags: u8, stream: u32, frame: Vec<u8>) -> io::Result<()> {
        let payload = &frame[9..];
        match (kind, self.open.as_mut()) {
            (HEADERS, None) => {
                let (priority, fragment) = headers_payload(flags, payload)?;
                let open = Open {
                    stream,
                    flags,
                    priority,
                    block: fragment.to_vec(),
                };
                if flags & END_HEADERS != 0 {
                    self.finish(open)
                } else {
                    self.open = Some(open);
                    Ok(())
                }
            }
            (CONTINUATION, Some(open)) if open.stream == stream => {
                if open.block.len() + payload.len() > MAX_BLOCK {
                    return Err(invalid("a header block larger than 1 MiB"));
                }
                open.block.extend_from_slice(payload);
                if flags & END_HEADERS != 0 {
                    let open = self.open.take().expect("matched above");
                    self.finish(open)
                } else {
                    Ok(())
                }
            }
            // Anything else inside a header block is a connection error.
            (_, Some(_)) => Err(invalid("a frame inside a header block")),
            _ => {
                self.output.extend_from_slice(&frame);
                Ok(())
            }
        }
    }

    /// Decodes a whole header block, fixes its authority and writes it out
    /// again as HEADERS and, past the frame size, CONTINUATION frames.
    fn finish(&mut self, open: Open) -> io::Result<()> {
        let mut block = Vec::with_capacity(open.block.len() * 2);
        self.decoder
            .decode_with_cb(&open.block, |name, value| {
                let value: &[u8] = if &*name == b":authority" && !is_authority(&value) {
                    LOCALHOST
                } else {
                    &value
                };
                literal(&mut block, &name, value);
            })
            .map_err(|e| invalid(&format!("a header block HPACK cannot decode: {e}")))?;
        let mut first = true;
        let mut rest = &block[..];
        loop {
            let mut payload = Vec::new();
            let mut flags = 0;
            let kind = if first {
                flags |= open.flags & END_STREAM;
                if let Some(p) = open.priority {
                    flags |= PRIORITY;
                    payload.extend_from_slice(&p);
                }
                HEADERS
            } else {
                CONTINUATION
            };
            let n = rest.len().min(MAX_FRAME - payload.len());
            payload.extend_from_slice(&rest[..n]);
            rest = &rest[n..];
            if rest.is_empty() {
                flags |= END_HEADERS;
            }
            let len = payload.len() as u32;
            self.output.extend_from_slice(&[
                (len >> 16) as u8,
                (len >> 8) as u8,
                len as u8,
                kind,
                flags,
            ]);
            self.output.extend_from_slice(&open.stream.to_be_bytes());
            self.output.extend_from_slice(&payload);
            first = false;
            if rest.is_empty() {
                return Ok(());
            }
        }
    }
}

fn invalid(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("HTTP/2 from the client: {what}"),
    )
}

/// The priority fields and the header block fragment of a HEADERS frame's
/// payload, padding removed.
fn headers_payload(flags: u8, payload: &[u8]) -> io::Result<(Option<[u8; 5]>, &[u8])> {
    let mut p = payload;
    let mut pad = 0;
    if flags & PADDED != 0 {
        let (&n, rest) = p
            .split_first()
            .ok_or_else(|| invalid("a padded HEADERS frame without its pad length"))?;
        pad = usize::from(n);
        p = rest;
    }
    let priority = if flags & PRIORITY != 0 {
        let (fields, rest) = p
            .split_first_chunk::<5>()
            .ok_or_else(|| invalid("a HEADERS frame too short for its priority"))?;
        p = rest;
        Some(*fields)
    } else {
        None
    };
    if pad > p.len() {
        return Err(invalid("a HEADERS frame with more padding than payload"));
    }
    Ok((priority, &p[..p.len() - pad]))
}

/// What h2 accepts as `:authority`.
fn is_authority(value: &[u8]) -> bool {
    Authority::try_from(value).is_ok()
}

/// HPACK "literal header field without indexing, new name", no Huffman
/// coding: it touches no dynamic table.
fn literal(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.push(0);
    for s in [name, value] {
        out.extend(loona_hpack::encoder::encode_integer(s.len(), 7));
        out.extend_from_slice(s);
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for FixAuthority<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let me = &mut *self;
        loop {
            if me.taken < me.output.len() {
                let n = buf.remaining().min(me.output.len() - me.taken);
                buf.put_slice(&me.output[me.taken..me.taken + n]);
                me.taken += n;
                if me.taken == me.output.len() {
                    me.output.clear();
                    me.taken = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if me.eof {
                // What is left of an incomplete frame goes as it is: the
                // server sees the same truncated connection.
                if !me.input.is_empty() {
                    me.output.append(&mut me.input);
                    continue;
                }
                return Poll::Ready(Ok(()));
            }
            let mut chunk = [0u8; 8192];
            let mut rb = ReadBuf::new(&mut chunk);
            ready!(Pin::new(&mut me.io).poll_read(cx, &mut rb))?;
            if rb.filled().is_empty() {
                me.eof = true;
                continue;
            }
            me.input.extend_from_slice(rb.filled());
            me.process()?;
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for FixAuthority<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for FixAuthority<tokio::net::UnixStream> {
    type ConnectInfo = <tokio::net::UnixStream as tonic::transport::server::Connected>::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let n = payload.len() as u32;
        let mut f = vec![(n >> 16) as u8, (n >> 8) as u8, n as u8, kind, flags];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    /// Everything the server would read of `client`'s bytes, given to the
    /// layer in pieces of `step` bytes.
    fn through(client: &[u8], step: usize) -> io::Result<Vec<u8>> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async {
            let (mut tx, rx) = tokio::io::duplex(64);
            let bytes = client.to_vec();
            let writer = tokio::spawn(async move {
                use tokio::io::AsyncWriteExt;
                for piece in bytes.chunks(step) {
                    tx.write_all(piece).await.unwrap();
                }
            });
            let mut fixed = FixAuthority::new(rx);
            let mut out = Vec::new();
            let r = fixed.read_to_end(&mut out).await;
            writer.await.unwrap();
            r.map(|_| out)
        })
    }

    /// Frames of the server's input: (type, flags, stream, payload).
    fn frames(mut b: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
        assert!(b.starts_with(PREFACE));
        b = &b[PREFACE.len()..];
        let mut v = Vec::new();
        while !b.is_empty() {
            let len = (usize::from(b[0]) << 16) | (usize::from(b[1]) << 8) | usize::from(b[2]);
            let stream = u32::from_be_bytes([b[5], b[6], b[7], b[8]]);
            v.push((b[3], b[4], stream, b[9..9 + len].to_vec()));
            b = &b[9 + len..];
        }
        v
    }

    type Headers = Vec<(Vec<u8>, Vec<u8>)>;

    fn request(authority: &str, path: &str) -> Headers {
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", authority),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]
        .iter()
        .map(|(n, v)| (n.as_bytes().to_vec(), v.as_bytes().to_vec()))
        .collect()
    }

    /// Decodes a block as h2 would, from the table the layer must have
    /// left empty: a fresh decoder fails on any index into a dynamic entry.
    fn decode_fresh(block: &[u8]) -> Headers {
        Decoder::new().decode(block).unwrap().into_iter().collect()
    }

    #[test]
    fn a_socket_path_becomes_localhost_and_the_client_table_is_followed() {
        let path = "/var/lib/kubelet/device-plugins/gpufrac-gpu-memory.sock";
        // The client's encoder indexes into its dynamic table on the second
        // request: the layer must follow it.
        let mut enc = loona_hpack::Encoder::new();
        let first = request(path, "/v1beta1.DevicePlugin/GetDevicePluginOptions");
        let second = request(
            &path.replace('/', "%2F"),
            "/v1beta1.DevicePlugin/ListAndWatch",
        );
        let b1 = enc.encode(first.iter().map(|(n, v)| (&n[..], &v[..])));
        let b2 = enc.encode(second.iter().map(|(n, v)| (&n[..], &v[..])));
        let mut client = PREFACE.to_vec();
        client.extend(frame(0x4, 0, 0, &[]));
        client.extend(frame(HEADERS, END_HEADERS, 1, &b1));
        client.extend(frame(0x0, END_STREAM, 1, &[0, 0, 0, 0, 0]));
        client.extend(frame(HEADERS, END_HEADERS | END_STREAM, 3, &b2));
        for step in [1, 7, client.len()] {
            let f = frames(&through(&client, step).unwrap());
            assert_eq!(f.len(), 4);
            assert_eq!(f[0], (0x4, 0, 0, vec![]), "SETTINGS untouched");
            assert_eq!(
                f[2],
                (0x0, END_STREAM, 1, vec![0, 0, 0, 0, 0]),
                "DATA untouched"
            );
            assert_eq!((f[1].0, f[1].1, f[1].2), (HEADERS, END_HEADERS, 1));
            assert_eq!(
                (f[3].0, f[3].1, f[3].2),
                (HEADERS, END_HEADERS | END_STREAM, 3)
            );
            let mut want = first.clone();
            want[3].1 = b"localhost".to_vec();
            assert_eq!(decode_fresh(&f[1].3), want);
            let mut want = second.clone();
            want[3].1 = b"localhost".to_vec();
            assert_eq!(decode_fresh(&f[3].3), want);
        }
    }

    #[test]
    fn a_valid_authority_is_kept_and_padding_priority_and_continuations_are_undone() {
        let mut enc = loona_hpack::Encoder::new();
        let mut headers = request("localhost:8080", "/v1beta1.DevicePlugin/Allocate");
        // A long header: the block no longer fits one frame on the way out.
        headers.push((b"x-long".to_vec(), vec![b'a'; MAX_FRAME + 100]));
        let block = enc.encode(headers.iter().map(|(n, v)| (&n[..], &v[..])));
        let (a, b) = block.split_at(10);
        let mut padded = vec![3u8];
        padded.extend_from_slice(&[0, 0, 0, 0, 16]);
        padded.extend_from_slice(a);
        padded.extend_from_slice(&[0, 0, 0]);
        let mut client = PREFACE.to_vec();
        client.extend(frame(HEADERS, PADDED | PRIORITY, 5, &padded));
        let pieces: Vec<&[u8]> = b.chunks(MAX_FRAME).collect();
        for (i, piece) in pieces.iter().enumerate() {
            let last = i + 1 == pieces.len();
            client.extend(frame(
                CONTINUATION,
                if last { END_HEADERS } else { 0 },
                5,
                piece,
            ));
        }
        let f = frames(&through(&client, 5).unwrap());
        assert_eq!(f.len(), 2, "HEADERS and one CONTINUATION");
        assert_eq!((f[0].0, f[0].1, f[0].2), (HEADERS, PRIORITY, 5));
        assert_eq!(&f[0].3[..5], &[0, 0, 0, 0, 16], "the priority kept");
        assert_eq!(f[0].3.len(), MAX_FRAME);
        assert_eq!((f[1].0, f[1].1, f[1].2), (CONTINUATION, END_HEADERS, 5));
        let mut whole = f[0].3[5..].to_vec();
        whole.extend_from_slice(&f[1].3);
        assert_eq!(decode_fresh(&whole), headers);
    }

    #[test]
    fn what_is_not_http2_passes_and_what_is_broken_closes() {
        let http1 = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n";
        assert_eq!(through(http1, 3).unwrap(), http1);
        // A frame larger than the server takes goes on as it is, for the
        // server to refuse, and so does everything after it.
        let mut client = PREFACE.to_vec();
        client.extend(frame(0x0, 0, 1, &vec![7; MAX_FRAME + 1]));
        client.extend(frame(HEADERS, END_HEADERS, 1, &[0xff, 0x7f]));
        assert_eq!(through(&client, 1000).unwrap(), client);
        // A truncated frame at the end reaches the server as it was sent.
        let mut client = PREFACE.to_vec();
        client.extend_from_slice(&frame(0x4, 0, 0, &[0; 6])[..12]);
        assert_eq!(through(&client, 4).unwrap(), client);
        // A block HPACK cannot decode (an index past every table).
        let mut client = PREFACE.to_vec();
        client.extend(frame(HEADERS, END_HEADERS, 1, &[0xff, 0x7f]));
        let e = through(&client, 100).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
        // A DATA frame in the middle of a header block.
        let mut client = PREFACE.to_vec();
        client.extend(frame(HEADERS, 0, 1, &[0x82]));
        client.extend(frame(0x0, 0, 1, &[]));
        assert!(through(&client, 100).is_err());
    }
}
