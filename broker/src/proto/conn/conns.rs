//! Every open connection, with what the broker keeps of them as they
//! change rather than by a walk over all of them: the connections it is
//! done with (`dead`), those with output waiting (`pending_output`),
//! those holding a status request back, and those with no hello yet or
//! half a frame (the deadlines' sweep looks at those only). Each user's
//! connections, unread input and unsent output are charged to its
//! budgets here too.
//!
//! A connection is closed and its output queued only through this type,
//! so each set is right by construction: `kill` is the one way to mark a
//! connection dead, and it puts the connection in `dead`; `send` the one
//! way to add output, and it charges the user and lists the connection.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use gpufrac_common::wire::{self, ServerMsg};

use super::{Budgets, Conn, Held, MAX_OUTBUF};
use crate::authority::Peer;
use crate::proto::{ConnId, Nanos};

/// The open connections and their users' budgets.
#[derive(Debug)]
pub(in crate::proto) struct Conns {
    map: BTreeMap<ConnId, Conn>,
    held: HashMap<u32, Held>,
    budgets: Budgets,
    closing: BTreeSet<ConnId>,
    unsent: BTreeSet<ConnId>,
    status_held: BTreeSet<ConnId>,
    unsettled: BTreeSet<ConnId>,
}

/// A budget a connection went over; the connection is closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::proto) enum Over {
    /// Its own unsent output passed `MAX_OUTBUF`: it is not reading.
    Outbuf,
    /// Its user's unsent output passed the user's budget.
    Output,
    /// Its user's unhandled input passed the user's budget.
    Input,
}

/// What `send` did: the bytes it queued, and the budget the connection
/// went over if it did (it is then closed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::proto) struct Sent {
    pub bytes: usize,
    pub over: Option<Over>,
}

impl Conns {
    pub fn new(budgets: Budgets) -> Conns {
        Conns {
            map: BTreeMap::new(),
            held: HashMap::new(),
            budgets,
            closing: BTreeSet::new(),
            unsent: BTreeSet::new(),
            status_held: BTreeSet::new(),
            unsettled: BTreeSet::new(),
        }
    }

    /// A new connection from `peer`, charged to its user's connection
    /// budget; past it, `Err` with how many the user has open.
    pub fn open(&mut self, id: ConnId, peer: Peer, now: Nanos) -> Result<(), usize> {
        let count = self.held.get(&peer.uid).map_or(0, |h| h.conns);
        if count >= self.budgets.connections {
            return Err(count);
        }
        self.held.entry(peer.uid).or_default().conns += 1;
        self.map.insert(id, Conn::new(peer, now));
        self.unsettled.insert(id);
        Ok(())
    }

    /// The connection is gone: its user's budgets get back what it held,
    /// and it leaves every set.
    pub fn remove(&mut self, id: ConnId) -> Option<Conn> {
        let c = self.map.remove(&id)?;
        self.closing.remove(&id);
        self.unsent.remove(&id);
        self.status_held.remove(&id);
        self.unsettled.remove(&id);
        if let Some(h) = self.held.get_mut(&c.peer.uid) {
            h.conns = h.conns.saturating_sub(1);
            h.input = h.input.saturating_sub(c.inbuf.len());
            h.output = h.output.saturating_sub(c.outbuf.len());
            if h.conns == 0 {
                self.held.remove(&c.peer.uid);
            }
        }
        Some(c)
    }

    pub fn get(&self, id: &ConnId) -> Option<&Conn> {
        self.map.get(id)
    }

    pub fn get_mut(&mut self, id: &ConnId) -> Option<&mut Conn> {
        self.map.get_mut(id)
    }

    pub fn contains_key(&self, id: &ConnId) -> bool {
        self.map.contains_key(id)
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&ConnId, &Conn)> {
        self.map.iter()
    }

    pub fn values(&self) -> impl Iterator<Item = &Conn> {
        self.map.values()
    }

    /// What user `uid` holds now.
    #[cfg(test)]
    pub fn held(&self, uid: u32) -> Held {
        self.held.get(&uid).copied().unwrap_or_default()
    }

    /// The broker is done with `id`: nothing more is read from it or
    /// queued for it, and the shell closes it (`dead`).
    pub fn kill(&mut self, id: ConnId) {
        if let Some(c) = self.map.get_mut(&id) {
            c.dead = true;
            self.closing.insert(id);
        }
    }

    /// Connections the broker is done with, for the shell to close.
    pub fn dead(&self) -> impl Iterator<Item = ConnId> + '_ {
        self.closing.iter().copied()
    }

    /// Queues `msg` for `id` (nothing for a dead connection), charged to
    /// its user's output budget. A connection that goes over its own
    /// bound or its user's budget is closed.
    pub fn send(&mut self, id: ConnId, msg: &ServerMsg) -> Sent {
        let none = Sent {
            bytes: 0,
            over: None,
        };
        let Some(c) = self.map.get_mut(&id) else {
            return none;
        };
        if c.dead {
            return none;
        }
        let before = c.outbuf.len();
        wire::encode_server(msg, &mut c.outbuf);
        let bytes = c.outbuf.len() - before;
        if bytes > 0 {
            self.unsent.insert(id);
        }
        let h = self.held.entry(c.peer.uid).or_default();
        h.output += bytes;
        let over = if c.outbuf.len() > MAX_OUTBUF {
            Some(Over::Outbuf)
        } else if h.output > self.budgets.output {
            Some(Over::Output)
        } else {
            None
        };
        if over.is_some() {
            self.kill(id);
        }
        Sent { bytes, over }
    }

    /// What is waiting to be written to `id`.
    pub fn output(&self, id: ConnId) -> &[u8] {
        self.map.get(&id).map_or(&[], |c| &c.outbuf)
    }

    /// `n` bytes of `output(id)` were written.
    pub fn consumed(&mut self, id: ConnId, n: usize) {
        if let Some(c) = self.map.get_mut(&id) {
            let n = n.min(c.outbuf.len());
            c.outbuf.drain(..n);
            if c.outbuf.is_empty() {
                self.unsent.remove(&id);
                if c.outbuf.capacity() > 64 << 10 {
                    c.outbuf = Vec::new();
                }
            }
            if let Some(h) = self.held.get_mut(&c.peer.uid) {
                h.output = h.output.saturating_sub(n);
            }
        }
    }

    /// Connections with output waiting.
    pub fn pending_output(&self) -> impl Iterator<Item = ConnId> + '_ {
        self.unsent.iter().copied()
    }

    /// Bytes read from `id`, kept until handled and charged to its
    /// user's input budget; a connection that takes its user past it is
    /// closed instead (`Err`, nothing kept). Nothing for a dead one.
    pub fn take_in(&mut self, id: ConnId, bytes: &[u8]) -> Result<(), Over> {
        let Some(c) = self.map.get_mut(&id) else {
            return Ok(());
        };
        if c.dead {
            return Ok(());
        }
        let h = self.held.entry(c.peer.uid).or_default();
        if h.input + bytes.len() > self.budgets.input {
            self.kill(id);
            return Err(Over::Input);
        }
        h.input += bytes.len();
        c.inbuf.extend_from_slice(bytes);
        Ok(())
    }

    /// `n` bytes of user `uid`'s input were handled.
    pub fn handled(&mut self, uid: u32, n: usize) {
        if let Some(h) = self.held.get_mut(&uid) {
            h.input = h.input.saturating_sub(n);
        }
    }

    /// `id`'s status request for page `from` waits for its user's status
    /// budget, and everything it sent after it with it.
    pub fn hold_status(&mut self, id: ConnId, from: u32) {
        if let Some(cli) = self.map.get_mut(&id).and_then(|c| c.cli_mut()) {
            cli.status_wait = Some(from);
            self.status_held.insert(id);
        }
    }

    /// `id`'s held status request, if any, was answered.
    pub fn status_answered(&mut self, id: ConnId) {
        if let Some(cli) = self.map.get_mut(&id).and_then(|c| c.cli_mut()) {
            cli.status_wait = None;
        }
        self.status_held.remove(&id);
    }

    /// Live connections holding a status request back: (id, user, the
    /// page asked for).
    pub fn status_waiting(&self) -> impl Iterator<Item = (ConnId, u32, u32)> + '_ {
        self.status_held.iter().filter_map(|id| {
            let c = self.map.get(id)?;
            let from = c.status_wait().filter(|_| !c.dead)?;
            Some((*id, c.peer.uid, from))
        })
    }

    /// `id`'s hello or half frame may have changed (its frames were just
    /// handled): whether the deadlines' sweep looks at it.
    pub fn settle(&mut self, id: ConnId) {
        match self.map.get(&id) {
            Some(c) if c.role().is_none() || c.partial_since.is_some() => {
                self.unsettled.insert(id);
            }
            _ => {
                self.unsettled.remove(&id);
            }
        }
    }

    /// Connections without hello or with half a frame.
    pub fn unsettled(&self) -> impl Iterator<Item = ConnId> + '_ {
        self.unsettled.iter().copied()
    }

    /// Whether a live connection is in `unsettled`.
    pub fn any_unsettled(&self) -> bool {
        self.unsettled
            .iter()
            .any(|id| self.map.get(id).is_some_and(|c| !c.dead))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpufrac_common::wire::Role;

    fn peer(uid: u32, pid: u32) -> Peer {
        Peer {
            pid,
            uid,
            gid: uid,
            groups: Vec::new(),
            ident: Some(1),
        }
    }

    fn budgets() -> Budgets {
        Budgets {
            connections: 2,
            input: 100,
            output: 1000,
            ..Budgets::default()
        }
    }

    fn reply(n: usize) -> ServerMsg {
        ServerMsg::StatusReply {
            json: "x".repeat(n),
        }
    }

    #[test]
    fn a_user_opens_up_to_its_budget_and_a_closed_one_gives_its_place_back() {
        let mut c = Conns::new(budgets());
        assert_eq!(c.open(1, peer(7, 10), 0), Ok(()));
        assert_eq!(c.open(2, peer(7, 11), 0), Ok(()));
        assert_eq!(c.open(3, peer(7, 12), 0), Err(2));
        assert_eq!(c.open(3, peer(8, 12), 0), Ok(()), "another user's own");
        assert!(c.remove(1).is_some());
        assert_eq!(c.open(4, peer(7, 13), 0), Ok(()));
        assert_eq!(c.held(7).conns, 2);
    }

    #[test]
    fn killed_is_listed_dead_until_removed_and_takes_nothing_more() {
        let mut c = Conns::new(budgets());
        c.open(1, peer(7, 10), 0).unwrap();
        c.kill(1);
        assert_eq!(c.dead().collect::<Vec<_>>(), [1]);
        assert_eq!(c.send(1, &reply(4)).bytes, 0);
        assert_eq!(c.pending_output().count(), 0);
        assert_eq!(c.take_in(1, b"abc"), Ok(()));
        assert!(c.get(&1).unwrap().inbuf.is_empty());
        c.remove(1);
        assert_eq!(c.dead().count(), 0);
        assert_eq!(c.held(7).conns, 0);
    }

    #[test]
    fn output_is_listed_until_written_and_charged_to_its_user_meanwhile() {
        let mut c = Conns::new(budgets());
        c.open(1, peer(7, 10), 0).unwrap();
        let s = c.send(1, &reply(10));
        assert!(s.bytes > 10 && s.over.is_none());
        assert_eq!(c.pending_output().collect::<Vec<_>>(), [1]);
        assert_eq!(c.output(1).len(), s.bytes);
        assert_eq!(c.held(7).output, s.bytes);
        c.consumed(1, s.bytes - 1);
        assert_eq!(c.pending_output().collect::<Vec<_>>(), [1]);
        c.consumed(1, 1);
        assert_eq!(c.pending_output().count(), 0);
        assert_eq!(c.held(7).output, 0);
    }

    #[test]
    fn the_connection_that_takes_its_user_over_a_budget_is_closed() {
        let mut c = Conns::new(budgets());
        c.open(1, peer(7, 10), 0).unwrap();
        c.open(2, peer(7, 11), 0).unwrap();
        assert!(c.send(1, &reply(600)).over.is_none());
        assert_eq!(c.send(2, &reply(600)).over, Some(Over::Output));
        assert_eq!(c.dead().collect::<Vec<_>>(), [2]);
        assert_eq!(c.take_in(1, &[0; 60]), Ok(()));
        assert_eq!(c.take_in(1, &[0; 60]), Err(Over::Input));
        assert_eq!(c.dead().collect::<Vec<_>>(), [1, 2]);
        c.handled(7, 60);
        assert_eq!(c.held(7).input, 0);
        // What a removed connection held goes back to its user.
        c.remove(1);
        c.remove(2);
        assert_eq!(c.held(7).output, 0);
    }

    #[test]
    fn one_connection_not_reading_is_closed_within_its_users_budget() {
        let mut c = Conns::new(Budgets {
            output: usize::MAX,
            ..budgets()
        });
        c.open(1, peer(7, 10), 0).unwrap();
        let mut over = None;
        while over.is_none() {
            over = c.send(1, &reply(1 << 20)).over;
        }
        assert_eq!(over, Some(Over::Outbuf));
        assert!(c.get(&1).unwrap().dead);
    }

    #[test]
    fn status_requests_and_unsettled_connections_are_listed_as_they_change() {
        let mut c = Conns::new(budgets());
        c.open(1, peer(7, 10), 0).unwrap();
        assert_eq!(c.unsettled().collect::<Vec<_>>(), [1], "no hello yet");
        c.hold_status(1, 0);
        assert_eq!(c.status_waiting().count(), 0, "not a CLI connection");
        c.get_mut(&1).unwrap().role = super::super::RoleState::new(Role::Cli);
        c.settle(1);
        assert_eq!(c.unsettled().count(), 0);
        c.hold_status(1, 3);
        assert_eq!(c.status_waiting().collect::<Vec<_>>(), [(1, 7, 3)]);
        c.status_answered(1);
        assert_eq!(c.status_waiting().count(), 0);
        c.get_mut(&1).unwrap().partial_since = Some(5);
        c.settle(1);
        assert!(c.any_unsettled());
        c.kill(1);
        assert!(!c.any_unsettled(), "a dead one waits for no deadline");
    }
}
