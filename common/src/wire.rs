//! The broker protocol: small binary frames on a Unix stream socket.
//!
//! Hand-written rather than serde so that the shim, which lives inside other
//! people's processes, links no dependencies, and so that the decoder can be
//! shown never to panic on what an arbitrary client sends.
//!
//! # Framing
//!
//! ```text
//! u32 length   little-endian, counts the type byte and the payload
//! u8  type     0x01.. from clients, 0x81.. from the broker
//! ..  payload  exactly length - 1 bytes
//! ```
//!
//! All integers are little-endian. `f64` travels as its IEEE-754 bits in a
//! `u64`; `Option<f64>` as a `u8` tag (0 none, 1 some) followed by the bits
//! when some; `bool` as a `u8` 0 or 1. A string is a `u16` byte length and
//! UTF-8 (invalid UTF-8 is refused), except the status JSON, which has a
//! `u32` length. A list is a `u16` count (at most [`MAX_LIST`], and never
//! more than the bytes left could hold) followed by its items.
//!
//! A length above [`MAX_FRAME`] (1 MiB, sized for the status JSON of a busy
//! node; every other message is far smaller) is [`DecodeError::TooLarge`] as
//! soon as the four length bytes arrive, so a peer cannot make the other side
//! buffer a huge frame; the broker closes that client. A frame whose payload
//! is not exactly its message is [`DecodeError::Malformed`], likewise fatal.
//!
//! The encoders never write a frame the decoders would refuse: strings longer
//! than their length field allows are cut at a character boundary, lists at
//! [`MAX_LIST`] items and the status JSON at [`MAX_STATUS_JSON`] bytes.
//!
//! # Handshake
//!
//! The client's first message is `Hello` with [`MAGIC`] and the range of
//! versions it speaks: `version`, the lowest (the field that versions up to
//! 4 filled with the one version they spoke), then, appended in version 5,
//! `max_version`, the highest (absent: the same). The broker answers
//! `HelloOk` with the highest version both speak ([`hello_reply`]), and the
//! connection speaks that version from then on; with none in common it
//! answers `Error` with code [`ERR_VERSION`] and one line naming both
//! ranges and what to do, and closes the connection; a wrong magic or any
//! other first message gets `Error` code [`ERR_BAD_FRAME`] and the same. A
//! client checks the version it was given ([`accept_version`]).
//!
//! A client may send its first request in the same write as `Hello`, before
//! `HelloOk` comes (`gpufrac run` sends its `Lease` so, `gpufrac status`
//! its first `Status`): one round trip to a busy broker instead of two. The
//! broker handles a connection's frames in order, so the request is read
//! only after the Hello is accepted; behind a refused one, never.
//!
//! So a restarted broker of a newer release keeps serving the shims of
//! processes that were running (they reconnect and register again with
//! the version they speak), and a client of a newer release still talks
//! to an older broker: its `version` is its lowest, which an older broker
//! checks as the one version it knows.
//!
//! So that brokers and clients of any two versions can still tell each other
//! that they differ, `Hello`, `HelloOk` and `Error` are frozen: later versions
//! may only append fields to them, and a reader ignores bytes past the fields
//! it knows in these three (and only these).
//!
//! # Conversation
//!
//! A shim sends `Register` once (after `Join` when it holds a job's token), then `Usage` now and then, and `Acquire` /
//! `Release` around compute timeslices; the broker sends it `Grant` and
//! `Revoke`. The CLI sends `Status` (answered by `StatusReply`) or `Lease`
//! (answered by `Queued` any number of times, then `Leased` or `Refused`).
//! `Error` may answer anything. Values inside messages (percentages, sizes)
//! are carried as sent; checking them is the receiver's business.
//!
//! # Roles
//!
//! The `Hello`'s role fixes what the connection may send, for good:
//!
//! | role | messages |
//! |------|----------|
//! | [`Role::Shim`] (1): `libgpufrac.so` in a process | `Join`, `Register`, `Usage`, `Acquire`, `Release`, `Drained` |
//! | [`Role::Cli`] (2): `gpufrac run`, `gpufrac status`, the device plugin | `Status`, `Lease`, `Name` |
//! | either | `Hello` (of the same role; ignored), `Ping` |
//!
//! A message of the other role, or a later `Hello` naming the other role,
//! is a protocol error, answered as one before `Hello` is: `Error` code
//! [`ERR_BAD_FRAME`], one line naming the message, the role the
//! connection said and the role to open another connection with, e.g.
//! `Register is a shim's message (libgpufrac.so in a process); this
//! connection said it is a CLI client (Hello role 2); open another
//! connection with role Shim`; then the broker closes the connection,
//! handling nothing it sent after. A process that is both (`gpufrac run`
//! is a CLI client; the processes of its job are shims) opens a
//! connection per role. Versions 4 and 5 are the same here: a client of
//! either that sends only its role's messages is served as before.

use std::fmt;

use crate::config::Priority;

/// 2: priorities (`Register`, `Lease`), the in-flight bound in `Grant`,
/// and `Drained`. 3: `Registered`, lease tokens (`Queued`, `Leased`,
/// `Lease.resume`), paged `Status`, and `Ping`. 4: `Join`, and the MIG
/// device of a lease (`Leased.mig`, `gpufrac broker --mig dynamic`),
/// leases pinned to GPUs under a token the client chose (`Lease.pin`,
/// `Lease.token`: the Kubernetes device plugin's pods), and `Name`.
/// 5: version ranges (`Hello.max_version`); every other frame as in 4.
pub const PROTOCOL_VERSION: u16 = 5;
/// The oldest version this build still speaks: a broker serves clients of
/// versions from here to [`PROTOCOL_VERSION`], which is what lets shims of
/// processes started before an upgrade register with the new broker.
pub const MIN_PROTOCOL_VERSION: u16 = 4;
pub const MAGIC: [u8; 4] = *b"GPFR";

/// Up to this place in the queue a waiting `gpufrac run` is told its
/// place exactly; beyond, within a tenth of it.
pub const EXACT_POSITIONS: u32 = 10;

/// Whether a waiting request last told place `told` (None: never told)
/// is told again at place `now`: when the place it knows is no longer
/// exact up to [`EXACT_POSITIONS`], or off by more than a tenth of `now`
/// beyond. A queue of 1,000 in which everyone moves up one place at each
/// departure so tells each request about 58 times on its way to the
/// front, not 1,000, and a departure tells a few requests, not all
/// behind it.
pub fn position_worth_telling(told: Option<u32>, now: u32) -> bool {
    match told {
        None => true,
        Some(t) if now <= EXACT_POSITIONS => t != now,
        Some(t) => u64::from(t.abs_diff(now)) * 10 > u64::from(now),
    }
}
/// Largest value of a frame's length field.
pub const MAX_FRAME: u32 = 1 << 20;
/// Largest frame a client may send: its longest message (a `Register` of
/// [`MAX_LIST`] devices and a full-length command) fits with room to spare,
/// and the broker buffers no more than this per connection.
pub const MAX_CLIENT_FRAME: u32 = 256 << 10;
/// Most items in any list; far above any node's GPU count, and low enough
/// that no message of lists and short strings can exceed [`MAX_FRAME`].
pub const MAX_LIST: usize = 4096;
/// Longest status JSON that fits a frame; longer JSON is cut (and so no
/// longer valid JSON), so the broker should keep its status below this.
pub const MAX_STATUS_JSON: usize = MAX_FRAME as usize - 1 - 4;

/// `Error` codes.
pub const ERR_VERSION: u16 = 1;
pub const ERR_BAD_FRAME: u16 = 2;
pub const ERR_REFUSED: u16 = 3;
pub const ERR_INTERNAL: u16 = 4;

const UUID_LEN: usize = 16;
const DEVICE_REG_LEN: usize = UUID_LEN + 4 + 8 + 8;
const PIN_LEN: usize = UUID_LEN + 8;

/// A random job token from the kernel (never 0, which means "none" on the
/// wire): the broker's for the jobs it makes, the device plugin's for the
/// pods it books, which it hands to them before the broker sees them.
pub fn random_token() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: getrandom into a local buffer of the given size.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    let t = if n == 8 {
        u64::from_le_bytes(b)
    } else {
        // Never reached on Linux >= 3.17; still unique per process.
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        now ^ (u64::from(std::process::id()) << 32)
    };
    t.max(1)
}

/// The 16 bytes of `GPU-…` or `MIG-…` (8-4-4-4-12 hex digits), as CUDA's
/// `cuDeviceGetUuid_v2` gives them; None for anything else (such as the
/// `MIG-GPU-…/gi/ci` form of drivers before R470).
pub fn parse_uuid(s: &str) -> Option<[u8; 16]> {
    let hex = s.strip_prefix("GPU-").or_else(|| s.strip_prefix("MIG-"))?;
    let digits: Vec<u8> = hex.bytes().filter(|&b| b != b'-').collect();
    if digits.len() != 32 || hex.len() != 36 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        let pair = std::str::from_utf8(&digits[2 * i..2 * i + 2]).ok()?;
        *b = u8::from_str_radix(pair, 16).ok()?;
    }
    Some(out)
}

/// `GPU-…` (lower-case hex, 8-4-4-4-12), the form nvidia-smi prints and
/// `parse_uuid` reads back.
pub fn uuid_string(u: &[u8; 16]) -> String {
    let mut buf = [0u8; 40];
    let n = crate::cuda::format_uuid(&crate::cuda::CUuuid { bytes: *u }, &mut buf);
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

// The messages, each written once: its tag, who sends it and its fields
// in wire order. The enums, the encoders, the decoders, the names and the
// sender roles are generated from these two tables (`define_messages!`),
// so a new message is one line in one of them (CONTRIBUTING.md, The
// protocol).
//
// An entry reads `TAG byte sender[, frozen]: Variant fields;`:
// - `sender`: `Shim` or `Cli`, the role whose connections may send it
//   (`Role`), `either`, or `broker`;
// - `frozen`: `Hello`, `HelloOk` and `Error`, which later versions may
//   only append to: their readers ignore bytes past the fields they know;
// - fields: `{ name: Type, ... }` in wire order, `(binding: Type)` for a
//   message that is one record, or nothing. The type says how a field
//   travels (the `Field` impls below); `as Via` gives a field another
//   encoding of its type, and `= other` makes it a field appended in a
//   later version: left off the wire when it equals `other`, and read as
//   `other` when absent.
macro_rules! client_messages {
    ($then:ident) => {
        $then! {
            ClientMsg, encode_client, decode_client, MAX_CLIENT_FRAME, senders;

            T_HELLO 0x01 either, frozen: Hello {
                magic: [u8; 4],
                /// The lowest version the client speaks (up to version 4:
                /// the only one).
                version: u16,
                pid: u32,
                role: Role,
                /// The highest it speaks; appended in version 5, and left
                /// off the wire when it equals `version`, as versions up
                /// to 4 sent it.
                max_version: u16 = version,
            };
            T_REGISTER 0x02 Shim: Register {
                command: String,
                devices: Vec<DeviceReg>,
                /// Percent.
                share: Option<f64>,
                /// Percent.
                limit: Option<f64>,
                priority: Priority,
            };
            T_USAGE 0x03 Shim: Usage { uuid: [u8; 16], used: u64, peak: u64, ooms: u64 };
            T_ACQUIRE 0x04 Shim: Acquire { uuid: [u8; 16] };
            /// Stops launching on a device. Work already queued there may
            /// still be running: the GPU's own time-slicer interleaves it
            /// with the next holder's, and `Drained` says when it has
            /// finished.
            T_RELEASE 0x05 Shim: Release { uuid: [u8; 16], held_ns: u64 };
            /// Everything this process had queued on the device before its
            /// last `Release` has completed.
            T_DRAINED 0x08 Shim: Drained { uuid: [u8; 16] };
            /// Asks for `Pong`: a waiting shim checks that a silent broker
            /// is alive, not stalled.
            T_PING 0x09 either: Ping;
            /// Sent before `Register` by a process that holds a job's token
            /// (`GPUFRAC_JOB`) but may not descend from its `gpufrac run`: a
            /// container's processes are children of the container runtime.
            T_JOIN 0x0a Shim: Join { job: u64 };
            /// Asks for `StatusReply`, listing processes from the `from`-th
            /// on (the reply's `next` says where the following page starts).
            T_STATUS 0x06 Cli: Status { from: u32 };
            T_LEASE 0x07 Cli: Lease(req: LeaseReq);
            /// Names the job of this connection's lease for status: the pod
            /// it is (`namespace/name`) and a label in place of its command.
            T_NAME 0x0b Cli: Name { pod: String, label: String };
            /// Asks for `SummaryReply`: what the job `job` (its token) has
            /// had so far, for its run's end-of-job line.
            T_SUMMARY 0x0c Cli: Summary { job: u64 };
        }
    };
}

macro_rules! server_messages {
    ($then:ident) => {
        $then! {
            ServerMsg, encode_server, decode_server, MAX_FRAME, no_senders;

            T_HELLO_OK 0x81 broker, frozen: HelloOk { version: u16 };
            /// `code` is one of the `ERR_*` constants.
            T_ERROR 0x82 broker, frozen: Error { code: u16, message: String };
            /// A grant id the client already holds makes this an update of
            /// that grant (it became contended, or open-ended again); a
            /// client ignores grants and revokes for an id it has already
            /// released, since they crossed its release on the wire.
            T_GRANT 0x83 broker: Grant {
                uuid: [u8; 16],
                grant: u64,
                /// 0 = open-ended (the GPU is uncontended).
                slice_ns: u64,
                /// Most GPU time the holder may have queued and unfinished
                /// at once (others share the GPU and must get in quickly);
                /// 0 = no bound.
                bound_ns: u64,
                /// Someone else wants the GPU: hand it back as soon as idle.
                waiters: bool,
            };
            T_REVOKE 0x84 broker: Revoke { uuid: [u8; 16], grant: u64 };
            T_STATUS_REPLY 0x85 broker: StatusReply { json: String as Json };
            T_QUEUED 0x86 broker: Queued {
                /// 1-based place in the queue, sent when it moved by a
                /// meaningful step ([`position_worth_telling`]): exact up
                /// to [`EXACT_POSITIONS`], within a tenth beyond.
                position: u32,
                waiting_for: String,
                /// Names the request for `Lease.resume` after a broker
                /// restart.
                token: u64,
            };
            T_LEASED 0x87 broker: Leased(lease: Lease);
            T_REFUSED 0x88 broker: Refused { reason: String };
            /// Answers `Ping`.
            T_PONG 0x8a broker: Pong;
            /// Answers `Summary`: a `status::JobSummary` as JSON.
            T_SUMMARY_REPLY 0x8b broker: SummaryReply { json: String as Json };
            /// Answers `Register`: what the broker enforces on this process
            /// whatever its environment says (its job's lease).
            T_REGISTERED 0x89 broker: Registered {
                /// Memory cap on every registered device; 0 = none imposed.
                mem_cap: u64,
            };
        }
    };
}

/// Expands a message table (above) into its enum, its tags, its encoder and
/// decoder, the messages' names, and (`senders`) the role that sends each.
macro_rules! define_messages {
    (
        $enum:ident, $encode:ident, $decode:ident, $max:expr, $roles:ident;
        $(
            $(#[$vm:meta])*
            $tag:ident $byte:literal $sender:ident $(, $frozen:ident)? : $name:ident
            $( {
                $( $(#[$fm:meta])* $f:ident : $ft:ty $(as $via:ident)? $(= $dflt:ident)? ),* $(,)?
            } )?
            $( ( $b:ident : $bt:ty ) )?
        );* $(;)?
    ) => {
        $( const $tag: u8 = $byte; )*

        #[derive(Clone, Debug, PartialEq)]
        pub enum $enum {
            $(
                $(#[$vm])*
                $name $( { $( $(#[$fm])* $f: $ft ),* } )? $( ($bt) )?,
            )*
        }

        impl $enum {
            /// The message's name in this specification, for errors that
            /// name it.
            pub fn name(&self) -> &'static str {
                match self {
                    $( $enum::$name { .. } => stringify!($name), )*
                }
            }
        }

        $roles! { $enum; $( $name $sender ),* }

        /// Appends one whole frame holding `msg` to `out`.
        pub fn $encode(msg: &$enum, out: &mut Vec<u8>) {
            let start = begin_frame(out);
            match msg {
                $(
                    $enum::$name $( { $($f),* } )? $( ($b) )? => {
                        out.push($tag);
                        $( $( put_field!(out, $f $(, as $via)? $(, unless $dflt)?); )* )?
                        $( Field::put($b, out); )?
                    }
                )*
            }
            end_frame(out, start);
        }

        /// Decodes the frame at the start of `buf`, returning the message
        /// and how many bytes it took. Never panics, whatever `buf` holds.
        pub fn $decode(buf: &[u8]) -> Result<($enum, usize), DecodeError> {
            let (ty, payload, used) = split_frame(buf, $max)?;
            let mut r = Reader(payload);
            let (msg, frozen) = match ty {
                $(
                    $tag => {
                        $( $( let $f: $ft = get_field!(r $(, as $via)? $(, or $dflt)?); )* )?
                        $( let $b: $bt = Field::get(&mut r)?; )?
                        ($enum::$name $( { $($f),* } )? $( ($b) )?, frozen!($($frozen)?))
                    }
                )*
                other => return Err(DecodeError::UnknownType(other)),
            };
            // A frozen message may carry a later version's fields after
            // the ones known here; any other ends where its fields do.
            if !frozen {
                r.finish()?;
            }
            Ok((msg, used))
        }
    };
}

/// The role that sends each message (`sender` in the table).
macro_rules! senders {
    ($enum:ident; $( $name:ident $sender:ident ),*) => {
        impl $enum {
            /// The role whose connections may send this message; None:
            /// either role's (`Hello` names the role, `Ping` is anyone's).
            pub fn sender(&self) -> Option<Role> {
                match self {
                    $( $enum::$name { .. } => sender!($sender), )*
                }
            }
        }
    };
}

/// The broker's messages have one sender.
macro_rules! no_senders {
    ($($t:tt)*) => {};
}

macro_rules! sender {
    (either) => {
        None
    };
    ($role:ident) => {
        Some(Role::$role)
    };
}

macro_rules! frozen {
    () => {
        false
    };
    (frozen) => {
        true
    };
}

macro_rules! put_field {
    ($out:ident, $v:ident) => {
        Field::put($v, $out)
    };
    ($out:ident, $v:ident, as $via:ident) => {
        $via::put($v, $out)
    };
    ($out:ident, $v:ident, unless $d:ident) => {
        if $v != $d {
            Field::put($v, $out)
        }
    };
}

macro_rules! get_field {
    ($r:ident) => {
        Field::get(&mut $r)?
    };
    ($r:ident, as $via:ident) => {
        $via::get(&mut $r)?
    };
    ($r:ident, or $d:ident) => {
        Field::get(&mut $r).unwrap_or($d)
    };
}

client_messages!(define_messages);
server_messages!(define_messages);

/// Structs that travel as their fields in the order written (a list
/// item, or a message that is one record).
macro_rules! records {
    ($(
        $(#[$sm:meta])*
        pub struct $name:ident { $( $(#[$fm:meta])* pub $f:ident : $ft:ty ),* $(,)? }
    )*) => {
        $(
            $(#[$sm])*
            pub struct $name { $( $(#[$fm])* pub $f: $ft ),* }

            impl Field for $name {
                fn put(&self, out: &mut Vec<u8>) {
                    $( Field::put(&self.$f, out); )*
                }

                fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
                    // Struct fields are evaluated in the order written.
                    Ok($name { $( $f: Field::get(r)? ),* })
                }
            }
        )*
    };
}

records! {
    /// What a `Lease` asks for (`gpufrac run`, the device plugin).
    #[derive(Clone, Debug, Default, PartialEq)]
    pub struct LeaseReq {
        /// 0 when asking for memory.
        pub want_gpus: u32,
        /// 0 when asking for whole GPUs.
        pub want_mem: u64,
        /// Percent.
        pub compute: Option<f64>,
        /// Percent.
        pub limit: Option<f64>,
        pub no_wait: bool,
        pub command: String,
        /// `None`: the job's processes choose for themselves.
        pub priority: Option<Priority>,
        /// 0: a new request. Otherwise the token of a lease or queued
        /// request this same process held before the broker restarted: the
        /// broker gives back that lease, or that place in the queue.
        pub resume: u64,
        /// Non-zero: the token the new job is to have, chosen (at random)
        /// by the client, which has already handed it to the job's
        /// processes: the Kubernetes device plugin answers the kubelet
        /// before the broker does, and books the same pod again under the
        /// same token after either of them restarts. Refused if another
        /// job holds it.
        pub token: u64,
        /// Non-empty: the GPUs are already chosen (the kubelet chose them
        /// for a pod), and this is the memory on each; `want_*` are then 0.
        pub pin: Vec<Pin>,
    }

    /// What a granted `Lease` holds (`Leased`), as `gpufrac run` and the
    /// device plugin keep it.
    #[derive(Clone, Debug, Default, PartialEq)]
    pub struct Lease {
        pub gpus: Vec<u32>,
        pub uuids: Vec<[u8; 16]>,
        /// 0 = uncapped.
        pub mem_cap: u64,
        /// Names the lease for `Lease.resume` after a broker restart.
        pub token: u64,
        /// The MPS pipe directory the job's processes must use (a broker
        /// running MPS); empty otherwise.
        pub mps_pipe: String,
        /// The MIG device the lease is (`MIG-<uuid>`, what
        /// `CUDA_VISIBLE_DEVICES` must name: `gpus` is then its GPU);
        /// empty for whole GPUs and fractions.
        pub mig: String,
    }

    /// Memory on one given GPU, for a lease whose GPUs are already chosen.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Pin {
        pub uuid: [u8; 16],
        pub mem: u64,
    }

    /// One device a shim registers, named by UUID because ordinals differ
    /// between processes under `CUDA_VISIBLE_DEVICES`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct DeviceReg {
        pub uuid: [u8; 16],
        /// The CUDA ordinal as the registering process sees it.
        pub ordinal: u32,
        /// 0 = uncapped.
        pub mem_cap: u64,
        pub mem_total: u64,
    }
}

impl From<LeaseReq> for ClientMsg {
    fn from(req: LeaseReq) -> Self {
        ClientMsg::Lease(req)
    }
}

impl Lease {
    /// The GPUs (or the MIG device) it holds, as a claim names them.
    pub fn held(&self) -> Vec<Pin> {
        let uuids = match parse_uuid(&self.mig) {
            Some(m) => vec![m],
            None => self.uuids.clone(),
        };
        uuids
            .into_iter()
            .map(|uuid| Pin {
                uuid,
                mem: self.mem_cap,
            })
            .collect()
    }
}

/// Who is on the other end of a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// `libgpufrac.so` inside an application.
    Shim,
    /// `gpufrac run`, `gpufrac status`, the device plugin.
    Cli,
}

impl ClientMsg {
    /// The `Hello` this build sends.
    pub fn hello(pid: u32, role: Role) -> Self {
        ClientMsg::Hello {
            magic: MAGIC,
            version: MIN_PROTOCOL_VERSION,
            pid,
            role,
            max_version: PROTOCOL_VERSION,
        }
    }
}

/// `version 4`, or `versions 4 to 5`.
fn versions(lo: u16, hi: u16) -> String {
    if lo == hi {
        format!("version {lo}")
    } else {
        format!("versions {lo} to {hi}")
    }
}

/// The broker's answer to a client's `Hello` speaking versions `min` to
/// `max`: `HelloOk` with the highest version both speak, or the `Error` to
/// send before closing the connection, one line naming both ranges and
/// what to do.
pub fn hello_reply(magic: [u8; 4], min: u16, max: u16) -> ServerMsg {
    // A range given backwards is read as its lowest version alone.
    let max = max.max(min);
    let common = max.min(PROTOCOL_VERSION);
    if magic != MAGIC {
        ServerMsg::Error {
            code: ERR_BAD_FRAME,
            message: "not a gpufrac client (bad magic)".to_owned(),
        }
    } else if common < min.max(MIN_PROTOCOL_VERSION) {
        let todo = if max < MIN_PROTOCOL_VERSION {
            "the client is older than this broker still serves: run it with this node's gpufrac \
             and libgpufrac.so"
        } else {
            "the client is newer than this broker: upgrade gpufrac on this node and restart the \
             broker, or run the client with the broker's release"
        };
        ServerMsg::Error {
            code: ERR_VERSION,
            message: format!(
                "protocol {} not supported; this broker (gpufrac {}) speaks {}: {todo}",
                versions(min, max),
                env!("CARGO_PKG_VERSION"),
                versions(MIN_PROTOCOL_VERSION, PROTOCOL_VERSION)
            ),
        }
    } else {
        ServerMsg::HelloOk { version: common }
    }
}

/// Checks the version a broker chose in `HelloOk`: one this build speaks,
/// else why not, in one line naming both and what to do.
pub fn accept_version(version: u16) -> Result<u16, String> {
    if (MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&version) {
        return Ok(version);
    }
    Err(format!(
        "the broker chose protocol version {version}, and this gpufrac ({}) speaks {}: run this \
         program with the broker's release of gpufrac and libgpufrac.so, or restart the broker on \
         this one",
        env!("CARGO_PKG_VERSION"),
        versions(MIN_PROTOCOL_VERSION, PROTOCOL_VERSION)
    ))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeError {
    /// Not a whole frame yet: read more and try again. The only non-fatal
    /// error.
    Incomplete,
    /// The length field, above [`MAX_FRAME`].
    TooLarge(u32),
    /// A message type this side does not know (or one meant for the other
    /// side).
    UnknownType(u8),
    Malformed(&'static str),
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::Incomplete => f.write_str("incomplete frame"),
            DecodeError::TooLarge(n) => {
                write!(f, "frame of {n} bytes exceeds the size limit")
            }
            DecodeError::UnknownType(t) => write!(f, "unknown message type {t:#04x}"),
            DecodeError::Malformed(why) => write!(f, "malformed frame: {why}"),
        }
    }
}

impl std::error::Error for DecodeError {}

/// How a value travels: written whole, read back or refused with why.
/// Reading never panics, whatever the bytes.
trait Field: Sized {
    fn put(&self, out: &mut Vec<u8>);
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError>;
}

/// A field of fixed length, what lists are made of: a list's count is
/// checked against the bytes left before anything is allocated for it.
trait Item: Field {
    const LEN: usize;
}

impl Field for u16 {
    fn put(&self, out: &mut Vec<u8>) {
        put_u16(out, *self);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        r.u16()
    }
}

impl Field for u32 {
    fn put(&self, out: &mut Vec<u8>) {
        put_u32(out, *self);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        r.u32()
    }
}

impl Item for u32 {
    const LEN: usize = 4;
}

impl Field for u64 {
    fn put(&self, out: &mut Vec<u8>) {
        put_u64(out, *self);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        r.u64()
    }
}

impl<const N: usize> Field for [u8; N] {
    fn put(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(self);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        r.array()
    }
}

impl<const N: usize> Item for [u8; N] {
    const LEN: usize = N;
}

impl Field for bool {
    fn put(&self, out: &mut Vec<u8>) {
        out.push(u8::from(*self));
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        r.bool()
    }
}

impl Field for Option<f64> {
    fn put(&self, out: &mut Vec<u8>) {
        put_opt_f64(out, *self);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        r.opt_f64()
    }
}

/// A `u16` length and UTF-8, cut at a character boundary to fit.
impl Field for String {
    fn put(&self, out: &mut Vec<u8>) {
        put_str16(out, self);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        r.str16()
    }
}

impl Field for Priority {
    fn put(&self, out: &mut Vec<u8>) {
        out.push(self.index() as u8);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        Priority::from_index(r.u8()?).ok_or(DecodeError::Malformed("unknown priority"))
    }
}

/// 0: none; otherwise the priority's index plus one.
impl Field for Option<Priority> {
    fn put(&self, out: &mut Vec<u8>) {
        out.push(self.map_or(0, |p| p.index() as u8 + 1));
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        match r.u8()? {
            0 => Ok(None),
            b => Priority::from_index(b - 1)
                .map(Some)
                .ok_or(DecodeError::Malformed("unknown priority")),
        }
    }
}

impl Field for Role {
    fn put(&self, out: &mut Vec<u8>) {
        out.push(match self {
            Role::Shim => 1,
            Role::Cli => 2,
        });
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        match r.u8()? {
            1 => Ok(Role::Shim),
            2 => Ok(Role::Cli),
            _ => Err(DecodeError::Malformed("unknown role")),
        }
    }
}

/// A `u16` count, at most [`MAX_LIST`] (a longer list is cut), then the
/// items.
impl<T: Item> Field for Vec<T> {
    fn put(&self, out: &mut Vec<u8>) {
        let items = clamp_list(self);
        put_u16(out, items.len() as u16);
        for item in items {
            item.put(out);
        }
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let n = r.count(T::LEN)?;
        let mut items = Vec::with_capacity(n);
        for _ in 0..n {
            items.push(T::get(r)?);
        }
        Ok(items)
    }
}

impl Item for DeviceReg {
    const LEN: usize = DEVICE_REG_LEN;
}

impl Item for Pin {
    const LEN: usize = PIN_LEN;
}

/// The status JSON: a `u32` length, cut at [`MAX_STATUS_JSON`] bytes.
struct Json;

impl Json {
    fn put(json: &str, out: &mut Vec<u8>) {
        let json = truncate(json, MAX_STATUS_JSON);
        put_u32(out, json.len() as u32);
        out.extend_from_slice(json.as_bytes());
    }

    fn get(r: &mut Reader<'_>) -> Result<String, DecodeError> {
        let len = r.u32()? as usize;
        r.utf8(len)
    }
}

/// Returns the type byte, the payload and the whole frame's length.
fn split_frame(buf: &[u8], max: u32) -> Result<(u8, &[u8], usize), DecodeError> {
    let Some((len, rest)) = buf.split_first_chunk::<4>() else {
        return Err(DecodeError::Incomplete);
    };
    let len = u32::from_le_bytes(*len);
    // Checked before waiting for the body, so an absurd length is refused
    // at once rather than buffered.
    if len > max {
        return Err(DecodeError::TooLarge(len));
    }
    if len == 0 {
        return Err(DecodeError::Malformed("empty frame"));
    }
    let body = rest.get(..len as usize).ok_or(DecodeError::Incomplete)?;
    let (&ty, payload) = body
        .split_first()
        .ok_or(DecodeError::Malformed("empty frame"))?;
    Ok((ty, payload, 4 + len as usize))
}

/// Checked reads from a payload; running short is `Malformed`, not
/// `Incomplete`, because the frame is already whole.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let (head, tail) = self
            .0
            .split_at_checked(n)
            .ok_or(DecodeError::Malformed("payload too short"))?;
        self.0 = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let (head, tail) = self
            .0
            .split_first_chunk::<N>()
            .ok_or(DecodeError::Malformed("payload too short"))?;
        self.0 = tail;
        Ok(*head)
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        self.array::<1>().map(|[b]| b)
    }

    fn u16(&mut self) -> Result<u16, DecodeError> {
        self.array().map(u16::from_le_bytes)
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, DecodeError> {
        self.array().map(u64::from_le_bytes)
    }

    fn bool(&mut self) -> Result<bool, DecodeError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(DecodeError::Malformed("bool is neither 0 nor 1")),
        }
    }

    fn opt_f64(&mut self) -> Result<Option<f64>, DecodeError> {
        match self.u8()? {
            0 => Ok(None),
            1 => self.u64().map(|bits| Some(f64::from_bits(bits))),
            _ => Err(DecodeError::Malformed("option tag is neither 0 nor 1")),
        }
    }

    fn utf8(&mut self, len: usize) -> Result<String, DecodeError> {
        let bytes = self.take(len)?;
        std::str::from_utf8(bytes)
            .map(str::to_owned)
            .map_err(|_| DecodeError::Malformed("string is not UTF-8"))
    }

    fn str16(&mut self) -> Result<String, DecodeError> {
        let len = self.u16()?;
        self.utf8(usize::from(len))
    }

    /// A list count, refused before anything is allocated for it when the
    /// bytes left cannot hold that many items of `item_len` bytes.
    fn count(&mut self, item_len: usize) -> Result<usize, DecodeError> {
        let n = usize::from(self.u16()?);
        if n > MAX_LIST {
            return Err(DecodeError::Malformed("list too long"));
        }
        if n.saturating_mul(item_len) > self.0.len() {
            return Err(DecodeError::Malformed("list longer than the payload"));
        }
        Ok(n)
    }

    fn finish(&self) -> Result<(), DecodeError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(DecodeError::Malformed("trailing bytes after the message"))
        }
    }
}

fn begin_frame(out: &mut Vec<u8>) -> usize {
    let start = out.len();
    out.extend_from_slice(&[0; 4]);
    start
}

fn end_frame(out: &mut [u8], start: usize) {
    let len = out.len() - start - 4;
    // The clamps in the encoders keep every frame within MAX_FRAME (see
    // oversized_fields_are_cut_to_fit), so the cast cannot truncate.
    if let Some(field) = out.get_mut(start..start + 4) {
        field.copy_from_slice(&(len as u32).to_le_bytes());
    }
}

fn put_u16(out: &mut Vec<u8>, v: u16) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_opt_f64(out: &mut Vec<u8>, v: Option<f64>) {
    match v {
        None => out.push(0),
        Some(f) => {
            out.push(1);
            put_u64(out, f.to_bits());
        }
    }
}

fn put_str16(out: &mut Vec<u8>, s: &str) {
    let s = truncate(s, usize::from(u16::MAX));
    put_u16(out, s.len() as u16);
    out.extend_from_slice(s.as_bytes());
}

/// The longest prefix of `s` of at most `max` bytes that ends on a character
/// boundary.
fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s.get(..end).unwrap_or("")
}

fn clamp_list<T>(items: &[T]) -> &[T] {
    items.get(..MAX_LIST).unwrap_or(items)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::collection::vec;
    use proptest::prelude::*;

    fn enc_c(m: &ClientMsg) -> Vec<u8> {
        let mut v = Vec::new();
        encode_client(m, &mut v);
        v
    }

    fn enc_s(m: &ServerMsg) -> Vec<u8> {
        let mut v = Vec::new();
        encode_server(m, &mut v);
        v
    }

    /// Builds a frame by hand, to feed the decoders what no encoder writes.
    fn frame(ty: u8, payload: &[u8]) -> Vec<u8> {
        let mut v = ((payload.len() + 1) as u32).to_le_bytes().to_vec();
        v.push(ty);
        v.extend_from_slice(payload);
        v
    }

    fn uuid(n: u8) -> [u8; 16] {
        [n; 16]
    }

    fn samples_client() -> Vec<ClientMsg> {
        vec![
            ClientMsg::hello(1234, Role::Shim),
            ClientMsg::hello(u32::MAX, Role::Cli),
            ClientMsg::Register {
                command: "python train.py — ünïcode".into(),
                devices: vec![
                    DeviceReg {
                        uuid: uuid(1),
                        ordinal: 0,
                        mem_cap: 4 << 30,
                        mem_total: 80 << 30,
                    },
                    DeviceReg {
                        uuid: uuid(2),
                        ordinal: 1,
                        mem_cap: 0,
                        mem_total: 80 << 30,
                    },
                ],
                share: Some(30.0),
                limit: None,
                priority: Priority::High,
            },
            ClientMsg::Register {
                command: String::new(),
                devices: vec![],
                share: None,
                limit: Some(12.5),
                priority: Priority::Low,
            },
            ClientMsg::Usage {
                uuid: uuid(3),
                used: 1,
                peak: u64::MAX,
                ooms: 7,
            },
            ClientMsg::Acquire { uuid: uuid(4) },
            ClientMsg::Drained { uuid: uuid(5) },
            ClientMsg::Release {
                uuid: uuid(5),
                held_ns: 50_000_000,
            },
            ClientMsg::Status { from: 0 },
            ClientMsg::Status { from: 7 },
            ClientMsg::Ping,
            ClientMsg::Join { job: u64::MAX },
            ClientMsg::Lease(LeaseReq {
                want_gpus: 2,
                want_mem: 0,
                compute: None,
                limit: None,
                no_wait: false,
                command: "torchrun --nproc_per_node=2 train.py".into(),
                priority: None,
                resume: 0,
                token: 0,
                pin: Vec::new(),
            }),
            ClientMsg::Lease(LeaseReq {
                want_gpus: 0,
                want_mem: 4 << 30,
                compute: Some(30.0),
                limit: Some(50.0),
                no_wait: true,
                command: String::new(),
                priority: Some(Priority::High),
                resume: u64::MAX,
                token: 0,
                pin: Vec::new(),
            }),
            ClientMsg::Lease(LeaseReq {
                want_gpus: 0,
                want_mem: 0,
                compute: Some(25.0),
                limit: None,
                no_wait: false,
                command: "k8s pod".into(),
                priority: None,
                resume: 0,
                token: u64::MAX - 1,
                pin: vec![
                    Pin {
                        uuid: uuid(1),
                        mem: 4 << 30,
                    },
                    Pin {
                        uuid: uuid(2),
                        mem: 1,
                    },
                ],
            }),
            ClientMsg::Name {
                pod: "default/infer-0".into(),
                label: "k8s default/infer-0 (container main)".into(),
            },
        ]
    }

    fn samples_server() -> Vec<ServerMsg> {
        vec![
            ServerMsg::HelloOk { version: 1 },
            ServerMsg::Error {
                code: ERR_VERSION,
                message: "protocol version 2 not supported; this broker speaks 1".into(),
            },
            ServerMsg::Grant {
                uuid: uuid(1),
                grant: 1,
                slice_ns: 0,
                bound_ns: 0,
                waiters: false,
            },
            ServerMsg::Grant {
                uuid: uuid(1),
                grant: 2,
                slice_ns: 50_000_000,
                bound_ns: 250_000,
                waiters: true,
            },
            ServerMsg::Revoke {
                uuid: uuid(2),
                grant: 2,
            },
            ServerMsg::StatusReply {
                json: r#"{"gpus":[]}"#.into(),
            },
            ServerMsg::StatusReply {
                json: "x".repeat(100_000),
            },
            ServerMsg::Queued {
                position: 3,
                waiting_for: "2 GPUs".into(),
                token: 77,
            },
            ServerMsg::Registered { mem_cap: 0 },
            ServerMsg::Pong,
            ServerMsg::Registered { mem_cap: 4 << 30 },
            ServerMsg::Leased(Lease {
                gpus: vec![0, 1],
                uuids: vec![uuid(1), uuid(2)],
                mem_cap: 0,
                token: 1,
                mps_pipe: String::new(),
                mig: String::new(),
            }),
            ServerMsg::Leased(Lease {
                gpus: vec![],
                uuids: vec![],
                mem_cap: 4 << 30,
                token: u64::MAX,
                mps_pipe: "/run/gpufrac/mps-pipe".into(),
                mig: String::new(),
            }),
            ServerMsg::Leased(Lease {
                gpus: vec![0],
                uuids: vec![uuid(1)],
                mem_cap: 4864 << 20,
                token: 7,
                mps_pipe: String::new(),
                mig: "MIG-3c1e6f7a-c0de-4000-8000-000000000001".into(),
            }),
            ServerMsg::Refused {
                reason: "no GPU on this node has 200 GiB".into(),
            },
        ]
    }

    /// Errors name messages as this specification does: a name is the
    /// variant's, so it cannot drift from the code.
    #[test]
    fn every_message_is_named_as_its_variant() {
        let debug = |d: String| d.split([' ', '(', '{']).next().unwrap_or("").to_string();
        for m in samples_client() {
            assert_eq!(m.name(), debug(format!("{m:?}")));
        }
        for m in samples_server() {
            assert_eq!(m.name(), debug(format!("{m:?}")));
        }
    }

    #[test]
    fn samples_round_trip() {
        for m in samples_client() {
            let bytes = enc_c(&m);
            assert_eq!(decode_client(&bytes), Ok((m.clone(), bytes.len())), "{m:?}");
            assert!(
                decode_server(&bytes).is_err(),
                "{m:?} read as a server message"
            );
        }
        for m in samples_server() {
            let bytes = enc_s(&m);
            assert_eq!(decode_server(&bytes), Ok((m.clone(), bytes.len())), "{m:?}");
            assert!(
                decode_client(&bytes).is_err(),
                "{m:?} read as a client message"
            );
        }
    }

    #[test]
    fn uuids_parse_as_cuda_gives_them() {
        let u = parse_uuid("GPU-5a1e6f7a-c0de-4000-8000-000000000001").unwrap();
        assert_eq!((u[0], u[15]), (0x5a, 1));
        assert_eq!(
            parse_uuid("MIG-5a1e6f7a-c0de-4000-8000-000000000001"),
            Some(u)
        );
        assert_eq!(parse_uuid("GPU-zz"), None);
        assert_eq!(parse_uuid("5a1e6f7a-c0de-4000-8000-000000000001"), None);
        assert_eq!(
            parse_uuid("MIG-GPU-5a1e6f7a-c0de-4000-8000-000000000001/1/0"),
            None
        );
    }

    #[test]
    fn uuid_string_is_what_parse_uuid_reads() {
        let text = "GPU-5a1e6f7a-c0de-4000-8000-000000000001";
        let u = parse_uuid(text).unwrap();
        assert_eq!(uuid_string(&u), text);
        let all: [u8; 16] = std::array::from_fn(|i| (i as u8) * 17);
        assert_eq!(parse_uuid(&uuid_string(&all)), Some(all));
    }

    #[test]
    fn layout_is_frozen() {
        // Catches accidental changes to what other versions rely on.
        assert_eq!(
            enc_c(&ClientMsg::hello(0x0102_0304, Role::Shim)),
            [
                14, 0, 0, 0, 0x01, b'G', b'P', b'F', b'R', 4, 0, 4, 3, 2, 1, 1, 5, 0
            ]
        );
        // A range of one version is written as versions up to 4 wrote it.
        assert_eq!(
            enc_c(&ClientMsg::Hello {
                magic: MAGIC,
                version: 4,
                pid: 0x0102_0304,
                role: Role::Shim,
                max_version: 4,
            }),
            [
                12, 0, 0, 0, 0x01, b'G', b'P', b'F', b'R', 4, 0, 4, 3, 2, 1, 1
            ]
        );
        assert_eq!(
            enc_s(&ServerMsg::HelloOk { version: 1 }),
            [3, 0, 0, 0, 0x81, 1, 0]
        );
        assert_eq!(
            enc_s(&ServerMsg::Error {
                code: 1,
                message: "no".into()
            }),
            [7, 0, 0, 0, 0x82, 1, 0, 2, 0, b'n', b'o']
        );
        assert_eq!(
            enc_c(&ClientMsg::Status { from: 3 }),
            [5, 0, 0, 0, 0x06, 3, 0, 0, 0]
        );
        // Then version 4's chosen token and pins (one here).
        let mut want = vec![35 + 8 + 2 + 24, 0, 0, 0, 0x07, 2, 0, 0, 0];
        want.extend_from_slice(&0u64.to_le_bytes());
        want.extend_from_slice(&[1]);
        want.extend_from_slice(&30.0f64.to_bits().to_le_bytes());
        want.extend_from_slice(&[0, 1, 0, 0, 0]);
        want.extend_from_slice(&9u64.to_le_bytes());
        want.extend_from_slice(&7u64.to_le_bytes());
        want.extend_from_slice(&[1, 0]);
        want.extend_from_slice(&[0xcd; 16]);
        want.extend_from_slice(&(4u64 << 30).to_le_bytes());
        assert_eq!(
            enc_c(&ClientMsg::Lease(LeaseReq {
                want_gpus: 2,
                want_mem: 0,
                compute: Some(30.0),
                limit: None,
                no_wait: true,
                command: String::new(),
                priority: None,
                resume: 9,
                token: 7,
                pin: vec![Pin {
                    uuid: [0xcd; 16],
                    mem: 4 << 30,
                }],
            })),
            want
        );
        assert_eq!(
            enc_c(&ClientMsg::Name {
                pod: "a/b".into(),
                label: "c".into()
            }),
            [9, 0, 0, 0, 0x0b, 3, 0, b'a', b'/', b'b', 1, 0, b'c']
        );
        // Version 4's lease: GPU 0, its UUID, the cap, the token, no MPS
        // pipe, the MIG device last.
        let mut want = vec![0x87, 1, 0, 0, 0, 0, 0, 1, 0];
        want.extend_from_slice(&[0xab; 16]);
        want.extend_from_slice(&5u64.to_le_bytes());
        want.extend_from_slice(&9u64.to_le_bytes());
        want.extend_from_slice(&[0, 0, 5, 0]);
        want.extend_from_slice(b"MIG-x");
        let mut framed = (want.len() as u32).to_le_bytes().to_vec();
        framed.extend_from_slice(&want);
        assert_eq!(
            enc_s(&ServerMsg::Leased(Lease {
                gpus: vec![0],
                uuids: vec![[0xab; 16]],
                mem_cap: 5,
                token: 9,
                mps_pipe: String::new(),
                mig: "MIG-x".into(),
            })),
            framed
        );
    }

    #[test]
    fn hello_from_a_newer_version_is_still_read() {
        let mut payload = b"GPFR".to_vec();
        payload.extend_from_slice(&7u16.to_le_bytes());
        payload.extend_from_slice(&42u32.to_le_bytes());
        payload.push(2);
        payload.extend_from_slice(&9u16.to_le_bytes());
        payload.extend_from_slice(b"fields of version 7");
        let bytes = frame(T_HELLO, &payload);
        let (msg, used) = decode_client(&bytes).unwrap();
        assert_eq!(used, bytes.len());
        let ClientMsg::Hello {
            magic,
            version,
            pid,
            role,
            max_version,
        } = msg
        else {
            panic!("{msg:?}");
        };
        assert_eq!(
            (magic, version, pid, role, max_version),
            (MAGIC, 7, 42, Role::Cli, 9)
        );
        let ServerMsg::Error { code, message } = hello_reply(magic, version, max_version) else {
            panic!()
        };
        assert_eq!(code, ERR_VERSION);
        assert_eq!(
            message,
            format!(
                "protocol versions 7 to 9 not supported; this broker (gpufrac {}) speaks versions \
                 {MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION}: the client is newer than this broker: \
                 upgrade gpufrac on this node and restart the broker, or run the client with the \
                 broker's release",
                env!("CARGO_PKG_VERSION")
            )
        );
        assert!(!message.contains('\n'));

        let bytes = frame(T_HELLO_OK, &[7, 0, 9, 9, 9]);
        assert_eq!(
            decode_server(&bytes),
            Ok((ServerMsg::HelloOk { version: 7 }, bytes.len()))
        );
        let bytes = frame(T_ERROR, &[1, 0, 1, 0, b'x', 0xff, 0xff]);
        assert_eq!(
            decode_server(&bytes),
            Ok((
                ServerMsg::Error {
                    code: 1,
                    message: "x".into()
                },
                bytes.len()
            ))
        );
    }

    /// Versions up to 4 sent one version, in the field that now holds the
    /// lowest: read as a range of one.
    #[test]
    fn hello_of_version_4_is_read_as_it_was_meant() {
        let bytes = frame(T_HELLO, b"GPFR\x04\x00\x2a\x00\x00\x00\x01");
        let (msg, used) = decode_client(&bytes).unwrap();
        assert_eq!(used, bytes.len());
        assert!(matches!(
            msg,
            ClientMsg::Hello {
                version: 4,
                max_version: 4,
                pid: 42,
                role: Role::Shim,
                ..
            }
        ));
        assert_eq!(hello_reply(MAGIC, 4, 4), ServerMsg::HelloOk { version: 4 });
    }

    #[test]
    fn hello_replies() {
        // The highest version both speak.
        assert_eq!(
            hello_reply(MAGIC, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION),
            ServerMsg::HelloOk {
                version: PROTOCOL_VERSION
            }
        );
        assert_eq!(
            hello_reply(MAGIC, 1, PROTOCOL_VERSION + 3),
            ServerMsg::HelloOk {
                version: PROTOCOL_VERSION
            }
        );
        assert_eq!(
            hello_reply(MAGIC, PROTOCOL_VERSION, PROTOCOL_VERSION + 3),
            ServerMsg::HelloOk {
                version: PROTOCOL_VERSION
            }
        );
        assert!(matches!(
            hello_reply(*b"HTTP", PROTOCOL_VERSION, PROTOCOL_VERSION),
            ServerMsg::Error {
                code: ERR_BAD_FRAME,
                ..
            }
        ));
        let ServerMsg::Error { code, message } = hello_reply(MAGIC, 1, 3) else {
            panic!()
        };
        assert_eq!(code, ERR_VERSION);
        assert!(
            message.starts_with("protocol versions 1 to 3 not supported")
                && message.contains("the client is older"),
            "{message}"
        );
        assert!(matches!(
            hello_reply(MAGIC, 0, 0),
            ServerMsg::Error {
                code: ERR_VERSION,
                ..
            }
        ));
        assert_eq!(accept_version(PROTOCOL_VERSION), Ok(PROTOCOL_VERSION));
        assert_eq!(
            accept_version(MIN_PROTOCOL_VERSION),
            Ok(MIN_PROTOCOL_VERSION)
        );
        let e = accept_version(PROTOCOL_VERSION + 1).unwrap_err();
        assert!(
            e.contains(&format!("protocol version {}", PROTOCOL_VERSION + 1))
                && e.contains("restart the broker"),
            "{e}"
        );
    }

    #[test]
    fn partial_frames_are_incomplete() {
        for m in samples_client() {
            let bytes = enc_c(&m);
            for cut in 0..bytes.len() {
                assert_eq!(
                    decode_client(&bytes[..cut]),
                    Err(DecodeError::Incomplete),
                    "{m:?} cut at {cut}"
                );
            }
        }
        for m in samples_server() {
            let bytes = enc_s(&m);
            for cut in (0..bytes.len()).step_by(97).chain([bytes.len() - 1]) {
                assert_eq!(decode_server(&bytes[..cut]), Err(DecodeError::Incomplete));
            }
        }
    }

    #[test]
    fn oversized_length_is_refused_before_the_body_arrives() {
        let too_big = MAX_FRAME + 1;
        let header = too_big.to_le_bytes();
        assert_eq!(decode_client(&header), Err(DecodeError::TooLarge(too_big)));
        assert_eq!(decode_server(&header), Err(DecodeError::TooLarge(too_big)));
        let header = u32::MAX.to_le_bytes();
        assert_eq!(decode_client(&header), Err(DecodeError::TooLarge(u32::MAX)));
        // "GET " from a confused HTTP client reads as a huge length.
        assert!(matches!(
            decode_client(b"GET / HTTP/1.1\r\n"),
            Err(DecodeError::TooLarge(_))
        ));
        // Exactly the limit is allowed, so only waits for more; a client
        // frame has a lower limit than a broker's.
        assert_eq!(
            decode_client(&MAX_CLIENT_FRAME.to_le_bytes()),
            Err(DecodeError::Incomplete)
        );
        assert_eq!(
            decode_client(&(MAX_CLIENT_FRAME + 1).to_le_bytes()),
            Err(DecodeError::TooLarge(MAX_CLIENT_FRAME + 1))
        );
        assert_eq!(
            decode_server(&MAX_FRAME.to_le_bytes()),
            Err(DecodeError::Incomplete)
        );
    }

    #[test]
    fn back_to_back_frames_decode_in_sequence() {
        let msgs = samples_client();
        let mut stream = Vec::new();
        for m in &msgs {
            encode_client(m, &mut stream);
        }
        let mut at = 0;
        for m in &msgs {
            let (got, used) = decode_client(&stream[at..]).unwrap();
            assert_eq!(&got, m);
            at += used;
        }
        assert_eq!(at, stream.len());
        assert_eq!(decode_client(&stream[at..]), Err(DecodeError::Incomplete));

        let msgs = samples_server();
        let mut stream = Vec::new();
        for m in &msgs {
            encode_server(m, &mut stream);
        }
        let mut rest = &stream[..];
        for m in &msgs {
            let (got, used) = decode_server(rest).unwrap();
            assert_eq!(&got, m);
            rest = &rest[used..];
        }
        assert!(rest.is_empty());
    }

    #[test]
    fn encoders_append() {
        let mut out = vec![0xAA];
        encode_client(&ClientMsg::Status { from: 0 }, &mut out);
        assert_eq!(out, [0xAA, 5, 0, 0, 0, T_STATUS, 0, 0, 0, 0]);
    }

    #[test]
    fn malformed_frames() {
        let m = |ty: u8, payload: &[u8]| decode_client(&frame(ty, payload)).unwrap_err();
        assert_eq!(
            decode_client(&[0, 0, 0, 0]),
            Err(DecodeError::Malformed("empty frame"))
        );
        assert_eq!(
            decode_server(&[0, 0, 0, 0, 1]),
            Err(DecodeError::Malformed("empty frame"))
        );
        assert_eq!(m(0x00, &[]), DecodeError::UnknownType(0));
        assert_eq!(m(0x0f, &[]), DecodeError::UnknownType(0x0f));
        assert_eq!(m(T_HELLO_OK, &[1, 0]), DecodeError::UnknownType(T_HELLO_OK));
        assert_eq!(
            decode_server(&frame(T_HELLO, &[])),
            Err(DecodeError::UnknownType(T_HELLO))
        );
        assert_eq!(
            m(T_STATUS, &[0; 5]),
            DecodeError::Malformed("trailing bytes after the message")
        );
        assert_eq!(
            m(T_ACQUIRE, &[0; 15]),
            DecodeError::Malformed("payload too short")
        );
        assert_eq!(
            m(T_HELLO, b"GPFR\x01\x00\x01\x00\x00\x00\x03"),
            DecodeError::Malformed("unknown role")
        );
        assert_eq!(
            m(T_HELLO, b"GPFR\x01\x00\x01\x00\x00\x00"),
            DecodeError::Malformed("payload too short")
        );

        // Register with invalid UTF-8 in the command.
        assert_eq!(
            m(T_REGISTER, &[2, 0, 0xC3, 0x28, 0, 0, 0, 0]),
            DecodeError::Malformed("string is not UTF-8")
        );
        // String length past the payload.
        assert_eq!(
            m(T_REGISTER, &[9, 0, b'a']),
            DecodeError::Malformed("payload too short")
        );
        // A device count the payload cannot hold is refused before
        // allocating.
        assert_eq!(
            m(T_REGISTER, &[0, 0, 0xFF, 0x0F, 0, 0]),
            DecodeError::Malformed("list longer than the payload")
        );
        assert_eq!(
            m(T_REGISTER, &[0, 0, 0xFF, 0xFF, 0, 0]),
            DecodeError::Malformed("list too long")
        );
        // Option tag 2.
        assert_eq!(
            m(T_REGISTER, &[0, 0, 0, 0, 2, 0]),
            DecodeError::Malformed("option tag is neither 0 nor 1")
        );
        // Lease with no_wait = 2.
        let mut lease = vec![0; 12];
        lease.extend_from_slice(&[0, 0, 2, 0, 0]);
        assert_eq!(
            m(T_LEASE, &lease),
            DecodeError::Malformed("bool is neither 0 nor 1")
        );

        let s = |ty: u8, payload: &[u8]| decode_server(&frame(ty, payload)).unwrap_err();
        assert_eq!(
            s(T_STATUS_REPLY, &[5, 0, 0, 0, b'{', b'}']),
            DecodeError::Malformed("payload too short")
        );
        assert_eq!(
            s(T_STATUS_REPLY, &[0xFF, 0xFF, 0xFF, 0xFF]),
            DecodeError::Malformed("payload too short")
        );
        assert_eq!(
            s(T_STATUS_REPLY, &[1, 0, 0, 0, 0xFF]),
            DecodeError::Malformed("string is not UTF-8")
        );
        assert_eq!(
            s(T_LEASED, &[2, 0, 1, 0, 0, 0]),
            DecodeError::Malformed("list longer than the payload")
        );
        assert_eq!(
            s(T_GRANT, &[0; 42]),
            DecodeError::Malformed("trailing bytes after the message")
        );
        assert_eq!(s(0x8f, &[]), DecodeError::UnknownType(0x8f));

        let mut reg = vec![0, 0, 0, 0, 0, 0];
        reg.push(3);
        assert_eq!(
            m(T_REGISTER, &reg),
            DecodeError::Malformed("unknown priority")
        );
    }

    #[test]
    fn oversized_fields_are_cut_to_fit() {
        // 3-byte characters, so the cut must step back to a boundary.
        let long = "€".repeat(30_000);
        let m = ClientMsg::Lease(LeaseReq {
            want_gpus: 1,
            want_mem: 0,
            compute: None,
            limit: None,
            no_wait: false,
            command: long.clone(),
            priority: Some(Priority::Low),
            resume: 0,
            token: 0,
            pin: Vec::new(),
        });
        let bytes = enc_c(&m);
        let (ClientMsg::Lease(LeaseReq { command, .. }), used) = decode_client(&bytes).unwrap()
        else {
            panic!()
        };
        assert_eq!(used, bytes.len());
        assert_eq!(command.len(), 65_535);
        assert!(long.starts_with(&command));

        let json = "é".repeat(MAX_FRAME as usize);
        let bytes = enc_s(&ServerMsg::StatusReply { json: json.clone() });
        assert!(bytes.len() <= MAX_FRAME as usize + 4);
        let (ServerMsg::StatusReply { json: got }, _) = decode_server(&bytes).unwrap() else {
            panic!()
        };
        assert!(got.len() <= MAX_STATUS_JSON && got.len() > MAX_STATUS_JSON - 2);
        assert!(json.starts_with(&got));

        let fits = "j".repeat(MAX_STATUS_JSON);
        let bytes = enc_s(&ServerMsg::StatusReply { json: fits.clone() });
        assert_eq!(bytes.len(), MAX_FRAME as usize + 4);
        assert_eq!(
            decode_server(&bytes).unwrap().0,
            ServerMsg::StatusReply { json: fits }
        );

        let dev = DeviceReg {
            uuid: uuid(9),
            ordinal: 1,
            mem_cap: 2,
            mem_total: 3,
        };
        let m = ClientMsg::Register {
            command: long,
            devices: vec![dev; 70_000],
            share: Some(1.0),
            limit: Some(2.0),
            priority: Priority::Normal,
        };
        let bytes = enc_c(&m);
        assert!(bytes.len() <= MAX_FRAME as usize + 4);
        let (ClientMsg::Register { devices, .. }, _) = decode_client(&bytes).unwrap() else {
            panic!()
        };
        assert_eq!(devices.len(), MAX_LIST);

        let m = ServerMsg::Leased(Lease {
            gpus: vec![7; 70_000],
            uuids: vec![uuid(1); 70_000],
            mem_cap: 5,
            token: 6,
            mps_pipe: String::new(),
            mig: String::new(),
        });
        let (ServerMsg::Leased(Lease { gpus, uuids, .. }), _) = decode_server(&enc_s(&m)).unwrap()
        else {
            panic!()
        };
        assert_eq!((gpus.len(), uuids.len()), (MAX_LIST, MAX_LIST));
    }

    #[test]
    fn nan_travels_bit_for_bit() {
        let odd_nan = f64::from_bits(0x7FF8_0000_DEAD_BEEF);
        let m = ClientMsg::Register {
            command: String::new(),
            devices: vec![],
            share: Some(odd_nan),
            limit: Some(-0.0),
            priority: Priority::High,
        };
        let (ClientMsg::Register { share, limit, .. }, _) = decode_client(&enc_c(&m)).unwrap()
        else {
            panic!()
        };
        assert_eq!(share.map(f64::to_bits), Some(odd_nan.to_bits()));
        assert_eq!(limit.map(f64::to_bits), Some((-0.0f64).to_bits()));
    }

    #[test]
    fn errors_display() {
        assert_eq!(DecodeError::Incomplete.to_string(), "incomplete frame");
        assert_eq!(
            DecodeError::TooLarge(2_000_000).to_string(),
            "frame of 2000000 bytes exceeds the size limit"
        );
        assert_eq!(
            DecodeError::UnknownType(0x42).to_string(),
            "unknown message type 0x42"
        );
        assert_eq!(
            DecodeError::Malformed("x").to_string(),
            "malformed frame: x"
        );
    }

    // NaN is left out so that == can compare; nan_travels_bit_for_bit covers
    // it.
    fn float() -> impl Strategy<Value = f64> {
        use proptest::num::f64::{INFINITE, NEGATIVE, NORMAL, POSITIVE, SUBNORMAL, ZERO};
        POSITIVE | NEGATIVE | NORMAL | SUBNORMAL | ZERO | INFINITE
    }

    fn role() -> impl Strategy<Value = Role> {
        prop_oneof![Just(Role::Shim), Just(Role::Cli)]
    }

    fn device() -> impl Strategy<Value = DeviceReg> {
        (any::<[u8; 16]>(), any::<u32>(), any::<u64>(), any::<u64>()).prop_map(
            |(uuid, ordinal, mem_cap, mem_total)| DeviceReg {
                uuid,
                ordinal,
                mem_cap,
                mem_total,
            },
        )
    }

    fn client_msg() -> impl Strategy<Value = ClientMsg> {
        prop_oneof![
            (
                any::<[u8; 4]>(),
                any::<u16>(),
                any::<u32>(),
                role(),
                any::<u16>()
            )
                .prop_map(|(magic, version, pid, role, max_version)| {
                    ClientMsg::Hello {
                        magic,
                        version,
                        pid,
                        role,
                        max_version,
                    }
                }),
            (
                any::<String>(),
                vec(device(), 0..6),
                proptest::option::of(float()),
                proptest::option::of(float()),
                proptest::sample::select(Priority::ALL.to_vec()),
            )
                .prop_map(|(command, devices, share, limit, priority)| {
                    ClientMsg::Register {
                        command,
                        devices,
                        share,
                        limit,
                        priority,
                    }
                }),
            any::<[u8; 16]>().prop_map(|uuid| ClientMsg::Drained { uuid }),
            (any::<[u8; 16]>(), any::<u64>(), any::<u64>(), any::<u64>()).prop_map(
                |(uuid, used, peak, ooms)| ClientMsg::Usage {
                    uuid,
                    used,
                    peak,
                    ooms
                }
            ),
            any::<[u8; 16]>().prop_map(|uuid| ClientMsg::Acquire { uuid }),
            (any::<[u8; 16]>(), any::<u64>())
                .prop_map(|(uuid, held_ns)| ClientMsg::Release { uuid, held_ns }),
            any::<u32>().prop_map(|from| ClientMsg::Status { from }),
            Just(ClientMsg::Ping),
            any::<u64>().prop_map(|job| ClientMsg::Join { job }),
            (any::<String>(), any::<String>())
                .prop_map(|(pod, label)| ClientMsg::Name { pod, label }),
            (
                any::<u32>(),
                any::<u64>(),
                proptest::option::of(float()),
                proptest::option::of(float()),
                any::<bool>(),
                any::<String>()
            )
                .prop_map(|(want_gpus, want_mem, compute, limit, no_wait, command)| {
                    ClientMsg::Lease(LeaseReq {
                        want_gpus,
                        want_mem,
                        compute,
                        limit,
                        no_wait,
                        command,
                        priority: None,
                        resume: want_mem.rotate_left(7),
                        token: want_mem.rotate_left(13),
                        pin: if no_wait {
                            Vec::new()
                        } else {
                            vec![Pin {
                                uuid: [want_gpus as u8; 16],
                                mem: want_mem,
                            }]
                        },
                    })
                }),
        ]
    }

    fn server_msg() -> impl Strategy<Value = ServerMsg> {
        prop_oneof![
            any::<u16>().prop_map(|version| ServerMsg::HelloOk { version }),
            (any::<u16>(), any::<String>())
                .prop_map(|(code, message)| ServerMsg::Error { code, message }),
            (any::<[u8; 16]>(), any::<u64>(), any::<u64>()).prop_map(|(uuid, grant, slice_ns)| {
                ServerMsg::Grant {
                    uuid,
                    grant,
                    slice_ns,
                    bound_ns: slice_ns / 3,
                    waiters: grant % 2 == 0,
                }
            }),
            (any::<[u8; 16]>(), any::<u64>())
                .prop_map(|(uuid, grant)| ServerMsg::Revoke { uuid, grant }),
            any::<String>().prop_map(|json| ServerMsg::StatusReply { json }),
            (any::<u32>(), any::<String>(), any::<u64>()).prop_map(
                |(position, waiting_for, token)| ServerMsg::Queued {
                    position,
                    waiting_for,
                    token,
                }
            ),
            any::<u64>().prop_map(|mem_cap| ServerMsg::Registered { mem_cap }),
            Just(ServerMsg::Pong),
            (
                vec(any::<u32>(), 0..8),
                vec(any::<[u8; 16]>(), 0..8),
                any::<u64>()
            )
                .prop_map(|(gpus, uuids, mem_cap)| ServerMsg::Leased(Lease {
                    gpus,
                    uuids,
                    mem_cap,
                    token: mem_cap ^ 0x5a5a,
                    mps_pipe: String::new(),
                    mig: if mem_cap % 2 == 0 {
                        String::new()
                    } else {
                        format!("MIG-{mem_cap:x}")
                    },
                })),
            any::<String>().prop_map(|reason| ServerMsg::Refused { reason }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn client_round_trip(m in client_msg(), prefix in vec(any::<u8>(), 0..4)) {
            let bytes = enc_c(&m);
            prop_assert_eq!(decode_client(&bytes), Ok((m.clone(), bytes.len())));
            // Followed by anything, the frame still decodes alone.
            let mut longer = bytes.clone();
            longer.extend_from_slice(&prefix);
            prop_assert_eq!(decode_client(&longer), Ok((m, bytes.len())));
        }

        #[test]
        fn server_round_trip(m in server_msg(), tail in vec(any::<u8>(), 0..4)) {
            let bytes = enc_s(&m);
            prop_assert_eq!(decode_server(&bytes), Ok((m.clone(), bytes.len())));
            let mut longer = bytes.clone();
            longer.extend_from_slice(&tail);
            prop_assert_eq!(decode_server(&longer), Ok((m, bytes.len())));
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in vec(any::<u8>(), 0..300)) {
            check_sane(&bytes);
        }

        #[test]
        fn arbitrary_payloads_never_panic(ty in any::<u8>(), payload in vec(any::<u8>(), 0..300)) {
            // A correct length field gets past framing into the message
            // parsers, which random lengths rarely do.
            check_sane(&frame(ty, &payload));
            let t = if ty & 1 == 0 { T_REGISTER } else { T_LEASED };
            check_sane(&frame(t, &payload));
            // Hello of any version, with anything appended.
            let mut hello = b"GPFR".to_vec();
            hello.extend_from_slice(&payload);
            check_sane(&frame(T_HELLO, &hello));
        }

        /// Negotiation: the broker's answer is the highest version in both
        /// ranges, and a refusal (one line) comes only when there is none.
        #[test]
        fn hello_picks_the_highest_common_version(min in 0u16..12, span in 0u16..6, wide in any::<u16>()) {
            let (lo, hi) = (min, min + span);
            let ours = MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION;
            let best = (lo..=hi).rev().find(|v| ours.contains(v));
            match hello_reply(MAGIC, lo, hi) {
                ServerMsg::HelloOk { version } => {
                    prop_assert_eq!(Some(version), best);
                    prop_assert_eq!(accept_version(version), Ok(version));
                }
                ServerMsg::Error { code, message } => {
                    prop_assert_eq!(best, None);
                    prop_assert_eq!(code, ERR_VERSION);
                    prop_assert!(!message.contains('\n'));
                    prop_assert!(message.contains(&lo.to_string()) && message.contains(&hi.to_string()));
                }
                other => prop_assert!(false, "{:?}", other),
            }
            // Whatever a client sends, the broker answers without panicking.
            let _ = hello_reply(MAGIC, wide, wide.wrapping_mul(7));
        }

        #[test]
        fn truncated_frames_are_incomplete(m in client_msg(), s in server_msg(), cut in any::<prop::sample::Index>()) {
            let bytes = enc_c(&m);
            let at = cut.index(bytes.len());
            prop_assert_eq!(decode_client(&bytes[..at]), Err(DecodeError::Incomplete));
            let bytes = enc_s(&s);
            let at = cut.index(bytes.len());
            prop_assert_eq!(decode_server(&bytes[..at]), Err(DecodeError::Incomplete));
        }

        #[test]
        fn damaged_frames_never_panic(
            m in client_msg(),
            s in server_msg(),
            flips in vec((any::<prop::sample::Index>(), 0u8..8), 1..4),
            cut in any::<prop::sample::Index>(),
        ) {
            for mut bytes in [enc_c(&m), enc_s(&s)] {
                for (at, bit) in &flips {
                    let i = at.index(bytes.len());
                    bytes[i] ^= 1 << bit;
                }
                check_sane(&bytes);
                let at = cut.index(bytes.len() + 1);
                check_sane(&bytes[..at]);
            }
        }
    }

    /// Decoding anything either succeeds within the buffer or fails, and a
    /// successful decode re-encodes to exactly the bytes it consumed (for
    /// the strict messages) or a prefix of them (for the extensible ones).
    fn check_sane(bytes: &[u8]) {
        if let Ok((m, used)) = decode_client(bytes) {
            assert!(used <= bytes.len());
            let again = enc_c(&m);
            assert!(again.len() <= used);
            if !matches!(m, ClientMsg::Hello { .. }) {
                assert_eq!(again, bytes[..used]);
            }
        }
        if let Ok((m, used)) = decode_server(bytes) {
            assert!(used <= bytes.len());
            let again = enc_s(&m);
            assert!(again.len() <= used);
            if !matches!(m, ServerMsg::HelloOk { .. } | ServerMsg::Error { .. }) {
                assert_eq!(again, bytes[..used]);
            }
        }
    }
}
