//! A TCP proxy in front of a server that a test can cut (every open
//! connection closes, new ones are refused) or make hold the server's replies
//! (requests still reach the server, answers wait): the two ways a network
//! fails a client mid-call. `set_down` is a cut that ends: the server is
//! unreachable for a while, then back. `hold_requests_with` stalls a client
//! between two commands: the first request holding a given byte string waits
//! (with all that follows it) until `release_requests`, so a test can run
//! something else at exactly that point.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

pub struct Proxy {
    port: u16,
    cut: watch::Sender<bool>,
    hold: watch::Sender<bool>,
    down: watch::Sender<bool>,
    /// The bytes whose request is held, if any.
    gate: watch::Sender<Option<&'static [u8]>>,
    /// How many requests the gate holds right now.
    held: watch::Sender<usize>,
    /// The bytes after whose request a connection is cut, if any.
    cut_after: watch::Sender<Option<&'static [u8]>>,
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `upstream` (`host:port`).
    pub async fn start(upstream: String) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (cut, cut_rx) = watch::channel(false);
        let (hold, hold_rx) = watch::channel(false);
        let (down, down_rx) = watch::channel(false);
        let (gate, gate_rx) = watch::channel(None);
        let (cut_after, cut_after_rx) = watch::channel(None);
        let (held, _) = watch::channel(0usize);
        let held_tx = held.clone();
        tokio::spawn(async move {
            let mut stop = cut_rx.clone();
            loop {
                let (client, _) = tokio::select! {
                    accepted = listener.accept() => accepted.unwrap(),
                    _ = stop.wait_for(|cut| *cut) => return, // drops the listener
                };
                if *down_rx.borrow() {
                    drop(client); // refused while down
                    continue;
                }
                let upstream = upstream.clone();
                let mut stop = cut_rx.clone();
                let mut outage = down_rx.clone();
                let hold = hold_rx.clone();
                let gate = Gate {
                    pattern: gate_rx.clone(),
                    cut_after: cut_after_rx.clone(),
                    held: held_tx.clone(),
                };
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    tokio::select! {
                        () = forward(client, server, hold, gate) => {}
                        _ = stop.wait_for(|cut| *cut) => {}
                        _ = outage.wait_for(|down| *down) => {}
                    }
                });
            }
        });
        Proxy {
            port,
            cut,
            hold,
            down,
            gate,
            held,
            cut_after,
        }
    }

    /// The proxy's port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Closes every connection through the proxy and refuses new ones.
    pub async fn cut(&self) {
        self.cut.send_replace(true);
        // Let the proxy tasks see it and close their sockets.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    /// While `true`, every connection through the proxy is closed and new
    /// ones are closed as they arrive; `false` lets them through again.
    pub async fn set_down(&self, down: bool) {
        self.down.send_replace(down);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    /// While `true`, what the server sends is held back (requests still pass).
    pub fn hold_replies(&self, hold: bool) {
        self.hold.send_replace(hold);
    }

    /// From now on, a request (one read from the client) that contains
    /// `bytes` is not forwarded, and neither is anything after it on its
    /// connection, until [`release_requests`](Self::release_requests).
    pub fn hold_requests_with(&self, bytes: &'static [u8]) {
        self.gate.send_replace(Some(bytes));
    }

    /// Waits until the gate holds a request.
    pub async fn request_held(&self) {
        let mut held = self.held.subscribe();
        held.wait_for(|n| *n > 0).await.unwrap();
    }

    /// From now on, a request that contains `bytes` reaches the server, and
    /// then its connection is closed: the server acts on it, its answer is
    /// lost (a COMMIT whose reply never comes back).
    pub fn cut_after_request_with(&self, bytes: &'static [u8]) {
        self.cut_after.send_replace(Some(bytes));
    }

    /// Forwards what the gate held, and holds nothing more.
    pub fn release_requests(&self) {
        self.gate.send_replace(None);
    }
}

struct Gate {
    pattern: watch::Receiver<Option<&'static [u8]>>,
    cut_after: watch::Receiver<Option<&'static [u8]>>,
    held: watch::Sender<usize>,
}

fn contains(chunk: &[u8], p: Option<&'static [u8]>) -> bool {
    p.is_some_and(|p| chunk.windows(p.len()).any(|w| w == p))
}

impl Gate {
    /// `chunk` was forwarded: whether to close the connection now.
    fn cut_after(&self, chunk: &[u8]) -> bool {
        contains(chunk, *self.cut_after.borrow())
    }

    /// Returns once `chunk` may go on.
    async fn pass(&mut self, chunk: &[u8]) {
        let matches = |p: &Option<&'static [u8]>| contains(chunk, *p);
        if !matches(&self.pattern.borrow()) {
            return;
        }
        self.held.send_modify(|n| *n += 1);
        let _ = self.pattern.wait_for(|p| !matches(p)).await;
        self.held.send_modify(|n| *n -= 1);
    }
}

async fn forward(
    client: TcpStream,
    server: TcpStream,
    mut hold: watch::Receiver<bool>,
    mut gate: Gate,
) {
    let (mut client_rx, mut client_tx) = client.into_split();
    let (mut server_rx, mut server_tx) = server.into_split();
    let up = async {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match client_rx.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            gate.pass(&buf[..n]).await;
            if server_tx.write_all(&buf[..n]).await.is_err() {
                return;
            }
            if gate.cut_after(&buf[..n]) {
                let _ = server_tx.flush().await;
                return;
            }
        }
    };
    let down = async {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match server_rx.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if hold.wait_for(|held| !*held).await.is_err() {
                return;
            }
            if client_tx.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    tokio::select! {
        () = up => {}
        () = down => {}
    }
}
