//! The endpoint: HTTP/1.1 (hyper) on a single-threaded tokio runtime on a
//! thread of its own. Anyone who can reach the address can connect, so
//! what a connection may hold is bounded: one deadline for its request
//! and the answer (header and body read within it, however slowly they
//! trickle), one request per connection, a limit per peer address and a
//! limit in all. At a limit the newest connection wins: the peer's
//! oldest connection still waiting for its request is closed (local
//! users all come from 127.0.0.1, so a limit that refused the newest
//! would let one user's trickle keep Prometheus out).

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{ALLOW, CONTENT_TYPE, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::sync::oneshot;

use super::board::{Board, Closed};

/// Connections one peer address may hold at once.
pub const PER_PEER: usize = 8;
/// Connections held at once, all peers together.
pub const TOTAL: usize = 64;
/// From accept to the last byte of the answer: one deadline per request,
/// however its bytes trickle in (Prometheus's scrape timeout is 10 s by
/// default; a scrape is answered in milliseconds).
pub const DEADLINE: Duration = Duration::from_secs(5);
/// The most a request's head may take: a scrape's is a few hundred bytes
/// (hyper's floor is 8 KiB).
const MAX_HEAD: usize = 16 << 10;

pub const CONTENT: &str = "text/plain; version=0.0.4; charset=utf-8";

struct Entry {
    id: u64,
    /// Its request was read; it is being answered.
    answered: Arc<AtomicBool>,
    evict: oneshot::Sender<()>,
}

/// The connections held, by peer, oldest first.
#[derive(Default)]
pub struct Conns {
    next: u64,
    peers: HashMap<IpAddr, VecDeque<Entry>>,
    total: usize,
}

/// What an admitted connection is given.
pub struct Ticket {
    pub id: u64,
    pub answered: Arc<AtomicBool>,
    pub evicted: oneshot::Receiver<()>,
}

impl Conns {
    /// Room for a connection from `peer`, evicting the oldest unanswered
    /// connection of `peer` at its limit, or of the peer holding the most
    /// at the total's; None (refused) where there is none to evict.
    pub fn admit(&mut self, peer: IpAddr, closed: &mut Closed) -> Option<Ticket> {
        if self.peers.get(&peer).map_or(0, VecDeque::len) >= PER_PEER
            && !self.evict_from(peer, closed)
        {
            closed.refused += 1;
            return None;
        }
        if self.total >= TOTAL {
            let busiest = self
                .peers
                .iter()
                .max_by_key(|(_, q)| q.len())
                .map(|(p, _)| *p)?;
            if !self.evict_from(busiest, closed) {
                closed.refused += 1;
                return None;
            }
        }
        let (tx, rx) = oneshot::channel();
        let answered = Arc::new(AtomicBool::new(false));
        self.next += 1;
        let id = self.next;
        self.peers.entry(peer).or_default().push_back(Entry {
            id,
            answered: answered.clone(),
            evict: tx,
        });
        self.total += 1;
        Some(Ticket {
            id,
            answered,
            evicted: rx,
        })
    }

    fn evict_from(&mut self, peer: IpAddr, closed: &mut Closed) -> bool {
        let Some(q) = self.peers.get_mut(&peer) else {
            return false;
        };
        let Some(i) = q.iter().position(|e| !e.answered.load(Ordering::Relaxed)) else {
            return false;
        };
        let e = q.remove(i).expect("found above");
        let _ = e.evict.send(());
        closed.evicted += 1;
        self.forget_peer_if_empty(peer);
        self.total -= 1;
        true
    }

    /// Connection `id` of `peer` ended (a no-op if it was evicted).
    pub fn remove(&mut self, peer: IpAddr, id: u64) {
        if let Some(q) = self.peers.get_mut(&peer)
            && let Some(i) = q.iter().position(|e| e.id == id)
        {
            q.remove(i);
            self.total -= 1;
            self.forget_peer_if_empty(peer);
        }
    }

    fn forget_peer_if_empty(&mut self, peer: IpAddr) {
        if self.peers.get(&peer).is_some_and(VecDeque::is_empty) {
            self.peers.remove(&peer);
        }
    }

    #[cfg(test)]
    fn total(&self) -> usize {
        self.total
    }
}

/// Accepts and serves connections for as long as the broker runs.
pub async fn accept(listener: tokio::net::TcpListener, board: Arc<Mutex<Board>>) {
    let conns = Arc::new(Mutex::new(Conns::default()));
    loop {
        let (stream, addr) = match listener.accept().await {
            Ok(c) => c,
            Err(_) => {
                // Out of descriptors, most likely: let some close.
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let peer = peer(addr.ip());
        let ticket = {
            let mut b = lock(&board);
            lock(&conns).admit(peer, &mut b.closed)
        };
        let Some(ticket) = ticket else {
            continue;
        };
        let (board, conns) = (board.clone(), conns.clone());
        tokio::spawn(async move {
            let Ticket {
                id,
                answered,
                evicted,
            } = ticket;
            let b = board.clone();
            let service = service_fn(move |req| {
                answered.store(true, Ordering::Relaxed);
                let res = answer(&req, &b);
                async move { Ok::<_, Infallible>(res) }
            });
            let conn = http1::Builder::new()
                .keep_alive(false)
                .max_buf_size(MAX_HEAD)
                .serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                _ = conn => {}
                _ = evicted => {}
                _ = tokio::time::sleep(DEADLINE) => lock(&board).closed.deadline += 1,
            }
            lock(&conns).remove(peer, id);
        });
    }
}

/// Who a connection counts against: its IPv4 address, or its IPv6 /64
/// (one host commonly holds a whole /64, and would otherwise have 2^64
/// limits of its own).
fn peer(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => {
            let s = v6.segments();
            IpAddr::from([s[0], s[1], s[2], s[3], 0, 0, 0, 0])
        }
        v4 => v4,
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn answer(req: &Request<Incoming>, board: &Mutex<Board>) -> Response<Full<Bytes>> {
    let plain = |status: StatusCode, body: &'static str| {
        let mut r = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
        *r.status_mut() = status;
        r.headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        r
    };
    let path = req.uri().path();
    if !["/metrics", "/healthz", "/readyz"].contains(&path) {
        return plain(
            StatusCode::NOT_FOUND,
            "Not found: the broker's metrics are at /metrics (and its probes at /healthz, \
             /readyz)\n",
        );
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = plain(
            StatusCode::METHOD_NOT_ALLOWED,
            "Method not allowed: /metrics, /healthz and /readyz answer GET and HEAD\n",
        );
        r.headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    // The probes: liveness (the loop still hands snapshots over) and
    // readiness (it has started), for a DaemonSet's httpGet probes.
    if path != "/metrics" {
        let b = lock(board);
        let said = if path == "/healthz" {
            b.live(gpufrac_common::clock::mono_ns())
        } else {
            b.ready()
        };
        let (status, body) = match said {
            Ok(t) => (StatusCode::OK, t),
            Err(t) => (StatusCode::SERVICE_UNAVAILABLE, t),
        };
        let mut r = Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = status;
        r.headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        return r;
    }
    let text = lock(board).text();
    let mut r = Response::new(Full::new(Bytes::from(text)));
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(CONTENT));
    r
}

/// Binds `addr` now (an address in use is said before the broker goes on)
/// and serves it from a thread of its own.
pub fn spawn(
    addr: &str,
    board: Arc<Mutex<Board>>,
    fold: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<SocketAddr, String> {
    let l =
        std::net::TcpListener::bind(addr).map_err(|e| format!("metrics address {addr}: {e}"))?;
    let bound = l
        .local_addr()
        .map_err(|e| format!("metrics address {addr}: {e}"))?;
    l.set_nonblocking(true)
        .map_err(|e| format!("metrics address {addr}: {e}"))?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .map_err(|e| format!("metrics: cannot start its runtime: {e}"))?;
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            rt.block_on(async move {
                match tokio::net::TcpListener::from_std(l) {
                    Ok(l) => {
                        tokio::spawn(fold);
                        accept(l, board).await;
                    }
                    Err(e) => tracing::warn!("metrics: cannot serve {bound}: {e}"),
                }
            })
        })
        .map_err(|e| format!("metrics: cannot start its thread: {e}"))?;
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    #[test]
    fn at_a_peers_limit_its_oldest_unanswered_connection_makes_room() {
        let mut c = Conns::default();
        let mut closed = Closed::default();
        let mut tickets: Vec<Ticket> = (0..PER_PEER)
            .map(|_| c.admit(ip(1), &mut closed).unwrap())
            .collect();
        // The oldest has its request read: the next oldest goes.
        tickets[0].answered.store(true, Ordering::Relaxed);
        let newest = c.admit(ip(1), &mut closed).expect("room made");
        assert_eq!(closed.evicted, 1);
        assert!(tickets[1].evicted.try_recv().is_ok(), "told to close");
        assert!(tickets[0].evicted.try_recv().is_err());
        assert_eq!(c.total(), PER_PEER);
        // Another peer is not touched.
        c.admit(ip(2), &mut closed).unwrap();
        assert_eq!(closed.evicted, 1);
        // All being answered: nothing to evict, the newest is refused.
        for t in &tickets {
            t.answered.store(true, Ordering::Relaxed);
        }
        newest.answered.store(true, Ordering::Relaxed);
        assert!(c.admit(ip(1), &mut closed).is_none());
        assert_eq!(closed.refused, 1);
    }

    #[test]
    fn at_the_total_the_peer_holding_most_makes_room() {
        let mut c = Conns::default();
        let mut closed = Closed::default();
        let mut held = Vec::new();
        let mut last = 0u8;
        // Peers of PER_PEER - 1 each, and one of PER_PEER, up to TOTAL.
        while c.total() < TOTAL {
            last += 1;
            let n = if last == 3 { PER_PEER } else { PER_PEER - 1 };
            for _ in 0..n.min(TOTAL - c.total()) {
                held.push((last, c.admit(ip(last), &mut closed).unwrap()));
            }
        }
        assert_eq!(closed.evicted, 0);
        c.admit(ip(200), &mut closed).expect("room made");
        assert_eq!(c.total(), TOTAL);
        let evicted: Vec<u8> = held
            .iter_mut()
            .filter_map(|(p, t)| t.evicted.try_recv().is_ok().then_some(*p))
            .collect();
        assert_eq!(evicted, [3]);
    }

    #[test]
    fn a_peer_is_an_ipv4_address_or_an_ipv6_slash_64() {
        let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:bbbb::7".parse().unwrap();
        let c: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(peer(a), peer(b));
        assert_ne!(peer(a), peer(c));
        let mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        assert_eq!(peer(mapped), ip(1));
        assert_ne!(peer(ip(1)), peer(ip(2)));
    }

    #[test]
    fn an_ended_connection_gives_its_room_back_once() {
        let mut c = Conns::default();
        let mut closed = Closed::default();
        let a = c.admit(ip(1), &mut closed).unwrap();
        let b = c.admit(ip(1), &mut closed).unwrap();
        c.remove(ip(1), a.id);
        c.remove(ip(1), a.id);
        assert_eq!(c.total(), 1);
        c.remove(ip(1), b.id);
        assert_eq!(c.total(), 0);
        assert!(c.peers.is_empty());
    }
}
