//! What the session says: each of its notes as a line on stderr, loud
//! (always shown) where the user must know, or at the configured log level.

use crate::session::{Note, STALL_S};
use gpufrac_common::config::ShimConfig;

/// Says `note`.
pub fn say(note: Note, cfg: &ShimConfig) {
    let socket = &cfg.socket;
    match note {
        Note::Registered => info!("registered with the broker at {socket}"),
        Note::Refused(message) => {
            crate::log::write_line(format_args!("the broker refused this process: {message}"))
        }
        Note::StalledWaiting => crate::log::write_line(format_args!(
            "broker at {socket} has not answered for {STALL_S} s; launches wait for it (GPUFRAC_BROKER=required)"
        )),
        Note::StalledUnarbitrated { loud: true } => crate::log::write_line(format_args!(
            "broker at {socket} has not answered for {STALL_S} s; launching unarbitrated until it answers again"
        )),
        Note::StalledUnarbitrated { loud: false } => warn!(
            "broker at {socket} has not answered for {STALL_S} s; launching unarbitrated until it answers again"
        ),
        Note::Lost(e) => warn!("lost the broker ({e}); retrying"),
        Note::NoBroker { what, loud: true } => crate::log::write_line(format_args!(
            "{what}; memory caps are enforced, compute shares and limits are not until it returns"
        )),
        Note::NoBroker { what, loud: false } => {
            warn!("{what}; memory caps are enforced, compute is not arbitrated")
        }
        Note::Granted { dev, open_ended } => debug!(
            "device {dev}: granted ({})",
            if open_ended {
                "open-ended"
            } else {
                "timeslice"
            }
        ),
        Note::Released { dev, held_ns } => {
            debug!("device {dev}: released after {} us", held_ns / 1000)
        }
        // The thread that died said so (client.rs, `contained`).
        Note::Retired => debug!("arbitration ended: what was held is handed back"),
    }
}
