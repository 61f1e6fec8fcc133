//! Upgrades (SPEC §2): the wire protocol negotiates a version range at
//! hello, so a broker restarted on a newer release keeps serving the shims
//! and runs of processes started under the previous one, a client of this
//! release still talks to a broker of the previous one, and a pair with no
//! version in common says so in one line.

mod support;

use std::io::{Read, Write};
use std::os::unix::net::UnixListener;
use std::process::Command;

use gpufrac_common::wire::{
    self, ClientMsg, ERR_VERSION, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION, ServerMsg,
};
use support::*;

/// `Hello` exactly as a client of protocol version 4 wrote it (one
/// version, no range), built by hand, not by this build's encoder.
fn hello_v4(role: u8) -> Vec<u8> {
    let mut payload = vec![0x01];
    payload.extend_from_slice(b"GPFR");
    payload.extend_from_slice(&4u16.to_le_bytes());
    payload.extend_from_slice(&std::process::id().to_le_bytes());
    payload.push(role);
    let mut f = (payload.len() as u32).to_le_bytes().to_vec();
    f.extend_from_slice(&payload);
    f
}

/// A shim of the previous release (version 4 speaks the same frames as
/// this one past the hello) registers with, and is served by, this broker,
/// as the shims of running processes do after an upgrade restarts it.
#[test]
fn a_client_of_the_previous_version_is_served() {
    let b = Broker::start("16G", &[]);
    let uuid = b.first_gpu_uuid();
    let mut old = RawClient::connect(&b.socket);
    old.send_raw(&hello_v4(1)).unwrap();
    assert_eq!(old.recv(), Some(ServerMsg::HelloOk { version: 4 }));
    old.send(&register_msg(
        uuid,
        "old shim",
        gpufrac_common::config::Priority::Normal,
    ));
    old.send(&ClientMsg::Ping);
    loop {
        match old.recv() {
            Some(ServerMsg::Pong) => break,
            Some(ServerMsg::Error { message, .. }) => panic!("{message}"),
            Some(_) => {}
            None => panic!("the broker closed a version 4 client"),
        }
    }
    wait_until(10.0, "the old shim registered", || {
        b.registered().contains(&u64::from(std::process::id()))
    });
    // And a version 4 CLI reads status.
    let mut cli = RawClient::connect(&b.socket);
    cli.send_raw(&hello_v4(2)).unwrap();
    assert_eq!(cli.recv(), Some(ServerMsg::HelloOk { version: 4 }));
    cli.send(&ClientMsg::Status { from: 0 });
    assert!(matches!(cli.recv(), Some(ServerMsg::StatusReply { .. })));
}

/// A client of this release gets the newest version both speak.
#[test]
fn a_client_of_this_release_gets_the_newest_version() {
    let b = Broker::start("16G", &[]);
    let mut c = RawClient::connect(&b.socket);
    c.send(&ClientMsg::hello(std::process::id(), wire::Role::Cli));
    assert_eq!(
        c.recv(),
        Some(ServerMsg::HelloOk {
            version: PROTOCOL_VERSION
        })
    );
}

/// A client of a release this broker cannot speak to is told so in one
/// line naming both ranges and what to do, and is closed alone.
#[test]
fn an_incompatible_client_is_told_in_one_line() {
    let b = Broker::start("16G", &[]);
    let future = PROTOCOL_VERSION + 1;
    let mut c = RawClient::connect(&b.socket);
    c.send(&ClientMsg::Hello {
        magic: wire::MAGIC,
        version: future,
        pid: std::process::id(),
        role: wire::Role::Shim,
        max_version: future + 2,
    });
    match c.recv() {
        Some(ServerMsg::Error { code, message }) => {
            assert_eq!(code, ERR_VERSION);
            assert!(!message.contains('\n'), "{message}");
            for want in [
                format!("versions {future} to {}", future + 2),
                format!("speaks versions {MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION}"),
                "upgrade gpufrac on this node and restart the broker".to_owned(),
            ] {
                assert!(message.contains(&want), "{want} missing from {message}");
            }
        }
        other => panic!("expected a version error, got {other:?}"),
    }
    assert_eq!(c.recv(), None, "closed");
    // Everyone else is served.
    assert!(b.status()["gpus"].is_array());
}

/// This release's CLI against a broker of the previous one: the hello's
/// `version` is 4, which such a broker checks as the one it speaks, and
/// the rest works. (The stand-in answers as version 4 brokers did: one
/// version, refused unless equal.)
#[test]
fn this_release_talks_to_a_broker_of_the_previous_one() {
    let dir = Scratch::new("v4-broker");
    let socket = dir.0.join("b.sock");
    let l = UnixListener::bind(&socket).unwrap();
    let served = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut buf = Vec::new();
        let hello = loop {
            let mut tmp = [0u8; 4096];
            let n = s.read(&mut tmp).unwrap();
            assert!(n > 0, "the client hung up before its hello");
            buf.extend_from_slice(&tmp[..n]);
            if let Ok((m, used)) = wire::decode_client(&buf) {
                buf.drain(..used);
                break m;
            }
        };
        let ClientMsg::Hello { version, .. } = hello else {
            panic!("{hello:?}")
        };
        let mut out = Vec::new();
        if version != 4 {
            wire::encode_server(
                &ServerMsg::Error {
                    code: ERR_VERSION,
                    message: format!(
                        "protocol version {version} not supported; this broker speaks 4"
                    ),
                },
                &mut out,
            );
            s.write_all(&out).unwrap();
            return version;
        }
        wire::encode_server(&ServerMsg::HelloOk { version: 4 }, &mut out);
        let status = gpufrac_common::status::Status {
            version: "0.0.4".into(),
            socket: "/old".into(),
            ..Default::default()
        };
        wire::encode_server(
            &ServerMsg::StatusReply {
                json: serde_json::to_string(&status).unwrap(),
            },
            &mut out,
        );
        s.write_all(&out).unwrap();
        // Until the client has read it all.
        let _ = s.read(&mut [0u8; 64]);
        version
    });
    let o = Command::new(&artifacts().gpufrac)
        .args(["status", "--json", "--socket"])
        .arg(&socket)
        .output()
        .unwrap();
    assert_eq!(served.join().unwrap(), 4);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("0.0.4"), "{}", stdout(&o));
}
