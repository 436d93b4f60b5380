//! The store conformance suite: the [`Store`](idem_runtime::store::Store) contract, case by case.
//!
//! Every backend runs it unchanged through [`conformance_suite!`](crate::conformance_suite): give it a
//! module name and an async expression that builds a [`Subject`]. Keys are
//! random per case, so backends on a shared server need no cleanup.
//!
//! Time is the subject's: a store on a [`ManualClock`] is moved forward
//! instantly; a store that reads a server's clock is waited on in real time,
//! with durations scaled by [`Subject::unit`].

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem_runtime::protocol::{Kind, Spec, execute};
use idem_runtime::store::{
    Claim, ClaimRequest, Completion, RecordState, RecoveryArgs, RecoveryTurn, Store as _, StoreRef,
    StoredOutcome, StoredResult, Token, Turn,
};
use idem_runtime::{Clock as _, Error, Fingerprint, Key, ManualClock};

/// How a subject's clock moves.
#[derive(Debug, Clone)]
pub enum Time {
    /// The store reads this clock: advancing it is instant.
    Manual(ManualClock),
    /// The store reads real (or server) time: advancing sleeps. `unit` is the
    /// smallest lease the backend handles reliably.
    Real {
        /// The time unit the cases scale by.
        unit: Duration,
    },
}

/// A store under test and control of its time.
#[derive(Debug, Clone)]
pub struct Subject {
    /// The store.
    pub store: StoreRef,
    /// Its clock.
    pub time: Time,
    /// The backend deletes expired records by itself (Redis key expiry), so
    /// `purge_expired` finds only released records left to delete.
    pub expires_itself: bool,
}

impl Subject {
    /// A subject whose store reads real (server) time; cases scale by `unit`.
    pub fn real(store: StoreRef, unit: Duration) -> Self {
        Subject {
            store,
            time: Time::Real { unit },
            expires_itself: false,
        }
    }

    /// A subject whose store reads `clock`.
    pub fn manual(store: StoreRef, clock: ManualClock) -> Self {
        Subject {
            store,
            time: Time::Manual(clock),
            expires_itself: false,
        }
    }

    /// Marks a backend that deletes expired records by itself (Redis key
    /// expiry): purging then has only released records to count.
    pub fn expiring_by_itself(mut self) -> Self {
        self.expires_itself = true;
        self
    }

    /// The unit the cases scale leases and ttls by.
    pub fn unit(&self) -> Duration {
        match &self.time {
            Time::Manual(_) => Duration::from_secs(1),
            Time::Real { unit } => *unit,
        }
    }

    /// Lets `units` units of the store's time pass.
    pub async fn advance(&self, units: u32) {
        let by = self.unit() * units;
        match &self.time {
            Time::Manual(clock) => clock.advance(by),
            Time::Real { .. } => tokio::time::sleep(by).await,
        }
    }

    fn lease(&self) -> Duration {
        self.unit() * 3
    }

    fn ttl(&self) -> Duration {
        self.unit() * 20
    }

    fn request<'a>(&self, key: &'a Key, token: Token, fp: Option<Fingerprint>) -> ClaimRequest<'a> {
        ClaimRequest {
            key,
            token,
            fingerprint: fp,
            lease: self.lease(),
            ttl: self.ttl(),
        }
    }
}

/// A key no other case or run shares.
pub fn fresh_key(case: &str) -> Key {
    Key::builder("idem-conformance")
        .part(case)
        .part(&rand_u64())
        .finish()
}

fn rand_u64() -> u64 {
    // Tokens are random; borrowing one avoids a direct dependency on `rand` here.
    let t = *Token::random().as_bytes();
    u64::from_le_bytes(t[..8].try_into().expect("16-byte token"))
}

fn fingerprint(s: &str) -> Fingerprint {
    Fingerprint::builder().part(s).finish()
}

fn success(payload: &[u8], ttl: Duration) -> Completion<'_> {
    Completion {
        outcome: StoredOutcome::Success,
        payload,
        ttl,
    }
}

/// A claim by a newcomer: what any other caller would find.
async fn claim_as_newcomer(s: &Subject, key: &Key) -> Claim {
    s.store
        .claim(s.request(key, Token::random(), None))
        .await
        .expect("claim")
}

/// The stored result a newcomer replays; panics if the record is not DONE.
async fn replayed(s: &Subject, key: &Key) -> StoredResult {
    match claim_as_newcomer(s, key).await {
        Claim::Done(stored) => stored,
        other => panic!("expected a replay, got {other:?}"),
    }
}

async fn acquire(s: &Subject, key: &Key, token: Token) -> u64 {
    match s
        .store
        .claim(s.request(key, token, None))
        .await
        .expect("claim")
    {
        Claim::Acquired { fence, .. } => fence,
        other => panic!("expected to acquire, got {other:?}"),
    }
}

/// An absent key is acquired, not as a takeover, and shows as PROCESSING.
pub async fn absent_key_is_acquired(s: Subject) {
    let key = fresh_key("absent");
    let claim = claim_as_newcomer(&s, &key).await;
    let Claim::Acquired { fence, takeover } = claim else {
        panic!("expected Acquired, got {claim:?}");
    };
    assert!(fence >= 1);
    assert!(!takeover, "a first claim is not a takeover");
    let info = s.store.inspect(&key).await.unwrap().expect("record exists");
    assert_eq!(info.state, RecordState::Processing);
    assert_eq!(info.fence, fence);
    assert!(info.result.is_none());
}

/// A live claim makes other claimants busy, with the lease left and the
/// owner's fingerprint.
pub async fn live_claim_is_busy(s: Subject) {
    let key = fresh_key("busy");
    let fp = fingerprint("payload-a");
    let first = s
        .store
        .claim(s.request(&key, Token::random(), Some(fp)))
        .await
        .unwrap();
    assert!(matches!(first, Claim::Acquired { .. }));
    let second = claim_as_newcomer(&s, &key).await;
    let Claim::Busy {
        lease_remaining,
        fingerprint: theirs,
    } = second
    else {
        panic!("expected Busy, got {second:?}");
    };
    assert!(lease_remaining > Duration::ZERO && lease_remaining <= s.lease());
    assert_eq!(theirs, Some(fp));
}

/// A claim re-sent under the same token (a client retrying after an I/O
/// error) gets its own claim back instead of being told it is busy.
pub async fn same_token_reclaims(s: Subject) {
    let key = fresh_key("same-token");
    let token = Token::random();
    let fence = acquire(&s, &key, token).await;
    let again = acquire(&s, &key, token).await;
    assert_eq!(again, fence, "a retried claim is the same claim");
}

/// Completion stores the result; later claims replay it, fingerprint included.
pub async fn completed_record_replays(s: Subject) {
    let key = fresh_key("replay");
    let token = Token::random();
    let fp = fingerprint("payload");
    let claim = s
        .store
        .claim(s.request(&key, token, Some(fp)))
        .await
        .unwrap();
    assert!(matches!(claim, Claim::Acquired { .. }));
    assert!(
        s.store
            .complete(&key, token, success(b"{\"id\":7}", s.ttl()))
            .await
            .unwrap()
    );
    for _ in 0..2 {
        let claim = s
            .store
            .claim(s.request(&key, Token::random(), Some(fp)))
            .await
            .unwrap();
        let Claim::Done(stored) = claim else {
            panic!("expected Done, got {claim:?}");
        };
        assert_eq!(stored.outcome, StoredOutcome::Success);
        assert_eq!(stored.payload, b"{\"id\":7}");
        assert_eq!(stored.fingerprint, Some(fp));
    }
    let info = s.store.inspect(&key).await.unwrap().expect("record exists");
    assert_eq!(info.state, RecordState::Done);
}

/// Final errors and unstored markers keep their outcome; payloads are bytes,
/// kept exactly (empty, binary, at the size cap).
pub async fn outcomes_and_payloads_round_trip(s: Subject) {
    let cap = s.store.max_result_bytes();
    let big: Vec<u8> = (0..cap).map(|i| (i % 251) as u8).collect();
    let cases: [(StoredOutcome, Vec<u8>); 4] = [
        (StoredOutcome::FinalError, b"\"declined\"".to_vec()),
        (StoredOutcome::Unstored, b"{}".to_vec()),
        (StoredOutcome::Success, Vec::new()),
        (StoredOutcome::Success, big),
    ];
    for (outcome, payload) in cases {
        let key = fresh_key("outcomes");
        let token = Token::random();
        acquire(&s, &key, token).await;
        let completion = Completion {
            outcome,
            payload: &payload,
            ttl: s.ttl(),
        };
        assert!(s.store.complete(&key, token, completion).await.unwrap());
        let stored = replayed(&s, &key).await;
        assert_eq!(stored.outcome, outcome);
        assert_eq!(
            stored.payload,
            payload,
            "payload of {} bytes",
            payload.len()
        );
    }
}

/// Release frees the key at once; the fence keeps growing.
pub async fn release_frees_the_key(s: Subject) {
    let key = fresh_key("release");
    let token = Token::random();
    let first = acquire(&s, &key, token).await;
    assert!(s.store.release(&key, token).await.unwrap());
    assert!(
        s.store.inspect(&key).await.unwrap().is_none(),
        "a released record is not live"
    );
    let second = acquire(&s, &key, Token::random()).await;
    assert!(second > first, "fence went from {first} to {second}");
}

/// A fresh key's first owner has fence 1, and each owner after it (a
/// takeover of a run-out lease) one more: the fence counts the owners, which
/// the Kafka consumer's delivery count rests on.
pub async fn each_new_owner_raises_the_fence_by_one(s: Subject) {
    let key = fresh_key("fence-count");
    for owner in 1..=4u64 {
        let claim = s
            .store
            .claim(s.request(&key, Token::random(), None))
            .await
            .unwrap();
        let Claim::Acquired { fence, .. } = claim else {
            panic!("owner {owner}: expected to acquire, got {claim:?}");
        };
        assert_eq!(fence, owner, "owner {owner}");
        s.advance(4).await; // past the 3-unit lease
    }
}

/// A claim whose lease ran out is taken over with a higher fence; the stale
/// owner can then neither complete, release nor renew.
pub async fn expired_lease_is_taken_over_and_fenced(s: Subject) {
    let key = fresh_key("takeover");
    let stale = Token::random();
    let first = acquire(&s, &key, stale).await;
    s.advance(4).await; // past the 3-unit lease
    let fresh = Token::random();
    let claim = s.store.claim(s.request(&key, fresh, None)).await.unwrap();
    let Claim::Acquired { fence, takeover } = claim else {
        panic!("expected a takeover, got {claim:?}");
    };
    assert!(takeover, "the claim took over a PROCESSING record");
    assert!(fence > first);

    assert!(
        !s.store
            .complete(&key, stale, success(b"stale", s.ttl()))
            .await
            .unwrap()
    );
    assert!(!s.store.release(&key, stale).await.unwrap());
    assert!(!s.store.renew(&key, stale, s.lease()).await.unwrap());
    let info = s.store.inspect(&key).await.unwrap().expect("record exists");
    assert_eq!(
        info.state,
        RecordState::Processing,
        "the stale owner changed nothing"
    );

    assert!(
        s.store
            .complete(&key, fresh, success(b"fresh", s.ttl()))
            .await
            .unwrap()
    );
    assert!(
        !s.store
            .complete(&key, stale, success(b"stale", s.ttl()))
            .await
            .unwrap()
    );
    let stored = replayed(&s, &key).await;
    assert_eq!(stored.payload, b"fresh");
}

/// Renewing keeps a live owner's claim from being taken over.
pub async fn renewal_extends_the_lease(s: Subject) {
    let key = fresh_key("renew");
    let token = Token::random();
    acquire(&s, &key, token).await;
    s.advance(2).await;
    assert!(s.store.renew(&key, token, s.lease()).await.unwrap());
    s.advance(2).await; // 4 units since the claim, 2 since the renewal
    let claim = claim_as_newcomer(&s, &key).await;
    assert!(
        matches!(claim, Claim::Busy { .. }),
        "renewed claim was taken: {claim:?}"
    );
}

/// A body that runs longer than its ttl and keeps heartbeating is never taken
/// over: renewing keeps the record alive (its expiry at least as far as the
/// lease), so a newcomer stays busy and the record stays visible.
pub async fn renew_keeps_a_live_claim_past_its_ttl(s: Subject) {
    let key = fresh_key("renew-past-ttl");
    let token = Token::random();
    // The shortest ttl the protocol allows: no shorter than the lease.
    let request = ClaimRequest {
        ttl: s.lease(),
        ..s.request(&key, token, None)
    };
    let claim = s.store.claim(request).await.expect("claim");
    assert!(matches!(claim, Claim::Acquired { .. }), "{claim:?}");
    // Heartbeat every unit (a third of the lease) for three ttls.
    for beat in 1..=9 {
        s.advance(1).await;
        assert!(
            s.store.renew(&key, token, s.lease()).await.unwrap(),
            "renewal {beat} ({beat} units after the claim, ttl 3 units) was refused"
        );
    }
    let newcomer = claim_as_newcomer(&s, &key).await;
    assert!(
        matches!(newcomer, Claim::Busy { .. }),
        "a live, renewed claim was taken past its ttl: {newcomer:?}"
    );
    let info = s.store.inspect(&key).await.unwrap();
    assert_eq!(
        info.map(|i| i.state),
        Some(RecordState::Processing),
        "the renewed record is not live"
    );
    // It is still the owner's: it completes, and that result replays.
    assert!(
        s.store
            .complete(&key, token, success(b"long", s.ttl()))
            .await
            .unwrap()
    );
    assert_eq!(replayed(&s, &key).await.payload, b"long");
}

/// A completed or released record cannot be completed, released or renewed
/// again by its old owner.
pub async fn finished_records_have_no_owner(s: Subject) {
    let key = fresh_key("no-owner");
    let token = Token::random();
    acquire(&s, &key, token).await;
    assert!(
        s.store
            .complete(&key, token, success(b"1", s.ttl()))
            .await
            .unwrap()
    );
    // The same token completing again is a completion re-sent after a dropped
    // connection: it is the success it was (not a lost claim, which would be
    // counted as fenced), and it changes nothing (checked below).
    assert!(
        s.store
            .complete(&key, token, success(b"2", s.ttl()))
            .await
            .unwrap(),
        "a re-sent completion under the completing token is a success"
    );
    // Another token never completes a finished record.
    assert!(
        !s.store
            .complete(&key, Token::random(), success(b"3", s.ttl()))
            .await
            .unwrap()
    );
    assert!(!s.store.release(&key, token).await.unwrap());
    assert!(!s.store.renew(&key, token, s.lease()).await.unwrap());
    let stored = replayed(&s, &key).await;
    assert_eq!(stored.payload, b"1");
}

/// A DONE record lives for its ttl, counted from completion, and then the key
/// is free again.
pub async fn done_record_expires_after_ttl(s: Subject) {
    let key = fresh_key("expiry");
    let token = Token::random();
    acquire(&s, &key, token).await;
    let ttl = s.unit() * 6;
    assert!(
        s.store
            .complete(&key, token, success(b"x", ttl))
            .await
            .unwrap()
    );
    s.advance(4).await;
    assert!(matches!(claim_as_newcomer(&s, &key).await, Claim::Done(_)));
    s.advance(3).await;
    assert!(
        s.store.inspect(&key).await.unwrap().is_none(),
        "expired record is not live"
    );
    let claim = claim_as_newcomer(&s, &key).await;
    let Claim::Acquired { takeover, .. } = claim else {
        panic!("expected a fresh claim, got {claim:?}");
    };
    assert!(!takeover, "an expired DONE record is not a takeover");
}

/// Evict removes a record whatever its state; inspect of an unknown key is None.
pub async fn evict_removes_a_record(s: Subject) {
    let key = fresh_key("evict");
    assert!(s.store.inspect(&key).await.unwrap().is_none());
    assert!(!s.store.evict(&key).await.unwrap());
    let token = Token::random();
    acquire(&s, &key, token).await;
    assert!(
        s.store
            .complete(&key, token, success(b"x", s.ttl()))
            .await
            .unwrap()
    );
    assert!(s.store.evict(&key).await.unwrap());
    assert!(s.store.inspect(&key).await.unwrap().is_none());
    acquire(&s, &key, Token::random()).await;
}

/// An operator's evict of a live claim never hands its fence out twice: the
/// owner, still running, can neither complete, renew nor release, and the next
/// claim (even after a purge) gets a higher fence than the owner holds.
pub async fn evict_of_a_live_claim_keeps_fences_growing(s: Subject) {
    let key = fresh_key("evict-live");
    let owner = Token::random();
    let first = acquire(&s, &key, owner).await;
    assert!(s.store.evict(&key).await.unwrap());
    assert!(
        !s.store.renew(&key, owner, s.ttl()).await.unwrap(),
        "the evicted owner renews nothing"
    );
    assert!(
        !s.store
            .complete(&key, owner, success(b"late", s.ttl()))
            .await
            .unwrap(),
        "the evicted owner completes nothing"
    );
    assert!(!s.store.release(&key, owner).await.unwrap());
    s.store.purge_expired(10_000).await.unwrap();
    let next = acquire(&s, &key, Token::random()).await;
    assert!(
        next > first,
        "the next owner's fence {next} must be above the evicted owner's {first}"
    );
}

/// Purging deletes expired and released records and keeps live ones.
pub async fn purge_removes_only_dead_records(s: Subject) {
    let live = fresh_key("purge-live");
    let dead = fresh_key("purge-dead");
    let released = fresh_key("purge-released");
    let (t1, t2, t3) = (Token::random(), Token::random(), Token::random());
    acquire(&s, &dead, t1).await;
    assert!(
        s.store
            .complete(&dead, t1, success(b"d", s.unit()))
            .await
            .unwrap()
    );
    acquire(&s, &released, t3).await;
    assert!(s.store.release(&released, t3).await.unwrap());
    s.advance(2).await;
    acquire(&s, &live, t2).await;
    // Long-lived: purging a big shared keyspace (Redis walks it with SCAN) may
    // take longer than the cases' usual ttl, and this record must outlive it.
    assert!(
        s.store
            .complete(&live, t2, success(b"l", s.unit() * 3600))
            .await
            .unwrap()
    );
    let mut purged = 0;
    loop {
        let n = s.store.purge_expired(1000).await.unwrap();
        purged += n;
        if n == 0 {
            break;
        }
    }
    // The expired record is gone either way (checked below); a backend that
    // deletes expired records itself has already done so, and purging finds
    // only the released one.
    let at_least = if s.expires_itself { 1 } else { 2 };
    assert!(purged >= at_least, "purged {purged}");
    assert!(
        s.store.inspect(&live).await.unwrap().is_some(),
        "a live record was purged"
    );
    assert!(
        !s.store.evict(&dead).await.unwrap(),
        "the expired record is gone"
    );
    assert!(
        !s.store.evict(&released).await.unwrap(),
        "the released record is gone"
    );
}

/// 256 concurrent calls with one key through the protocol: the body runs
/// exactly once; every caller gets its result or `InProgress`, nothing else.
pub async fn storm_runs_the_body_once(s: Subject) {
    storm(s, None).await;
}

/// The same storm with `wait`: every caller gets the one result.
pub async fn storm_with_wait_replays_to_all(s: Subject) {
    storm(s, Some(Duration::from_secs(30))).await;
}

async fn storm(s: Subject, wait: Option<Duration>) {
    const CALLERS: usize = 256;
    let scope: &'static str = "idem-conformance::storm";
    let spec = Spec::new(scope, Kind::Call)
        .ttl(Duration::from_secs(3600))
        // Long enough that no caller ever sees the lease run out mid-storm.
        .lease(Duration::from_secs(60));
    let spec = match wait {
        Some(wait) => spec.wait(wait),
        None => spec,
    };
    let key = fresh_key("storm");
    let runs = Arc::new(AtomicUsize::new(0));
    let gate = Arc::new(tokio::sync::Barrier::new(CALLERS));
    let mut tasks = Vec::with_capacity(CALLERS);
    for _ in 0..CALLERS {
        let (store, runs, gate) = (s.store.clone(), runs.clone(), gate.clone());
        tasks.push(tokio::spawn(async move {
            gate.wait().await;
            execute::<u64, _, Error, _>(&spec, Some(store), key, None, async {
                runs.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(50)).await;
                Ok(4242)
            })
            .await
        }));
    }
    let (mut ok, mut in_progress) = (0, 0);
    for t in tasks {
        match t.await.expect("caller panicked") {
            Ok(v) => {
                assert_eq!(v, 4242);
                ok += 1;
            }
            Err(Error::InProgress { .. }) if wait.is_none() => in_progress += 1,
            Err(e) => panic!("unexpected error in the storm: {e}"),
        }
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the body ran more than once"
    );
    assert_eq!(ok + in_progress, CALLERS);
    assert!(ok >= 1);
    if wait.is_some() {
        assert_eq!(ok, CALLERS, "with wait every caller gets the result");
    }
    // Afterwards everyone replays.
    let again: Result<u64, Error> =
        execute(&spec, Some(s.store.clone()), key, None, async { Ok(0) }).await;
    assert_eq!(again.unwrap(), 4242);
}

/// `Duration::MAX` as lease and ttl: every store clamps it to a "forever" of
/// its own, never wraps it into the past or refuses it. The claim holds, a
/// newcomer is Busy for a very long time, renewal and completion succeed, and
/// the record replays and stays.
pub async fn absurd_durations_are_clamped(s: Subject) {
    const CENTURY: Duration = Duration::from_secs(100 * 365 * 86_400);
    let key = fresh_key("absurd-durations");
    let token = Token::random();
    let forever = |token| ClaimRequest {
        key: &key,
        token,
        fingerprint: None,
        lease: Duration::MAX,
        ttl: Duration::MAX,
    };
    let claimed = s.store.claim(forever(token)).await.expect("claim");
    assert!(matches!(claimed, Claim::Acquired { .. }), "{claimed:?}");
    match s
        .store
        .claim(forever(Token::random()))
        .await
        .expect("claim")
    {
        Claim::Busy {
            lease_remaining, ..
        } => assert!(lease_remaining > CENTURY, "{lease_remaining:?}"),
        other => panic!("expected Busy, got {other:?}"),
    }
    assert!(
        s.store
            .renew(&key, token, Duration::MAX)
            .await
            .expect("renew")
    );
    assert!(
        s.store
            .complete(&key, token, success(b"forever", Duration::MAX))
            .await
            .expect("complete")
    );
    assert_eq!(replayed(&s, &key).await.payload, b"forever");
    let info = s.store.inspect(&key).await.expect("inspect").expect("live");
    let century_ms = i64::try_from(CENTURY.as_millis()).expect("a century in ms");
    let now = idem_runtime::SystemClock.now_millis();
    assert!(
        info.expires_at_millis > now.saturating_add(century_ms),
        "{info:?}"
    );
}

/// A scope no other case or run shares, for the recovery cases.
fn fresh_scope(case: &str) -> String {
    format!("idem-conformance.{case}.{}", rand_u64())
}

fn turn(fence: u64, s: &Subject, max_attempts: u32) -> RecoveryTurn<'static> {
    RecoveryTurn {
        fence,
        retry_in: s.unit() * 5,
        max_attempts,
        note: "gave up",
        park_now: false,
    }
}

/// A recoverable claim stores its scope and arguments with the claim; it is
/// abandoned only once its lease runs out (a live claim is never listed),
/// and only while it is PROCESSING: completion forgets it.
pub async fn recoverable_claim_is_abandoned_after_its_lease(s: Subject) {
    let scope = fresh_scope("abandoned");
    let key = fresh_key("abandoned");
    let plain = fresh_key("abandoned-plain");
    let token = Token::random();
    let args = RecoveryArgs {
        scope: &scope,
        args: b"sealed\x00args",
    };
    let claim = s
        .store
        .claim_recoverable(s.request(&key, token, None), args)
        .await
        .unwrap();
    let Claim::Acquired { fence, .. } = claim else {
        panic!("expected to acquire, got {claim:?}");
    };
    acquire(&s, &plain, Token::random()).await;
    assert!(s.store.recovery_scopes().await.unwrap().contains(&scope));
    assert!(
        s.store.abandoned(&scope, 10).await.unwrap().is_empty(),
        "a live claim is not abandoned"
    );
    let info = s.store.recovery_info(&key).await.unwrap().expect("stored");
    assert_eq!(
        (info.scope.as_str(), info.attempts, info.parked),
        (scope.as_str(), 0, None)
    );
    assert_eq!(info.args_bytes, 11);
    assert_eq!(s.store.recovery_info(&plain).await.unwrap(), None);

    s.advance(4).await; // past the 3-unit lease
    let found = s.store.abandoned(&scope, 10).await.unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!((found[0].key, found[0].fence), (key, fence));
    assert_eq!(found[0].args, b"sealed\x00args");
    assert_eq!(found[0].attempts, 0);
    assert!(
        s.store
            .abandoned(&fresh_scope("other"), 10)
            .await
            .unwrap()
            .is_empty()
    );

    // The owner was only slow: it completes, and nothing is left to recover.
    assert!(
        s.store
            .complete(&key, token, success(b"ok", s.ttl()))
            .await
            .unwrap()
    );
    assert!(s.store.abandoned(&scope, 10).await.unwrap().is_empty());
    assert_eq!(s.store.recovery_info(&key).await.unwrap(), None);
}

/// Turns at an abandoned claim: one at a time (a second at the same fence
/// waits out the backoff), counted, parked past the limit or at once, and
/// an operator's retry clears the count and the parking.
pub async fn recovery_turns_are_counted_spaced_and_parked(s: Subject) {
    let scope = fresh_scope("turns");
    let key = fresh_key("turns");
    let args = RecoveryArgs {
        scope: &scope,
        args: b"a",
    };
    let claim = s
        .store
        .claim_recoverable(s.request(&key, Token::random(), None), args)
        .await
        .unwrap();
    let Claim::Acquired { fence, .. } = claim else {
        panic!("expected to acquire, got {claim:?}");
    };
    assert_eq!(
        s.store
            .take_recovery(&key, turn(fence, &s, 2))
            .await
            .unwrap(),
        Turn::Gone,
        "a live claim gives no turn"
    );
    s.advance(4).await;
    assert_eq!(
        s.store
            .take_recovery(&key, turn(fence + 1, &s, 2))
            .await
            .unwrap(),
        Turn::Gone,
        "another fence gives no turn"
    );
    assert_eq!(
        s.store
            .take_recovery(&key, turn(fence, &s, 2))
            .await
            .unwrap(),
        Turn::Run { attempt: 1 }
    );
    assert_eq!(
        s.store
            .take_recovery(&key, turn(fence, &s, 2))
            .await
            .unwrap(),
        Turn::Gone,
        "a second turn waits out the backoff"
    );
    assert!(s.store.abandoned(&scope, 10).await.unwrap().is_empty());
    s.advance(6).await;
    assert_eq!(s.store.abandoned(&scope, 10).await.unwrap()[0].attempts, 1);
    assert_eq!(
        s.store
            .take_recovery(&key, turn(fence, &s, 2))
            .await
            .unwrap(),
        Turn::Run { attempt: 2 }
    );
    s.advance(6).await;
    assert_eq!(
        s.store
            .take_recovery(&key, turn(fence, &s, 2))
            .await
            .unwrap(),
        Turn::Parked { attempts: 2 }
    );
    let info = s.store.recovery_info(&key).await.unwrap().expect("stored");
    assert_eq!(info.parked.as_deref(), Some("gave up"));
    assert!(
        s.store.abandoned(&scope, 10).await.unwrap().is_empty(),
        "parked"
    );
    assert_eq!(
        s.store
            .take_recovery(&key, turn(fence, &s, 9))
            .await
            .unwrap(),
        Turn::Gone
    );

    assert!(s.store.retry_recovery(&key).await.unwrap());
    let info = s.store.recovery_info(&key).await.unwrap().expect("stored");
    assert_eq!((info.attempts, info.parked), (0, None));
    assert_eq!(s.store.abandoned(&scope, 10).await.unwrap().len(), 1);
    let now = RecoveryTurn {
        park_now: true,
        note: "arguments unusable",
        ..turn(fence, &s, 9)
    };
    assert_eq!(
        s.store.take_recovery(&key, now).await.unwrap(),
        Turn::Parked { attempts: 0 }
    );
    assert!(
        !s.store
            .retry_recovery(&fresh_key("turns-absent"))
            .await
            .unwrap()
    );
}

/// A takeover continues the abandoned call: its count stays, and turns at
/// the old fence are refused. A release forgets the arguments.
pub async fn takeover_keeps_the_recovery_count_and_release_forgets(s: Subject) {
    let scope = fresh_scope("takeover");
    let key = fresh_key("recovery-takeover");
    let args = RecoveryArgs {
        scope: &scope,
        args: b"a",
    };
    let Claim::Acquired { fence, .. } = s
        .store
        .claim_recoverable(s.request(&key, Token::random(), None), args)
        .await
        .unwrap()
    else {
        panic!("expected to acquire");
    };
    s.advance(4).await;
    assert_eq!(
        s.store
            .take_recovery(&key, turn(fence, &s, 5))
            .await
            .unwrap(),
        Turn::Run { attempt: 1 }
    );
    let worker = Token::random();
    let claim = s
        .store
        .claim_recoverable(s.request(&key, worker, None), args)
        .await
        .unwrap();
    assert!(
        matches!(claim, Claim::Acquired { takeover: true, fence: f } if f > fence),
        "{claim:?}"
    );
    assert_eq!(
        s.store.recovery_info(&key).await.unwrap().unwrap().attempts,
        1
    );
    s.advance(10).await;
    assert_eq!(
        s.store
            .take_recovery(&key, turn(fence, &s, 5))
            .await
            .unwrap(),
        Turn::Gone,
        "the old fence is gone"
    );
    assert_eq!(s.store.abandoned(&scope, 10).await.unwrap()[0].attempts, 1);
    // Taken over again, then released (a caller's retryable error): forgotten.
    let fresh = Token::random();
    let _ = s
        .store
        .claim_recoverable(s.request(&key, fresh, None), args)
        .await
        .unwrap();
    assert!(s.store.release(&key, fresh).await.unwrap());
    assert_eq!(s.store.recovery_info(&key).await.unwrap(), None);
    assert!(s.store.abandoned(&scope, 10).await.unwrap().is_empty());
}

static TABLE: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// Holds the store's shared table for one case. Cases on a server share one
/// table, and purging deletes every dead record in it, including a record
/// another case has just released and is about to claim again (which would
/// reset the fence that case checks). So the purge case runs alone and every
/// other case runs beside the others.
pub async fn share_table(case: &str) -> TableGuard {
    if case == "purge_removes_only_dead_records" {
        TableGuard::Alone(TABLE.write().await)
    } else {
        TableGuard::Shared(TABLE.read().await)
    }
}

/// See [`share_table`].
pub enum TableGuard {
    /// The purge case.
    Alone(#[allow(dead_code)] tokio::sync::RwLockWriteGuard<'static, ()>),
    /// Every other case.
    Shared(#[allow(dead_code)] tokio::sync::RwLockReadGuard<'static, ()>),
}

/// What a suite's factory may return: a subject, or `None` when its server is
/// unreachable (see [`crate::services::reachable`]).
pub trait IntoSubject {
    /// The subject, if there is one.
    fn into_subject(self) -> Option<Subject>;
}

impl IntoSubject for Subject {
    fn into_subject(self) -> Option<Subject> {
        Some(self)
    }
}

impl IntoSubject for Option<Subject> {
    fn into_subject(self) -> Option<Subject> {
        self
    }
}

/// Generates one `#[tokio::test]` per conformance case for a backend. The
/// factory is an async expression giving a [`Subject`] or an
/// `Option<Subject>`.
///
/// ```
/// use idem_runtime::store::memory::MemoryStore;
/// use idem_runtime::ManualClock;
/// use idem_runtime::store::StoreRef;
/// use idem_tests::conformance::Subject;
///
/// idem_tests::conformance_suite!(memory, async {
///     let clock = ManualClock::default();
///     Subject::manual(StoreRef::new(MemoryStore::builder().clock(clock.clone()).build()), clock)
/// });
/// # fn main() {}
/// ```
#[macro_export]
macro_rules! conformance_suite {
    ($name:ident, $subject:expr) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            $crate::conformance_suite!(@cases $subject;
                absent_key_is_acquired,
                live_claim_is_busy,
                same_token_reclaims,
                completed_record_replays,
                outcomes_and_payloads_round_trip,
                release_frees_the_key,
                expired_lease_is_taken_over_and_fenced,
                each_new_owner_raises_the_fence_by_one,
                renewal_extends_the_lease,
                renew_keeps_a_live_claim_past_its_ttl,
                finished_records_have_no_owner,
                done_record_expires_after_ttl,
                evict_removes_a_record,
                evict_of_a_live_claim_keeps_fences_growing,
                purge_removes_only_dead_records,
                storm_runs_the_body_once,
                storm_with_wait_replays_to_all,
                absurd_durations_are_clamped,
                recoverable_claim_is_abandoned_after_its_lease,
                recovery_turns_are_counted_spaced_and_parked,
                takeover_keeps_the_recovery_count_and_release_forgets,
            );
        }
    };
    (@cases $subject:expr; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $case() {
                // `None`: the server is unreachable and the services helper has
                // already said so (or panicked, with IDEM_REQUIRE_SERVICES=1).
                let subject: ::core::option::Option<$crate::conformance::Subject> =
                    $crate::conformance::IntoSubject::into_subject($subject.await);
                if let ::core::option::Option::Some(subject) = subject {
                    let _table = $crate::conformance::share_table(stringify!($case)).await;
                    $crate::conformance::$case(subject).await;
                }
            }
        )*
    };
}
