//! What one frame costs: for each message a client may send, the largest
//! inputs the protocol and /proc allow (the longest strings a frame holds,
//! of control characters, each escaped to four bytes; the longest lists;
//! a process at the bottom of a chain of 100), and the work the core did
//! for it (`Cost`: bytes decoded and escaped, /proc files read, bytes
//! produced) held under a constant that no input moves. Before, a
//! `Register` read and escaped a whole 2 MiB argv and a `Name` escaped
//! 128 KiB of control characters, then cut each to 256 bytes.

use super::*;
use crate::proto::turns::{Cost, FRAME_WORK, PROC_READ_WORK};

/// The longest string a frame's field holds, of control characters.
fn hostile() -> String {
    "\u{1}".repeat(usize::from(u16::MAX))
}

/// The most a frame may cost besides a status page: its decoding, its
/// text escaped as far as the label and pod limits keep, the deepest
/// ancestry's /proc reads, and a short reply.
fn frame_bound(bytes: usize) -> u64 {
    FRAME_WORK + 2 * bytes as u64 + 4 * 600 + 65 * PROC_READ_WORK + 1024
}

/// What `m`, sent on `id`, cost: the work by kind, the stand-in /proc's
/// files read, and the frame's length.
fn cost_of(t: &mut T, id: ConnId, m: &ClientMsg) -> (Cost, u64, usize) {
    let mut bytes = Vec::new();
    wire::encode_client(m, &mut bytes);
    assert!(bytes.len() <= wire::MAX_CLIENT_FRAME as usize);
    let (before, reads) = (t.b.cost(), t.proc_reads.get());
    t.b.input(t.now, id, &bytes);
    (
        t.b.cost().since(&before),
        t.proc_reads.get() - reads,
        bytes.len(),
    )
}

/// Within the constant: the frame decoded once, at most 64 /proc files,
/// the escaping stopped at its limits, a short reply.
fn assert_bounded(what: &str, c: Cost, proc_files: u64, len: usize) {
    assert_eq!(c.frames, 1, "{what}: {c:?}");
    assert!(
        c.decoded <= len as u64 && c.read <= len as u64,
        "{what}: {c:?}"
    );
    assert!(proc_files <= 65, "{what}: {proc_files} /proc files read");
    assert!(c.proc_reads <= 64, "{what}: {c:?}");
    assert!(c.escaped <= 4 * 600, "{what}: {} bytes escaped", c.escaped);
    assert!(c.sent <= 1024, "{what}: {} bytes sent", c.sent);
    assert!(
        c.units() <= frame_bound(len),
        "{what}: {} units for a frame of {len} bytes",
        c.units()
    );
}

/// A process at the bottom of a chain of 100: its ancestry is the most
/// /proc a registration can read.
fn deep(t: &mut T) -> u32 {
    let mut p = 1;
    for _ in 0..100 {
        p = t.spawn(p);
    }
    p
}

#[test]
fn hello_with_the_longest_tail_costs_its_bytes() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let p = t.spawn(1);
    let c = t.connect_raw(p, BOB);
    // A hello may carry fields of later versions: a whole frame's worth.
    let mut bytes = Vec::new();
    wire::encode_client(&ClientMsg::hello(p, Role::Shim), &mut bytes);
    let tail = wire::MAX_CLIENT_FRAME as usize - bytes.len();
    bytes.extend(std::iter::repeat_n(0x01, tail));
    let len = (bytes.len() - 4) as u32;
    bytes[..4].copy_from_slice(&len.to_le_bytes());
    let (before, reads) = (t.b.cost(), t.proc_reads.get());
    t.b.input(t.now, c, &bytes);
    let cost = t.b.cost().since(&before);
    assert!(matches!(t.recv(c)[..], [ServerMsg::HelloOk { .. }]));
    assert_bounded("Hello", cost, t.proc_reads.get() - reads, bytes.len());
}

#[test]
fn ping_costs_a_frame() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let p = t.spawn(1);
    let c = t.connect_as(p, BOB);
    let (cost, reads, len) = cost_of(&mut t, c, &ClientMsg::Ping);
    assert_bounded("Ping", cost, reads, len);
    assert_eq!((cost.escaped, cost.proc_reads, reads), (0, 0, 0));
}

/// The attack: a 2 MiB argv made each `Register` read and escape it all
/// (75 ms each). The command is now the client's, cut as it is escaped,
/// and no /proc file but the ancestry's stat files is read.
#[test]
fn register_with_the_longest_command_and_list_from_the_deepest_process_is_bounded() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let p = deep(&mut t);
    let c = t.connect_shim(p, BOB);
    let devices = vec![
        DeviceReg {
            uuid: uuid(1),
            ordinal: 0,
            mem_cap: 0,
            mem_total: u64::MAX,
        };
        (wire::MAX_CLIENT_FRAME as usize - (1 << 16) - 64) / 36
    ];
    let m = ClientMsg::Register {
        command: hostile(),
        devices,
        share: Some(f64::MAX),
        limit: Some(f64::MIN_POSITIVE),
        priority: Priority::High,
    };
    let (cost, reads, len) = cost_of(&mut t, c, &m);
    assert!(
        t.recv(c)
            .iter()
            .any(|m| matches!(m, ServerMsg::Registered { .. }))
    );
    assert_bounded("Register", cost, reads, len);
    assert_eq!(cost.proc_reads, 64, "the ancestry is read to its limit");
    let kept = &t.b.conns.get(&c).unwrap().command;
    assert!(kept.len() <= Budgets::default().label && kept.starts_with("\\x01"));
}

#[test]
fn usage_acquire_release_drained_and_join_cost_a_frame() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let p = t.spawn(1);
    let c = t.connect_shim(p, BOB);
    t.register(c, Priority::Normal);
    for m in [
        ClientMsg::Usage {
            uuid: uuid(1),
            used: u64::MAX,
            peak: u64::MAX,
            ooms: u64::MAX,
        },
        ClientMsg::Acquire { uuid: uuid(1) },
        ClientMsg::Release {
            uuid: uuid(1),
            held_ns: u64::MAX,
        },
        ClientMsg::Drained { uuid: uuid(1) },
        ClientMsg::Join { job: u64::MAX },
    ] {
        let what = m.name();
        let (cost, reads, len) = cost_of(&mut t, c, &m);
        assert_bounded(what, cost, reads, len);
        assert_eq!((cost.escaped, reads), (0, 0), "{what}");
    }
}

/// A status page costs what it shows: the connections walked and the
/// page's bytes, whatever `from` says.
#[test]
fn status_costs_the_page_it_builds() {
    let mut t = T::new(cfg(), &[16 * GIB, 16 * GIB]);
    for _ in 0..200 {
        let p = t.spawn(1);
        let c = t.connect_shim(p, ALICE);
        t.register(c, Priority::Normal);
    }
    let p = t.spawn(1);
    let c = t.connect_as(p, BOB);
    for from in [0, 199, u32::MAX] {
        let (cost, reads, _) = cost_of(&mut t, c, &ClientMsg::Status { from });
        let [ServerMsg::StatusReply { json }] = &t.recv(c)[..] else {
            panic!("a status reply");
        };
        let conns = t.b.conns.len() as u64;
        assert_eq!(cost.walked, conns * 2);
        assert!(cost.sent <= json.len() as u64 + 16 && cost.sent <= conns * 1024);
        assert_eq!((cost.escaped, reads), (0, 0));
    }
}

/// The attack: a `Lease` whose label is the longest string a frame
/// holds. From the device plugin, with the longest list of pins too.
#[test]
fn lease_with_the_longest_label_and_pins_is_bounded() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let p = deep(&mut t);
    let c = t.connect_as(p, BOB);
    let m = LeaseReq {
        command: hostile(),
        ..lease(0, GIB, true)
    };
    let (cost, reads, len) = cost_of(&mut t, c, &m.into());
    t.advance(SEC);
    assert!(leased(&t.recv(c)).is_some());
    assert_bounded("Lease", cost, reads, len);
    assert!(t.status().leases[0].command.len() <= Budgets::default().label);
    let plugin = t.connect_as(p, PLUGIN);
    let pin = vec![
        Pin {
            uuid: uuid(1),
            mem: u64::MAX,
        };
        (wire::MAX_CLIENT_FRAME as usize - (1 << 16) - 128) / 24
    ];
    let m = LeaseReq {
        command: hostile(),
        pin,
        token: 7,
        ..lease(0, 0, false)
    };
    let (cost, reads, len) = cost_of(&mut t, plugin, &m.into());
    let why = refused(&t.recv(plugin)).expect("too many pins refused");
    assert!(why.contains("at most"), "{why}");
    assert_bounded("Lease with pins", cost, reads, len);
}

/// The attack: `Name` frames of two 64 KiB strings of control characters
/// (pings of other users took 119 ms).
#[test]
fn name_with_the_longest_pod_and_label_is_bounded() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let p = t.spawn(1);
    let c = t.connect_as(p, BOB);
    t.lease(c, 0, 0, false);
    assert!(leased(&t.recv(c)).is_some());
    let m = ClientMsg::Name {
        pod: hostile(),
        label: hostile(),
    };
    let (cost, reads, len) = cost_of(&mut t, c, &m);
    assert_bounded("Name", cost, reads, len);
    assert!(cost.escaped > 0);
    let l = &t.status().leases[0];
    assert!(l.command.len() <= Budgets::default().label);
}

/// A connection whose frames cost a turn's work each is served one frame
/// a turn, however many it sent, and another user's ping is answered in
/// every turn: a user's part of a turn is charged by work, not frames
/// (64 such frames a turn before: 64 × 128 KiB escaped).
#[test]
fn costly_frames_take_a_users_part_of_a_turn_each() {
    let mut t = T::new(cfg(), &[16 * GIB]);
    let p = t.spawn(1);
    let a = t.connect_as(p, BOB);
    t.lease(a, 0, 0, false);
    t.recv(a);
    let mut burst = Vec::new();
    for _ in 0..30 {
        wire::encode_client(
            &ClientMsg::Name {
                pod: hostile(),
                label: hostile(),
            },
            &mut burst,
        );
    }
    t.unread.insert(a, burst);
    t.b.readable(a);
    let q = t.spawn(1);
    let v = t.connect_as(q, ALICE);
    let mut turns = 0;
    while t.unread.get(&a).is_some_and(|b| !b.is_empty()) || t.b.has_frames(a) {
        let frames = t.b.frames_handled();
        let mut ping = Vec::new();
        wire::encode_client(&ClientMsg::Ping, &mut ping);
        t.unread.entry(v).or_default().extend(ping);
        t.b.readable(v);
        t.b.turn(&mut Virtual {
            now: t.now,
            unread: &mut t.unread,
        });
        assert_eq!(
            t.recv(v),
            [ServerMsg::Pong],
            "the victim is answered every turn"
        );
        // The victim's ping, and one or two of the attacker's frames.
        let handled = t.b.frames_handled() - frames;
        assert!(handled <= 3, "{handled} frames handled in one turn");
        turns += 1;
        assert!(turns < 1000);
    }
    // Each frame read a user's part at a time: several turns each.
    assert!(turns >= 30, "{turns} turns for 30 costly frames");
}

/// The shell's reads, counted; with `drained`, a short read says it
/// emptied the socket, as the real shell's read of a stream socket does.
struct Counted<'a> {
    io: Virtual<'a>,
    reads: usize,
    drained: bool,
}

impl Sockets for Counted<'_> {
    fn now(&mut self) -> Nanos {
        self.io.now()
    }

    fn read(&mut self, id: ConnId, buf: &mut [u8]) -> Read {
        self.reads += 1;
        match self.io.read(id, buf) {
            Read::Bytes(n) if self.drained && n < buf.len() => Read::Drained(n),
            r => r,
        }
    }
}

/// A read that emptied the socket is the last until the poll says more
/// came: the read that would only say "nothing" is a system call saved on
/// every frame. The frame is still handled, and bytes that come later are
/// read when the poll says so.
#[test]
fn a_read_that_drains_the_socket_is_the_last_until_the_poll_says_more() {
    for (drained, reads_per_frame) in [(false, 2), (true, 1)] {
        let mut t = T::new(cfg(), &[16 * GIB]);
        let p = t.spawn(1);
        let c = t.connect_as(p, ALICE);
        for round in 0..2 {
            let mut ping = Vec::new();
            wire::encode_client(&ClientMsg::Ping, &mut ping);
            t.unread.insert(c, ping);
            t.b.readable(c);
            let mut io = Counted {
                io: Virtual {
                    now: t.now,
                    unread: &mut t.unread,
                },
                reads: 0,
                drained,
            };
            while {
                t.b.turn(&mut io);
                t.b.busy()
            } {}
            assert_eq!(
                io.reads, reads_per_frame,
                "round {round}, drained reads {drained}"
            );
            assert_eq!(t.recv(c), vec![ServerMsg::Pong], "round {round}");
        }
    }
}
