//! What a test or an operator does around a runner that parks: a poison
//! message made with the adapter's `publish_raw`, and what was parked read
//! back with its `parked`.

use std::time::SystemTime;

use super::*;

/// How far the broker's clock may be from this process's: a parked message's
/// time is the broker's.
const CLOCK_SKEW: Duration = Duration::from_secs(60);

/// Bytes that are not JSON, published with `publish_raw` under an id, are
/// parked on their first delivery without reaching the handler; `parked`
/// reads them back byte for byte, with the decoding failure as the reason,
/// the id, where they came from and the one delivery. Reading leaves them
/// parked: a second read finds the same.
pub async fn undecodable_bytes_are_parked_as_published<B: Broker>(broker: B) {
    let ledger = Ledger::new(MemoryStore::new());
    let runner = runner();
    // Not UTF-8 either: a reader that went through text would change them.
    let poison: &[u8] = b"\xff\xfe{\"order_id\": 7";
    let before = SystemTime::now();
    broker.publish_raw(poison, Some("m-undecodable-1")).await;
    let task = spawn::<B>(broker.consumer("c1").await, &runner, &ledger);
    eventually("it is parked", || async {
        runner.stats().parked == 1 && broker.drained().await
    })
    .await;
    task.abort();
    assert_eq!(ledger.calls.load(SeqCst), 0, "the handler never ran");

    let parked = broker.parked().await;
    assert_eq!(parked.len(), 1, "{parked:?}");
    let p = &parked[0];
    assert_eq!(p.payload, poison, "{p:?}");
    assert!(
        p.reason
            .starts_with("undecodable: bytes that are not valid JSON at line 1, column "),
        "{p:?}"
    );
    assert_eq!(p.message_id.as_deref(), Some("m-undecodable-1"), "{p:?}");
    assert_eq!(p.origin, Some(broker.origin()), "{p:?}");
    assert_eq!(p.deliveries, Some(1), "{p:?}");
    if broker.parking_is_a_stream() {
        let at = p.parked_at.expect("a parking stream keeps the time");
        assert!(
            at > before - CLOCK_SKEW && at < SystemTime::now() + CLOCK_SKEW,
            "{p:?}"
        );
        assert!(p.position.is_some(), "{p:?}");
    } else {
        assert_eq!((p.parked_at, &p.position), (None, &None), "{p:?}");
    }
    assert_eq!(broker.parked().await, parked, "reading leaves them parked");
    broker.cleanup().await;
}

/// A handler that always fails, under `max_deliveries(2)`: the message
/// (published with the typed `publish`, no id) runs twice and is parked with
/// the handler's error in the reason and both deliveries counted.
pub async fn failing_handler_is_parked_with_its_error<B: Broker>(broker: B) {
    let ledger = Ledger::new(MemoryStore::new());
    let runner = runner().max_deliveries(2);
    let o = order("poison-twice");
    publish(&broker, &o).await;
    let task = spawn::<B>(broker.consumer("c1").await, &runner, &ledger);
    eventually("it is parked", || async {
        runner.stats().parked == 1 && broker.drained().await
    })
    .await;
    task.abort();
    assert_eq!(ledger.calls.load(SeqCst), 2, "{:?}", runner.stats());

    let parked = broker.parked().await;
    assert_eq!(parked.len(), 1, "{parked:?}");
    let p = &parked[0];
    assert_eq!(p.payload, serde_json::to_vec(&o).unwrap(), "{p:?}");
    assert!(
        p.reason
            .starts_with("failed 2 counted deliveries; the last: ")
            && p.reason.contains("LedgerDown"),
        "{p:?}"
    );
    assert_eq!(p.message_id, None, "{p:?}");
    assert_eq!(p.origin, Some(broker.origin()), "{p:?}");
    assert_eq!(p.deliveries, Some(2), "{p:?}");
    broker.cleanup().await;
}
