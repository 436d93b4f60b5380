//! The fault scenario: a handler that panics, a process killed inside the
//! body and one killed before the call, each parked after its deliveries.

use super::*;

/// The consumer processes of the fault scenario, one at a time, as a
/// supervisor runs them: one that ends, killed or not, is replaced by a fresh
/// one.
struct Supervisor {
    /// `src/bin/consumer_crash.rs`, as the test binary knows it
    /// (`CARGO_BIN_EXE_consumer_crash`).
    child: String,
    args: Vec<String>,
    prefix: String,
    started: u32,
    current: Option<Consumer>,
    /// The orders at whose crash point a process was SIGKILLed, in order.
    killed: Vec<String>,
    /// Processes that ended on their own, with their status and stderr.
    died: Vec<String>,
    /// What the processes said, for failure messages.
    log: Vec<String>,
    /// The log's times count from here.
    since: Instant,
}

struct Consumer {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
    stderr: Option<std::thread::JoinHandle<String>>,
}

impl Supervisor {
    fn new(child: &str, broker_args: Vec<String>, prefix: &str) -> Supervisor {
        let mut s = Supervisor {
            child: child.to_owned(),
            args: broker_args,
            prefix: prefix.to_owned(),
            started: 0,
            current: None,
            killed: Vec::new(),
            died: Vec::new(),
            log: Vec::new(),
            since: Instant::now(),
        };
        s.start();
        s
    }

    fn start(&mut self) {
        use std::io::{BufRead, BufReader, Read};
        use std::process::{Command, Stdio};

        self.started += 1;
        let mut child = Command::new(&self.child)
            .arg(format!("consumer-{}", self.started))
            .arg(&self.prefix)
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start consumer_crash");
        let stdout = child.stdout.take().expect("stdout");
        let mut stderr = child.stderr.take().expect("stderr");
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = stderr.read_to_string(&mut text);
            text
        });
        self.current = Some(Consumer {
            child,
            lines,
            stderr: Some(stderr),
        });
    }

    /// SIGKILLs the process that reports standing at a crash point (`at
    /// <order>`), and replaces a process that is gone.
    fn tend(&mut self) {
        let c = self.current.as_mut().expect("a consumer runs");
        while let Ok(line) = c.lines.try_recv() {
            self.log.push(format!(
                "{:?} {}: {line}",
                self.since.elapsed(),
                self.started
            ));
            if let Some(order) = line.strip_prefix("at ") {
                // SIGKILL: no destructor, no release, no ack, no goodbye.
                c.child.kill().expect("SIGKILL the consumer");
                c.child.wait().expect("reap the consumer");
                self.killed.push(order.to_owned());
                self.log.push(format!("{:?} killed", self.since.elapsed()));
                self.start();
                return;
            }
        }
        if let Some(status) = c.child.try_wait().expect("poll the consumer") {
            let stderr = c.stderr.take().map(|h| h.join().unwrap_or_default());
            // The panic's own line, not the backtrace under it.
            let stderr = stderr.unwrap_or_default();
            let why = stderr
                .lines()
                .find(|l| l.contains("panicked") || l.starts_with("consumer_crash:"))
                .unwrap_or("");
            self.died.push(format!(
                "consumer-{} ended with {status}: {why}",
                self.started
            ));
            self.start();
        }
    }

    /// Tends the processes until `cond` holds, failing after a deadline far
    /// above what the scenario needs.
    async fn tend_until<F, Fut>(&mut self, what: &str, mut cond: F)
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = bool>,
    {
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            self.tend();
            if cond().await {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting until {what}: killed inside {:?}, {} ended on their own, \
                 the first: {:?}; the consumers said:\n{}",
                self.killed,
                self.died.len(),
                self.died.first(),
                self.log.join("\n")
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Whether the current process is alive (not ended since the last
    /// `tend`).
    fn alive(&mut self) -> bool {
        let c = self.current.as_mut().expect("a consumer runs");
        c.child.try_wait().expect("poll the consumer").is_none()
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        if let Some(c) = self.current.as_mut() {
            let _ = c.child.kill();
            let _ = c.child.wait();
        }
    }
}

fn order_id(body: &[u8]) -> String {
    serde_json::from_slice::<OrderPaid>(body).map_or_else(|_| format!("{body:?}"), |o| o.order_id)
}

/// The fault scenario, across real processes, one message at a time: one
/// that panics its handler's body on every delivery; one whose process is
/// SIGKILLed inside the body (the key claimed) on every delivery; one whose
/// process is SIGKILLed in the handler before it calls the body (no claim);
/// then a normal one. Each of the first three is parked once, after exactly
/// `max_deliveries` (3) runs, and takes no effect; no process ends but by the
/// kills; and the fresh process after the last kill still consumes: the
/// normal message is processed once.
///
/// One message at a time keeps a kill away from another message's due
/// redelivery: a NATS server before the 2.10 series can then hand a message
/// out again with its count gone back (nats-server#5305), as the README says.
pub async fn crash_and_panic_are_parked<B: Broker>(child: &str, broker: B) {
    let url = crate::services::redis_url();
    let connected = async {
        redis::Client::open(url.as_str())?
            .get_multiplexed_async_connection()
            .await
    };
    let Some(redis) = crate::services::reachable("Redis", &url, connected.await) else {
        broker.cleanup().await;
        return;
    };
    let prefix = format!("idem-test-consumer-crash-{}:", suffix());
    let counts = async |what: &str| -> HashMap<String, u32> {
        redis::cmd("HGETALL")
            .arg(format!("{prefix}{what}"))
            .query_async(&mut redis.clone())
            .await
            .unwrap()
    };
    let parked = async || -> Vec<(String, String)> {
        let mut all: Vec<_> = broker
            .parked()
            .await
            .into_iter()
            .map(|p| (order_id(&p.payload), p.reason))
            .collect();
        all.sort();
        all
    };
    let is_parked = async |id: &str| parked().await.iter().any(|(o, _)| o == id);

    let mut consumers = Supervisor::new(child, broker.child_args(), &prefix);
    publish(&broker, &order("panic-1")).await;
    consumers
        .tend_until("panic-1 is parked", || is_parked("panic-1"))
        .await;
    for id in ["crash-body-1", "crash-early-1"] {
        publish(&broker, &order(id)).await;
        consumers
            .tend_until(&format!("{id} is parked"), || is_parked(id))
            .await;
    }
    publish(&broker, &order("after-1")).await;
    consumers
        .tend_until("after-1 is processed", || async {
            counts("effects").await.get("after-1") == Some(&1) && broker.drained().await
        })
        .await;
    // Long enough for a stray redelivery of a parked message to show up.
    tokio::time::sleep(Duration::from_secs(1)).await;
    consumers.tend();
    let alive = consumers.alive();
    let (calls, effects, parked) = (
        counts("calls").await,
        counts("effects").await,
        parked().await,
    );
    let seen = format!(
        "bodies started {calls:?}, parked {parked:?}, the consumers said:\n{}",
        consumers.log.join("\n")
    );
    let (killed, died) = (consumers.killed.clone(), consumers.died.clone());
    drop(consumers);

    assert!(
        died.is_empty(),
        "processes ended on their own: {died:?}\n{seen}"
    );
    assert!(
        alive,
        "the last consumer process must still be running\n{seen}"
    );
    let mut expected_kills = vec!["crash-body-1"; 3];
    expected_kills.extend(["crash-early-1"; 3]);
    assert_eq!(killed, expected_kills, "{seen}");
    assert_eq!(calls.get("panic-1"), Some(&3), "{seen}");
    assert_eq!(calls.get("crash-body-1"), Some(&3), "{seen}");
    assert_eq!(calls.get("crash-early-1"), None, "{seen}");
    assert_eq!(
        effects,
        HashMap::from([("after-1".to_owned(), 1)]),
        "only the normal message takes effect, once\n{seen}"
    );
    let ids: Vec<&str> = parked.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(
        ids,
        ["crash-body-1", "crash-early-1", "panic-1"],
        "each is parked once\n{seen}"
    );
    for (_, reason) in &parked[..2] {
        assert!(
            reason.starts_with("delivered 4 times, over max_deliveries (3)")
                && reason.contains("not run"),
            "{seen}"
        );
    }
    assert!(
        parked[2].1.starts_with("failed 3 counted deliveries")
            && parked[2]
                .1
                .contains("the handler panicked: settling panic-1 broke the handler"),
        "{seen}"
    );

    let mut redis = redis;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}*"))
        .query_async(&mut redis)
        .await
        .unwrap();
    if !keys.is_empty() {
        let _: () = redis::cmd("DEL")
            .arg(keys)
            .query_async(&mut redis)
            .await
            .unwrap();
    }
    broker.cleanup().await;
}
