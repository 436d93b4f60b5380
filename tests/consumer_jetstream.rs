//! The consumer scenarios on NATS JetStream (`IDEM_NATS_URL`), each on a
//! stream and a parking stream of its own that it deletes at the end.

use std::future::Future;
use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, pull};
use async_nats::jetstream::{self, Context, stream};
use idem_runtime::consumer::jetstream::{self as idem_jetstream, JetStreamSource};
use idem_runtime::consumer::{Action, BrokerError, Delivery, FromDelivery, Parked, Runner, Source};
use idem_runtime::store::memory::MemoryStore;
use idem_tests::consumer::*;
use idem_tests::services;

struct Nats {
    url: String,
    js: Context,
    stream: String,
    subject: String,
}

impl Nats {
    async fn new() -> Option<Nats> {
        let url = services::nats_url();
        let client = services::reachable("NATS", &url, async_nats::connect(url.as_str()).await)?;
        let js = jetstream::new(client);
        let name = format!("IDEM_TEST_{}", suffix().to_uppercase());
        let subject = format!("idem-test.{name}");
        for (stream, subject) in [
            (name.clone(), subject.clone()),
            (format!("{name}_PARKED"), format!("{subject}.parked")),
        ] {
            js.create_stream(stream::Config {
                name: stream,
                subjects: vec![subject],
                ..Default::default()
            })
            .await
            .unwrap();
        }
        Some(Nats {
            url,
            js,
            stream: name,
            subject,
        })
    }
}

#[async_trait::async_trait]
impl Broker for Nats {
    type Src = JetStreamSource;

    async fn publish(&self, order: &OrderPaid) {
        idem_jetstream::publish(&self.js, &self.subject, order)
            .await
            .unwrap();
    }

    async fn publish_raw(&self, body: &[u8], message_id: Option<&str>) {
        idem_jetstream::publish_raw(&self.js, &self.subject, body, message_id)
            .await
            .unwrap();
    }

    async fn consumer(&self, name: &str) -> JetStreamSource {
        self.consumer_for(name, 1).await
    }

    async fn consumer_for(&self, _name: &str, concurrency: usize) -> JetStreamSource {
        // A connection per consumer, as separate processes would have. The
        // ack wait is short so a dead consumer's message comes back quickly.
        let client = async_nats::connect(self.url.as_str()).await.unwrap();
        JetStreamSource::builder(
            &self.stream,
            "settlement",
            &format!("{}.parked", self.subject),
        )
        .ack_wait(Duration::from_secs(2))
        .batch(concurrency.max(10))
        .connect(&jetstream::new(client))
        .await
        .unwrap()
    }

    async fn parked(&self) -> Vec<Parked> {
        idem_jetstream::parked(&self.js, &format!("{}_PARKED", self.stream), 1000)
            .await
            .unwrap()
    }

    fn origin(&self) -> String {
        self.stream.clone()
    }

    async fn drained(&self) -> bool {
        let stream = self.js.get_stream(&self.stream).await.unwrap();
        let info = stream.consumer_info("settlement").await.unwrap();
        info.num_pending == 0 && info.num_ack_pending == 0
    }

    fn child_args(&self) -> Vec<String> {
        vec![
            "nats".into(),
            self.stream.clone(),
            format!("{}.parked", self.subject),
        ]
    }

    async fn cleanup(&self) {
        let _ = self.js.delete_stream(&self.stream).await;
        let _ = self
            .js
            .delete_stream(format!("{}_PARKED", self.stream))
            .await;
    }
}

#[tokio::test]
async fn duplicate_publish_is_processed_once() {
    let Some(b) = Nats::new().await else { return };
    idem_tests::consumer::duplicate_publish_is_processed_once(b).await;
}

#[tokio::test]
async fn dead_consumer_is_taken_over() {
    let Some(b) = Nats::new().await else { return };
    idem_tests::consumer::dead_consumer_is_taken_over(b).await;
}

#[tokio::test]
async fn replay_a_day_later_is_deduplicated() {
    let Some(b) = Nats::new().await else { return };
    idem_tests::consumer::replay_a_day_later_is_deduplicated(b).await;
}

#[tokio::test]
async fn poison_is_parked() {
    let Some(b) = Nats::new().await else { return };
    idem_tests::consumer::poison_is_parked(b).await;
}

#[tokio::test]
async fn two_consumers_settle_each_order_once() {
    let Some(b) = Nats::new().await else { return };
    idem_tests::consumer::two_consumers_settle_each_order_once(b).await;
}

#[test]
fn in_progress_is_not_a_failure() {
    idem_tests::consumer::in_progress_is_not_a_failure(Nats::new());
}

#[tokio::test]
async fn effect_after_the_call_is_not_lost() {
    let Some(b) = Nats::new().await else { return };
    idem_tests::consumer::effect_after_the_call_is_not_lost(b).await;
}

#[tokio::test]
async fn crash_and_panic_are_parked() {
    let Some(b) = Nats::new().await else { return };
    idem_tests::consumer::crash_and_panic_are_parked(env!("CARGO_BIN_EXE_consumer_crash"), b).await;
}

#[tokio::test]
async fn concurrency_keeps_n_in_flight() {
    let Some(b) = Nats::new().await else { return };
    idem_tests::consumer::concurrency_keeps_n_in_flight(b).await;
}

#[tokio::test]
async fn one_key_twice_in_flight_runs_once() {
    let Some(b) = Nats::new().await else { return };
    idem_tests::consumer::one_key_twice_in_flight_runs_once(b).await;
}

#[tokio::test]
async fn poison_is_parked_under_concurrency() {
    let Some(b) = Nats::new().await else { return };
    idem_tests::consumer::poison_is_parked_under_concurrency(b).await;
}

#[tokio::test]
async fn undecodable_bytes_are_parked_as_published() {
    let Some(b) = Nats::new().await else { return };
    idem_tests::consumer::undecodable_bytes_are_parked_as_published(b).await;
}

#[tokio::test]
async fn failing_handler_is_parked_with_its_error() {
    let Some(b) = Nats::new().await else { return };
    idem_tests::consumer::failing_handler_is_parked_with_its_error(b).await;
}

// ---- Limits of NATS JetStream (issue 30): the boundary cases of the table in
// ---- idem-runtime/src/consumer/jetstream.rs.

/// The next `n` deliveries of `source`, each processed on its own, with what
/// the runner answered (a broker error included).
async fn process_next<M, T, E, H, Fut>(
    source: &mut JetStreamSource,
    runner: &Runner,
    n: usize,
    handler: H,
) -> Vec<Result<Action, BrokerError>>
where
    M: FromDelivery,
    H: Fn(M) -> Fut,
    Fut: Future<Output = Result<T, E>>,
    E: std::fmt::Debug,
{
    let mut answers = Vec::new();
    for _ in 0..n {
        let delivery = tokio::time::timeout(Duration::from_secs(20), source.next())
            .await
            .expect("a delivery within 20 s")
            .expect("the broker");
        answers.push(runner.process(delivery, &handler).await);
    }
    answers
}

/// The reason of a parked action, or a panic naming what came instead.
fn parked_reason(answer: &Result<Action, BrokerError>) -> &str {
    match answer {
        Ok(Action::Parked { reason }) => reason,
        other => panic!("not parked: {other:?}"),
    }
}

/// Regression: a parked copy carried every header of the message, those the
/// server acts on included, so the parking publish was checked against
/// expectations meant for the main stream: `Nats-Expected-Stream` (not the
/// parking stream) and `Nats-Rollup` (not allowed there) were refused at
/// every delivery, and the message never parked. Under: a poison message
/// with a header of the application's own parks with it; over: one with
/// `Nats-Expected-Stream` of the main stream, one with `Nats-Rollup`, both
/// parked with their id and the application's header, without the server's.
#[tokio::test]
async fn a_parked_copy_drops_the_headers_the_server_acts_on() {
    let Some(b) = Nats::new().await else { return };
    let js = &b.js;
    // The main stream takes a rollup (the parking stream, as created, not).
    let mut config = js
        .get_stream(&b.stream)
        .await
        .unwrap()
        .cached_info()
        .config
        .clone();
    config.allow_rollup = true;
    js.update_stream(config).await.unwrap();
    let undecodable = b"{\"order_id\": 7";
    // The rollup first: in the main stream it purges what its subject held.
    let cases = [
        ("rollup-1", Some(("Nats-Rollup", "sub".to_owned()))),
        ("plain-1", None),
        (
            "expected-1",
            Some(("Nats-Expected-Stream", b.stream.clone())),
        ),
    ];
    for (id, server_header) in &cases {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Tenant", "acme");
        headers.insert(async_nats::header::NATS_MESSAGE_ID, *id);
        if let Some((name, value)) = server_header {
            headers.insert(*name, value.as_str());
        }
        js.publish_with_headers(b.subject.clone(), headers, undecodable.to_vec().into())
            .await
            .unwrap()
            .await
            .expect("the main stream takes each one");
    }
    let mut source = b.consumer("c1").await;
    let answers = process_next(&mut source, &runner(), cases.len(), |_: OrderPaid| async {
        Ok::<(), SettleError>(())
    })
    .await;
    assert!(
        answers.iter().all(|a| matches!(a,
            Ok(Action::Parked { reason }) if reason.starts_with("undecodable: "))),
        "{answers:?}"
    );
    let parked = b.parked().await;
    let ids: Vec<_> = parked.iter().map(|p| p.message_id.as_deref()).collect();
    assert_eq!(ids, [Some("rollup-1"), Some("plain-1"), Some("expected-1")]);
    let stream = js.get_stream(format!("{}_PARKED", b.stream)).await.unwrap();
    for p in &parked {
        let seq: u64 = p.position.as_deref().unwrap().parse().unwrap();
        let raw = stream.get_raw_message(seq).await.unwrap();
        // By name as text: `get` with a `&str` misses a standard header.
        let mut names: Vec<&str> = raw.headers.iter().map(|(n, _)| n.as_ref()).collect();
        names.sort();
        assert_eq!(
            names,
            [
                "Idem-Deliveries",
                "Idem-Escaped",
                "Idem-Reason",
                "Idem-Stream",
                "Nats-Msg-Id",
                "Tenant"
            ],
            "{p:?}"
        );
        assert_eq!(raw.headers.get("Tenant").map(|v| v.as_str()), Some("acme"));
    }
    assert!(
        b.drained().await,
        "each one was acked (terminated) once parked"
    );
    b.cleanup().await;
}

/// An error whose `Debug` is the text as it is, line breaks included.
struct Text(String);

impl std::fmt::Debug for Text {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Regression: a reason with a line break (an error's `Debug` over lines, a
/// panic message) went into the `Idem-Reason` header as it was, and `parked`
/// then failed for the whole parking stream (`malformed header line`). Under:
/// a one-line reason; over: a multi-line `Debug` and a multi-line panic, with
/// CR, tab, a control character, a backslash and non-ASCII text. All three
/// are read back by `parked` as they were written.
#[tokio::test]
async fn a_multi_line_reason_is_read_back_as_written() {
    let Some(b) = Nats::new().await else { return };
    let one_line = "the ledger said: no";
    let lines = "the ledger refused it\nCaused by:\n    0: a\r\n\tb \\n \u{7} \u{e9}t\u{e9}\n";
    for id in ["one-line", "lines", "panic"] {
        b.publish(&order(id)).await;
    }
    let mut source = b.consumer("c1").await;
    let answers = process_next(
        &mut source,
        &runner().max_deliveries(1),
        1 + 2,
        |e: OrderPaid| async move {
            match e.order_id.as_str() {
                "one-line" => Err::<(), _>(Text(one_line.to_owned())),
                "lines" => Err(Text(lines.to_owned())),
                _ => panic!("{lines}"),
            }
        },
    )
    .await;
    let written: Vec<&str> = answers.iter().map(parked_reason).collect();
    assert_eq!(
        written,
        [
            format!("failed 1 counted deliveries; the last: {one_line}"),
            format!("failed 1 counted deliveries; the last: {lines}"),
            format!("failed 1 counted deliveries; the last: the handler panicked: {lines}"),
        ]
    );
    let read: Vec<String> = b.parked().await.into_iter().map(|p| p.reason).collect();
    assert_eq!(read, written);
    b.cleanup().await;
}

/// The server hands a durable no more than its `max_ack_pending` unacked
/// messages: a runner with `concurrency(8)` on a durable created (before
/// `connect`, which keeps an existing durable's settings) with
/// `max_ack_pending` 4 runs 4 bodies at once and never a fifth; with 8 it runs
/// 8. `connect` warns about the first (4 is below the batch of 10).
#[tokio::test]
async fn the_durables_max_ack_pending_caps_concurrency() {
    for cap in [8, 4] {
        let Some(b) = Nats::new().await else { return };
        let stream = b.js.get_stream(&b.stream).await.unwrap();
        stream
            .create_consumer(pull::Config {
                durable_name: Some("settlement".into()),
                ack_policy: AckPolicy::Explicit,
                max_deliver: -1,
                max_ack_pending: cap,
                ..Default::default()
            })
            .await
            .unwrap();
        let ledger = Ledger::new(MemoryStore::new());
        let runner = runner().concurrency(8);
        for i in 0..8 {
            b.publish(&order(format!("hold-{i}"))).await;
        }
        let task = spawn::<Nats>(b.consumer_for("c1", 8).await, &runner, &ledger);
        eventually(&format!("{cap} bodies run at once"), || async {
            ledger.running.load(SeqCst) == cap as u32
        })
        .await;
        // Time for a delivery past the cap to show up.
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(ledger.most_running.load(SeqCst), cap as u32);
        ledger.release.add_permits(8);
        eventually("all eight are acked", || async {
            runner.stats().processed == 8 && b.drained().await
        })
        .await;
        task.abort();
        assert_eq!(ledger.most_running.load(SeqCst), cap as u32, "cap {cap}");
        b.cleanup().await;
    }
}

/// A `nats-server` of this test's own on a free loopback port, with
/// JetStream and a `max_payload` of 8 KiB (the shared server's is 1 MiB, and
/// a test must not change it), killed and its store removed when dropped.
struct OwnNats {
    child: std::process::Child,
    dir: std::path::PathBuf,
    url: String,
}

impl OwnNats {
    const MAX_PAYLOAD: usize = 8 * 1024;

    fn start() -> Option<OwnNats> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let dir = std::env::temp_dir().join(format!("idem-nats-{}", suffix()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("nats.conf");
        std::fs::write(&config, format!("max_payload: {}\n", OwnNats::MAX_PAYLOAD)).unwrap();
        let child = std::process::Command::new("nats-server")
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js"])
            .arg("-sd")
            .arg(dir.join("store"))
            .arg("-c")
            .arg(&config)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn();
        let child = services::reachable("nats-server (binary)", "PATH", child)?;
        let server = OwnNats {
            child,
            dir,
            url: format!("nats://127.0.0.1:{port}"),
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "nats-server did not start on {port}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(server)
    }
}

impl Drop for OwnNats {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Regression: a parked copy adds three headers to the message, and one
/// within a few hundred bytes of `max_payload` made a copy over it: the
/// server closed the connection, the park failed, and the message came back
/// after `ack_wait` to fail the same way, never parked. On a server of its
/// own with an 8 KiB `max_payload`, three messages parked with a 100-byte
/// reason: the first's copy is exactly at the limit (parked, the whole
/// reason); the second is a byte longer (parked, the reason cut to fit, with
/// `…`); the third is itself at the limit, so no copy fits even without a
/// reason: the park fails naming `max_payload`, nothing is sent, and the
/// message stays unacked: the same connection delivers it again.
#[tokio::test]
async fn a_parked_copy_is_cut_to_max_payload() {
    let Some(server) = OwnNats::start() else {
        return;
    };
    let client = async_nats::connect(server.url.as_str()).await.unwrap();
    let max = client.server_info().max_payload;
    assert_eq!(max, OwnNats::MAX_PAYLOAD);
    let js = jetstream::new(client.clone());
    let (name, subject) = ("MAIN", "main");
    let parking = format!("{subject}.parked");
    for (stream, subject) in [(name, subject), ("PARKED", parking.as_str())] {
        js.create_stream(stream::Config {
            name: stream.into(),
            subjects: vec![subject.into()],
            ..Default::default()
        })
        .await
        .unwrap();
    }
    let reason = "r".repeat(100);
    // The copy's header block (`NATS/1.0`, its id, the four added headers,
    // the blank line) and its payload: `payload` bytes more than the block.
    let copy_headers = |id: &str| {
        "NATS/1.0\r\n".len()
            + format!("Nats-Msg-Id: {id}\r\n").len()
            + "Idem-Deliveries: 1\r\n".len()
            + "Idem-Escaped: 1\r\n".len()
            + format!("Idem-Stream: {name}\r\n").len()
            + format!("Idem-Reason: {reason}\r\n").len()
            + 2
    };
    let at = vec![b'x'; max - copy_headers("at-1")];
    let over = vec![b'x'; max - copy_headers("ov-1") + 1];
    let original = "NATS/1.0\r\n".len() + "Nats-Msg-Id: full\r\n".len() + 2;
    let full = vec![b'x'; max - original];
    for (id, payload) in [("at-1", &at), ("ov-1", &over), ("full", &full)] {
        idem_jetstream::publish_raw(&js, subject, payload, Some(id))
            .await
            .unwrap();
    }

    let mut source = JetStreamSource::builder(name, "settlement", &parking)
        .ack_wait(Duration::from_secs(1))
        .connect(&js)
        .await
        .unwrap();
    let mut answers = Vec::new();
    for _ in 0..3 {
        let delivery = tokio::time::timeout(Duration::from_secs(20), source.next())
            .await
            .expect("a delivery within 20 s")
            .expect("the broker");
        answers.push(delivery.park(&reason).await);
    }
    let (parked, failed) = answers.split_at(2);
    assert!(parked.iter().all(Result::is_ok), "{answers:?}");
    let err = failed[0].as_ref().expect_err("no copy fits").to_string();
    assert!(err.contains("max_payload of 8192"), "{err}");
    assert_eq!(
        client.connection_state(),
        async_nats::connection::State::Connected
    );
    let again = tokio::time::timeout(Duration::from_secs(20), source.next())
        .await
        .expect("the unparked one back after ack_wait")
        .expect("the broker");
    assert_eq!(
        (again.message_id(), again.attempt()),
        (Some("full"), 2),
        "not terminated: delivered again"
    );

    let read = idem_jetstream::parked(&js, "PARKED", 10).await.unwrap();
    let got: Vec<_> = read
        .iter()
        .map(|p| (p.message_id.as_deref(), p.payload.len(), p.reason.as_str()))
        .collect();
    let cut = format!("{}\u{2026}", &reason[..reason.len() - 4]);
    assert_eq!(
        got,
        [
            (Some("at-1"), at.len(), reason.as_str()),
            (Some("ov-1"), over.len(), cut.as_str()),
        ]
    );
}

// ---- Streams created on request (issue 34, item 6): a row of the table in
// ---- idem-runtime/src/consumer/jetstream.rs.

/// The subjects a stream captures, as the server has them.
async fn subjects_of(js: &Context, stream: &str) -> Vec<String> {
    let stream = js.get_stream(stream).await.unwrap();
    stream.cached_info().config.subjects.clone()
}

/// `create_stream` and `create_parking_stream` make the stream and the
/// parking stream when they are missing, and a park lands in the latter; a
/// second `connect` uses them as they are. An existing stream whose subjects
/// do not capture those asked for, a stream that would capture its own
/// parking subject, and subjects another stream already captures are each an
/// error naming the problem, and no stream is created or changed.
#[tokio::test]
async fn streams_are_created_on_request_and_never_changed() {
    let url = services::nats_url();
    let Some(client) = services::reachable("NATS", &url, async_nats::connect(url.as_str()).await)
    else {
        return;
    };
    let js = jetstream::new(client);
    let name = format!("IDEM_TEST_{}", suffix().to_uppercase());
    let subject = format!("idem-test.{name}");
    let parking = format!("idem-test-parked.{name}");
    let parked_stream = format!("{name}_PARKED");
    let other = format!("{name}_OTHER");
    let builder = |stream: &str, parking: &str, subjects: Vec<String>| {
        JetStreamSource::builder(stream, "settlement", parking)
            .ack_wait(Duration::from_secs(2))
            .create_stream(subjects)
    };

    let mut source = builder(&name, &parking, vec![format!("{subject}.>")])
        .create_parking_stream(&parked_stream)
        .connect(&js)
        .await
        .expect("both streams created");
    assert_eq!(subjects_of(&js, &name).await, [format!("{subject}.>")]);
    assert_eq!(subjects_of(&js, &parked_stream).await, [parking.as_str()]);
    idem_jetstream::publish_raw(&js, &format!("{subject}.paid"), b"{not json", Some("u-1"))
        .await
        .unwrap();
    let answers = process_next(&mut source, &runner(), 1, |_: OrderPaid| async {
        Ok::<(), std::io::Error>(())
    })
    .await;
    assert!(parked_reason(&answers[0]).starts_with("undecodable"));
    let parked = idem_jetstream::parked(&js, &parked_stream, 10)
        .await
        .unwrap();
    assert_eq!(
        parked.len(),
        1,
        "the park landed in the stream created for it"
    );

    // Again: used as they are.
    let created = js.get_stream(&name).await.unwrap().cached_info().created;
    builder(&name, &parking, vec![format!("{subject}.>")])
        .create_parking_stream(&parked_stream)
        .connect(&js)
        .await
        .expect("an existing compatible stream is used as it is");
    // A narrower subject the stream's `>` captures: the stream is used as it
    // is, and a new durable reads only the subject asked for, so another
    // event on the stream never reaches this handler.
    let mut narrow = JetStreamSource::builder(&name, "settlement-paid", &parking)
        .ack_wait(Duration::from_secs(2))
        .create_stream([format!("{subject}.paid")])
        .connect(&js)
        .await
        .expect("a wider stream is used as it is");
    idem_jetstream::publish_raw(
        &js,
        &format!("{subject}.refunded"),
        b"{not json",
        Some("r-1"),
    )
    .await
    .unwrap();
    idem_jetstream::publish_raw(&js, &format!("{subject}.paid"), b"{not json", Some("p-2"))
        .await
        .unwrap();
    let answers = process_next(&mut narrow, &runner(), 2, |_: OrderPaid| async {
        Ok::<(), std::io::Error>(())
    })
    .await;
    assert_eq!(answers.len(), 2, "{answers:?}");
    let parked = idem_jetstream::parked(&js, &parked_stream, 10)
        .await
        .unwrap();
    let ids: Vec<_> = parked.iter().filter_map(|p| p.message_id.clone()).collect();
    assert!(
        !ids.contains(&"r-1".to_owned()),
        "the refund reached the payments' durable: {ids:?}"
    );
    // Several subjects on the wider stream: a durable cannot filter on them
    // (one filter per durable before nats-server 2.10), so none is made.
    let err = JetStreamSource::builder(&name, "settlement-two", &parking)
        .create_stream([format!("{subject}.paid"), format!("{subject}.refunded")])
        .connect(&js)
        .await
        .map(|_| ())
        .expect_err("several subjects on a wider stream");
    assert!(
        err.to_string().contains("beyond the subjects asked for"),
        "{err}"
    );
    assert!(
        js.get_stream(&name)
            .await
            .unwrap()
            .consumer_info("settlement-two")
            .await
            .is_err(),
        "no durable is left behind"
    );
    // The durable made for `.>` reads more than `.paid`: refused, not used.
    let err = builder(&name, &parking, vec![format!("{subject}.paid")])
        .connect(&js)
        .await
        .map(|_| ())
        .expect_err("a durable reading beyond the subjects asked for");
    assert!(
        err.to_string().contains("beyond the subjects asked for"),
        "{err}"
    );
    let info = js.get_stream(&name).await.unwrap().cached_info().clone();
    assert_eq!((info.created, info.state.messages), (created, 3));
    assert_eq!(subjects_of(&js, &name).await, [format!("{subject}.>")]);

    // A stream that exists with other subjects.
    js.create_stream(stream::Config {
        name: other.clone(),
        subjects: vec![format!("idem-test.{other}.a")],
        ..Default::default()
    })
    .await
    .unwrap();
    let wanted = format!("idem-test.{other}.b");
    let err = builder(&other, &format!("{parking}.2"), vec![wanted.clone()])
        .connect(&js)
        .await
        .err()
        .expect("other subjects are an error");
    let text = err.to_string();
    assert!(
        text.contains(&format!("the stream `{other}` exists on the subjects"))
            && text.contains(&wanted)
            && text.contains("does not change an existing stream"),
        "{text}"
    );
    assert_eq!(
        subjects_of(&js, &other).await,
        [format!("idem-test.{other}.a")]
    );
    // Nor is a parking stream that exists on another subject changed.
    let err = JetStreamSource::builder(&name, "settlement", &format!("{parking}.2"))
        .create_parking_stream(&parked_stream)
        .connect(&js)
        .await
        .err()
        .expect("a parking stream on another subject is an error");
    assert!(err.to_string().contains("do not capture"), "{err}");
    assert_eq!(subjects_of(&js, &parked_stream).await, [parking.as_str()]);

    // A stream that would capture its own parking subject: refused before
    // anything is created, and refused for an existing one.
    let selfish = format!("{name}_SELF");
    let err = builder(
        &selfish,
        &format!("idem-test.{selfish}.parked"),
        vec![format!("idem-test.{selfish}.>")],
    )
    .connect(&js)
    .await
    .err()
    .expect("a stream capturing its parking subject is an error");
    assert!(
        err.to_string().contains("captures the parking subject"),
        "{err}"
    );
    assert!(js.get_stream(&selfish).await.is_err(), "not created");
    let err = builder(
        &name,
        &format!("{subject}.parked"),
        vec![format!("{subject}.paid")],
    )
    .connect(&js)
    .await
    .err()
    .expect("an existing stream capturing the parking subject is an error");
    assert!(
        err.to_string().contains("captures the parking subject"),
        "{err}"
    );

    // Subjects another stream already captures: that stream is named.
    let second = format!("{name}_TWO");
    let err = builder(
        &second,
        &format!("{parking}.3"),
        vec![format!("{subject}.paid")],
    )
    .connect(&js)
    .await
    .err()
    .expect("subjects of another stream are an error");
    assert!(
        err.to_string()
            .contains(&format!("the stream `{name}` already captures")),
        "{err}"
    );
    assert!(js.get_stream(&second).await.is_err(), "not created");

    for stream in [&name, &parked_stream, &other] {
        let _ = js.delete_stream(stream).await;
    }
}
