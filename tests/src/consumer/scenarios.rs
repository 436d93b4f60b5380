//! The consumer scenarios every broker runs.

use super::*;

/// A duplicate publish is processed once, and acked twice.
pub async fn duplicate_publish_is_processed_once<B: Broker>(broker: B) {
    let ledger = Ledger::new(MemoryStore::new());
    let runner = runner();
    let o = order("dup-1");
    publish(&broker, &o).await;
    publish(&broker, &o).await;
    let task = spawn::<B>(broker.consumer("c1").await, &runner, &ledger);
    eventually("both copies are acked", || async {
        runner.stats().acked == 2 && broker.drained().await
    })
    .await;
    task.abort();
    let stats = runner.stats();
    assert_eq!(ledger.effects("dup-1"), 1);
    assert_eq!(
        ledger.calls.load(SeqCst),
        1,
        "the duplicate must not run the body"
    );
    assert_eq!((stats.processed, stats.deduplicated), (1, 1), "{stats:?}");
    assert_eq!(stats.parked, 0);
    broker.cleanup().await;
}

/// A consumer that dies mid-message (its task gone, its connection cut,
/// nothing acked) leaves the message to another consumer, and the effect
/// happens once.
pub async fn dead_consumer_is_taken_over<B: Broker>(broker: B) {
    let ledger = Ledger::new(MemoryStore::new());
    let (r1, r2) = (runner(), runner());
    let o = order("hang-1");
    publish(&broker, &o).await;
    let doomed = spawn::<B>(broker.consumer("doomed").await, &r1, &ledger);
    ledger.started.acquire().await.unwrap().forget();
    doomed.abort();
    let _ = doomed.await;
    broker.kill("doomed").await;
    // The survivor is a healthy process: same scope, event and key, a body
    // that does not hang.
    let survivor = {
        let runner = r2.clone();
        let ledger = ledger.clone();
        let src = broker.consumer("survivor").await;
        tokio::spawn(async move {
            let err = runner
                .run(src, move |e: OrderPaid| settle_healthy(ledger.clone(), e))
                .await;
            panic!("the consumer stopped: {err}");
        })
    };
    eventually("the survivor acks the message", || async {
        r2.stats().acked == 1 && broker.drained().await
    })
    .await;
    survivor.abort();
    assert_eq!(ledger.effects("hang-1"), 1, "the effect happens once");
    let stats = r2.stats();
    assert_eq!(stats.processed, 1, "{stats:?}");
    assert_eq!(stats.parked, 0, "{stats:?}");
    broker.cleanup().await;
}

/// `settle` for a process that does not hang: same scope, event and key, so it
/// meets the dead consumer's claim.
#[idempotent(consumer, event = "SETTLE", key = "e.order_id", scope = "tests.consumer.settle", store = ledger.store, lease = "2s")]
pub async fn settle_healthy(ledger: Arc<Ledger>, e: OrderPaid) -> Result<(), SettleError> {
    ledger.calls.fetch_add(1, SeqCst);
    *ledger
        .effects
        .lock()
        .unwrap()
        .entry(e.order_id.clone())
        .or_default() += 1;
    Ok(())
}

/// A redelivery a day later (on the store's clock) is deduplicated: the
/// consumer ttl (7 days) outlives it.
pub async fn replay_a_day_later_is_deduplicated<B: Broker>(broker: B) {
    let clock = ManualClock::new(1_700_000_000_000);
    let ledger = Ledger::new(MemoryStore::builder().clock(clock.clone()).build());
    let runner = runner();
    let o = order("late-1");
    publish(&broker, &o).await;
    let task = spawn::<B>(broker.consumer("c1").await, &runner, &ledger);
    eventually("the first copy is acked", || async {
        runner.stats().acked == 1
    })
    .await;
    clock.advance(Duration::from_secs(24 * 3600));
    publish(&broker, &o).await;
    eventually("the replay is acked", || async {
        runner.stats().acked == 2 && broker.drained().await
    })
    .await;
    task.abort();
    assert_eq!(ledger.effects("late-1"), 1);
    assert_eq!(runner.stats().deduplicated, 1, "{:?}", runner.stats());
    broker.cleanup().await;
}

/// A message that always fails is parked after the configured deliveries
/// (3), with its reason, and not retried after that; an undecodable one is
/// parked at once without reaching the handler.
pub async fn poison_is_parked<B: Broker>(broker: B) {
    let ledger = Ledger::new(MemoryStore::new());
    let runner = runner();
    publish(&broker, &order("poison-1")).await;
    broker.publish_raw(b"{\"order_id\": 7", None).await;
    let task = spawn::<B>(broker.consumer("c1").await, &runner, &ledger);
    eventually("both are parked", || async {
        runner.stats().parked == 2 && broker.drained().await
    })
    .await;
    // Long enough for a fourth delivery to show up if parking did not stop it.
    tokio::time::sleep(Duration::from_secs(1)).await;
    task.abort();
    assert_eq!(
        ledger.calls.load(SeqCst),
        3,
        "three deliveries, then parked"
    );
    let stats = runner.stats();
    assert_eq!((stats.retried, stats.parked), (2, 2), "{stats:?}");
    let mut reasons: Vec<String> = broker
        .parked()
        .await
        .into_iter()
        .map(|p| p.reason)
        .collect();
    reasons.sort();
    assert_eq!(reasons.len(), 2, "{reasons:?}");
    assert!(
        reasons[0].starts_with("failed 3 counted deliveries") && reasons[0].contains("LedgerDown"),
        "{reasons:?}"
    );
    assert!(reasons[1].starts_with("undecodable: "), "{reasons:?}");
    assert!(
        !reasons[1].contains('7'),
        "a reason never quotes the message"
    );
    broker.cleanup().await;
}

/// A handler that calls `settle`, gets `Ok`, and then fails its own next
/// effect (a notification) is redelivered, not acked: the record holds the
/// settlement, not the notification. The redelivery replays the settlement
/// and sends the notification.
pub async fn effect_after_the_call_is_not_lost<B: Broker>(broker: B) {
    let ledger = Ledger::new(MemoryStore::new());
    let runner = runner();
    publish(&broker, &order("notify-1")).await;
    let handler = {
        let ledger = ledger.clone();
        move |e: OrderPaid| {
            let ledger = ledger.clone();
            async move {
                let id = e.order_id.clone();
                settle(ledger.clone(), e).await?;
                ledger.notify(&id)
            }
        }
    };
    let task = spawn_with::<B, _, _, _>(broker.consumer("c1").await, &runner, handler);
    eventually("the message is acked", || async {
        runner.stats().acked == 1 && broker.drained().await
    })
    .await;
    task.abort();
    assert_eq!(ledger.effects("notify-1"), 1);
    assert_eq!(
        ledger.notified("notify-1"),
        1,
        "the notification after the settlement was lost: {:?}",
        runner.stats()
    );
    let stats = runner.stats();
    assert_eq!(
        (
            stats.retried,
            stats.deduplicated,
            stats.final_errors,
            stats.parked
        ),
        (1, 1, 0, 0),
        "{stats:?}"
    );
    broker.cleanup().await;
}

/// Two consumers in one group, 200 messages of which 30% are duplicates:
/// every order settles exactly once.
pub async fn two_consumers_settle_each_order_once<B: Broker>(broker: B) {
    let ledger = Ledger::new(MemoryStore::new());
    let (r1, r2) = (runner(), runner());
    let unique: Vec<OrderPaid> = (0..140).map(|i| order(format!("load-{i}"))).collect();
    let mut messages = unique.clone();
    // 60 duplicates spread over the run: every 7th order thrice, others twice.
    messages.extend((0..60).map(|i| unique[(i * 7) % 140].clone()));
    // Interleave so duplicates often meet their originals in flight.
    let mut order_of = (0..messages.len()).collect::<Vec<_>>();
    order_of.sort_by_key(|i| (i * 37) % messages.len());
    let t1 = spawn::<B>(broker.consumer("c1").await, &r1, &ledger);
    let t2 = spawn::<B>(broker.consumer("c2").await, &r2, &ledger);
    for i in order_of {
        publish(&broker, &messages[i]).await;
    }
    eventually("all 200 are acked", || async {
        sum(&[&r1, &r2], |s| s.acked) >= 200 && broker.drained().await
    })
    .await;
    t1.abort();
    t2.abort();
    let effects = ledger.all_effects();
    assert_eq!(effects.len(), 140);
    let twice: Vec<_> = effects.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "settled more than once: {twice:?}");
    assert_eq!(sum(&[&r1, &r2], |s| s.processed), 140);
    assert_eq!(sum(&[&r1, &r2], |s| s.parked), 0);
    assert!(
        r1.stats().delivered > 0 && r2.stats().delivered > 0,
        "both consumers took part: {:?} {:?}",
        r1.stats(),
        r2.stats()
    );
    broker.cleanup().await;
}

/// A duplicate that meets its original in progress is redelivered later, more
/// often than `max_deliveries`, and is still not parked: `InProgress` is not
/// a failure. The metrics say so too.
pub fn in_progress_is_not_a_failure<B: Broker>(make: impl Future<Output = Option<B>>) {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let ran = metrics::with_local_recorder(&recorder, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let Some(broker) = make.await else {
                return false;
            };
            let ledger = Ledger::new(MemoryStore::new());
            let (r1, r2) = (runner(), runner());
            let o = order("hold-1");
            publish(&broker, &o).await;
            let t1 = spawn::<B>(broker.consumer("c1").await, &r1, &ledger);
            ledger.started.acquire().await.unwrap().forget();
            // c1 holds the claim (its heartbeat renews the lease) while c2
            // meets the duplicate.
            publish(&broker, &o).await;
            let t2 = spawn::<B>(broker.consumer("c2").await, &r2, &ledger);
            eventually("c2 deferred more often than max_deliveries", || async {
                r2.stats().deferred > 3
            })
            .await;
            ledger.release.add_permits(1);
            // At least both copies: a broker may also hand out a copy again
            // that waited past its ack deadline in a busy consumer's buffer.
            eventually("both are acked", || async {
                sum(&[&r1, &r2], |s| s.acked) >= 2 && broker.drained().await
            })
            .await;
            t1.abort();
            t2.abort();
            assert_eq!(ledger.effects("hold-1"), 1);
            assert_eq!(ledger.calls.load(SeqCst), 1);
            // Whichever consumer takes the deferred copy last replays it.
            assert!(sum(&[&r1, &r2], |s| s.deduplicated) >= 1);
            assert_eq!(sum(&[&r1, &r2], |s| s.parked + s.retried), 0);
            broker.cleanup().await;
            true
        })
    });
    if !ran {
        return;
    }
    let snapshot = snapshotter.snapshot().into_vec();
    let count = |name: &str, extra: &[(&str, &str)]| -> u64 {
        snapshot
            .iter()
            .filter(|(key, _, _, _)| {
                let key = key.key();
                key.name() == name
                    && key
                        .labels()
                        .any(|l| l.key() == "scope" && l.value() == SCOPE)
                    && key
                        .labels()
                        .any(|l| l.key() == "event" && l.value() == EVENT)
                    && extra
                        .iter()
                        .all(|(k, v)| key.labels().any(|l| l.key() == *k && l.value() == *v))
            })
            .map(|(_, _, _, v)| match v {
                DebugValue::Counter(n) => *n,
                _ => 0,
            })
            .sum()
    };
    assert!(
        count(
            "idem_consumer_redelivered_total",
            &[("reason", "in_progress")]
        ) > 3
    );
    assert_eq!(
        count("idem_consumer_redelivered_total", &[("reason", "failed")]),
        0
    );
    assert_eq!(count("idem_consumer_parked_total", &[]), 0);
    assert!(count("idem_consumer_acked_total", &[]) >= 2);
    assert!(count("idem_consumer_deduplicated_total", &[]) >= 1);
    assert!(count("idem_consumer_delivered_total", &[]) >= 6);
}

/// With `concurrency(8)`, eight bodies run at once, and never a ninth: twelve
/// held messages, counted by the bodies themselves while they wait.
pub async fn concurrency_keeps_n_in_flight<B: Broker>(broker: B) {
    let ledger = Ledger::new(MemoryStore::new());
    let runner = runner().concurrency(8);
    for i in 0..12 {
        publish(&broker, &order(format!("hold-{i}"))).await;
    }
    let task = spawn::<B>(broker.consumer_for("c1", 8).await, &runner, &ledger);
    eventually("eight bodies run at once", || async {
        ledger.running.load(SeqCst) == 8
    })
    .await;
    ledger.release.add_permits(12);
    eventually("all twelve are acked", || async {
        runner.stats().processed == 12 && broker.drained().await
    })
    .await;
    task.abort();
    assert_eq!(ledger.most_running.load(SeqCst), 8, "{:?}", runner.stats());
    let effects = ledger.all_effects();
    assert_eq!(effects.len(), 12);
    assert!(effects.values().all(|n| *n == 1), "{effects:?}");
    let stats = runner.stats();
    assert_eq!(stats.parked + stats.retried, 0, "{stats:?}");
    broker.cleanup().await;
}

/// Two deliveries of one key in flight on one consumer: the second meets the
/// first's claim and is deferred (`InProgress`), then acked as a duplicate;
/// the body runs once.
pub async fn one_key_twice_in_flight_runs_once<B: Broker>(broker: B) {
    let ledger = Ledger::new(MemoryStore::new());
    let runner = runner().concurrency(2);
    let o = order("hold-twice");
    publish(&broker, &o).await;
    publish(&broker, &o).await;
    let task = spawn::<B>(broker.consumer_for("c1", 2).await, &runner, &ledger);
    ledger.started.acquire().await.unwrap().forget();
    eventually("the second copy is deferred", || async {
        runner.stats().deferred >= 1
    })
    .await;
    ledger.release.add_permits(1);
    eventually("both are acked", || async {
        runner.stats().acked >= 2 && broker.drained().await
    })
    .await;
    task.abort();
    assert_eq!(ledger.effects("hold-twice"), 1);
    assert_eq!(ledger.calls.load(SeqCst), 1, "the body ran once");
    let stats = runner.stats();
    assert_eq!(stats.processed, 1, "{stats:?}");
    assert!(stats.deduplicated >= 1, "{stats:?}");
    assert_eq!(stats.parked + stats.retried, 0, "{stats:?}");
    broker.cleanup().await;
}

/// Under `concurrency(4)` a poison message still gets exactly
/// `max_deliveries` runs and is parked, and an undecodable one is parked at
/// once, while twenty good ones settle around them.
pub async fn poison_is_parked_under_concurrency<B: Broker>(broker: B) {
    let ledger = Ledger::new(MemoryStore::new());
    let runner = runner().concurrency(4);
    publish(&broker, &order("poison-1")).await;
    broker.publish_raw(b"{\"order_id\": 7", None).await;
    for i in 0..20 {
        publish(&broker, &order(format!("par-{i}"))).await;
    }
    let task = spawn::<B>(broker.consumer_for("c1", 4).await, &runner, &ledger);
    eventually("both are parked and the rest settled", || async {
        let s = runner.stats();
        s.parked == 2 && s.processed == 20 && broker.drained().await
    })
    .await;
    // Long enough for a fourth delivery to show up if parking did not stop it.
    tokio::time::sleep(Duration::from_secs(1)).await;
    task.abort();
    assert_eq!(ledger.calls.load(SeqCst), 23, "three runs of the poison");
    let effects = ledger.all_effects();
    assert_eq!(effects.len(), 20);
    assert!(effects.values().all(|n| *n == 1), "{effects:?}");
    let stats = runner.stats();
    assert_eq!((stats.retried, stats.parked), (2, 2), "{stats:?}");
    let mut reasons: Vec<String> = broker
        .parked()
        .await
        .into_iter()
        .map(|p| p.reason)
        .collect();
    reasons.sort();
    assert_eq!(reasons.len(), 2, "{reasons:?}");
    assert!(
        reasons[0].starts_with("failed 3 counted deliveries") && reasons[0].contains("LedgerDown"),
        "{reasons:?}"
    );
    assert!(reasons[1].starts_with("undecodable: "), "{reasons:?}");
    broker.cleanup().await;
}
