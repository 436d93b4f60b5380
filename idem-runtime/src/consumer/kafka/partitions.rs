//! The partitions this consumer owns, and what each holds: the messages read
//! and not handed out yet, in offset order, and whether its one message in
//! flight is out. Kafka's order is per partition, so a partition hands out
//! its next message only once the one before it was acked or parked; a
//! message to retry goes back to the front and waits there, so nothing
//! after it is committed before it. Partitions run side by side.
//!
//! An assignment is an epoch: a delivery remembers the epoch it was handed
//! out in, and its ack commits only while the partition is still owned in
//! that same epoch (a revoked partition, or one revoked and assigned again,
//! commits nothing for a delivery of the old epoch: its new owner starts from
//! the last commit and idem answers the redelivery).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use rdkafka::Message as _;
use rdkafka::message::OwnedMessage;

/// A topic and a partition.
pub(super) type Tp = (Arc<str>, i32);

/// How many read messages a partition holds before it is paused (the
/// client stops fetching it), and how few before it is resumed.
pub(super) const PAUSE_AT: usize = 1_000;
pub(super) const RESUME_AT: usize = 100;

/// One message waiting in its partition.
pub(super) struct Waiting {
    pub(super) message: OwnedMessage,
    /// It was handed out before in this epoch (and put back).
    pub(super) handed: bool,
}

#[derive(Default)]
struct Part {
    epoch: u64,
    queue: VecDeque<Waiting>,
    /// Its message in flight is out.
    busy: bool,
    /// The front message waits until then (a retry's backoff).
    not_before: Option<Instant>,
    paused: bool,
    /// The highest offset read.
    read: Option<i64>,
}

/// A message handed out: where it came from, in which epoch.
pub(super) struct Out {
    pub(super) tp: Tp,
    pub(super) epoch: u64,
    pub(super) waiting: Waiting,
}

/// What the caller must tell the client after a change.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Flow {
    pub(super) pause: bool,
    pub(super) resume: bool,
}

#[derive(Default)]
pub(super) struct Partitions {
    owned: HashMap<Tp, Part>,
    epochs: u64,
}

impl Partitions {
    /// The partition is this consumer's from now on, in a new epoch.
    pub(super) fn assign(&mut self, tp: Tp) {
        self.epochs += 1;
        let epoch = self.epochs;
        self.owned.insert(
            tp,
            Part {
                epoch,
                ..Part::default()
            },
        );
    }

    /// The partition is another consumer's: what it held is dropped (its new
    /// owner reads it again from the last commit).
    pub(super) fn revoke(&mut self, tp: &Tp) {
        self.owned.remove(tp);
    }

    /// A message read from the client. One of a partition this consumer no
    /// longer owns is dropped. Returns its partition, what to tell the
    /// client, and whether the partition now has a message
    /// ready that it did not have before: only then is there anything new
    /// for a source waiting to hand out (a wake-up per message read while
    /// every partition is busy would wake it for nothing).
    pub(super) fn push(&mut self, message: OwnedMessage) -> (Tp, Flow, bool) {
        let tp: Tp = (Arc::from(message.topic()), message.partition());
        let Some(part) = self.owned.get_mut(&tp) else {
            return (tp, Flow::default(), false);
        };
        // A fetch can repeat what the partition already read (a seek, a
        // resume): keep offsets growing.
        if part.read.is_some_and(|read| message.offset() <= read) {
            return (tp, Flow::default(), false);
        }
        part.read = Some(message.offset());
        part.queue.push_back(Waiting {
            message,
            handed: false,
        });
        let pause = !part.paused && part.queue.len() >= PAUSE_AT;
        part.paused |= pause;
        let ready = !part.busy && part.queue.len() == 1 && part.not_before.is_none();
        (
            tp,
            Flow {
                pause,
                resume: false,
            },
            ready,
        )
    }

    /// The front message of a partition that has nothing in flight and whose
    /// wait is over, if one is ready.
    pub(super) fn take_ready(&mut self, now: Instant) -> Option<(Out, Flow)> {
        let (tp, part) = self.owned.iter_mut().find(|(_, p)| {
            !p.busy && !p.queue.is_empty() && p.not_before.is_none_or(|at| at <= now)
        })?;
        let waiting = part.queue.pop_front()?;
        part.busy = true;
        part.not_before = None;
        let resume = part.paused && part.queue.len() <= RESUME_AT;
        part.paused &= !resume;
        Some((
            Out {
                tp: tp.clone(),
                epoch: part.epoch,
                waiting,
            },
            Flow {
                pause: false,
                resume,
            },
        ))
    }

    /// When a partition's front message falls due, if one waits.
    pub(super) fn next_due(&self) -> Option<Instant> {
        self.owned
            .values()
            .filter(|p| !p.busy && !p.queue.is_empty())
            .filter_map(|p| p.not_before)
            .min()
    }

    /// The message in flight of `tp` (epoch `epoch`) is done: the partition
    /// goes on. Whether it is still owned in that epoch (and so may commit).
    pub(super) fn done(&mut self, tp: &Tp, epoch: u64) -> bool {
        match self.owned.get_mut(tp) {
            Some(part) if part.epoch == epoch => {
                part.busy = false;
                true
            }
            _ => false,
        }
    }

    /// The message in flight goes back to the front of its partition, handed
    /// out again no sooner than `at`.
    pub(super) fn put_back(&mut self, out: Out, at: Instant) {
        let Some(part) = self.owned.get_mut(&out.tp) else {
            return;
        };
        if part.epoch != out.epoch {
            return;
        }
        part.queue.push_front(out.waiting);
        part.busy = false;
        part.not_before = Some(at);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use rdkafka::Timestamp;

    use super::*;

    fn message(partition: i32, offset: i64) -> OwnedMessage {
        OwnedMessage::new(
            Some(b"{}".to_vec()),
            None,
            "orders".to_owned(),
            Timestamp::NotAvailable,
            partition,
            offset,
            None,
        )
    }

    fn tp(partition: i32) -> Tp {
        (Arc::from("orders"), partition)
    }

    #[test]
    fn one_message_in_flight_per_partition_in_offset_order() {
        let mut p = Partitions::default();
        p.assign(tp(0));
        p.assign(tp(1));
        for offset in 0..3 {
            p.push(message(0, offset));
        }
        p.push(message(1, 7));
        let now = Instant::now();
        let (a, _) = p.take_ready(now).unwrap();
        let (b, _) = p.take_ready(now).unwrap();
        assert_ne!(a.tp, b.tp, "two partitions side by side");
        assert!(
            p.take_ready(now).is_none(),
            "partition 0 waits for its first"
        );
        let zero = if a.tp == tp(0) { a } else { b };
        assert_eq!(zero.waiting.message.offset(), 0);
        assert!(p.done(&zero.tp, zero.epoch));
        let (next, _) = p.take_ready(now).unwrap();
        assert_eq!((next.tp.1, next.waiting.message.offset()), (0, 1));
    }

    /// A message read says "ready" only when its partition had nothing to
    /// hand out before: not behind another, not while one is in flight.
    #[test]
    fn a_read_message_is_ready_news_only_for_an_idle_empty_partition() {
        let mut p = Partitions::default();
        p.assign(tp(0));
        assert!(p.push(message(0, 0)).2, "an idle, empty partition");
        assert!(!p.push(message(0, 1)).2, "behind one already ready");
        let (out, _) = p.take_ready(Instant::now()).unwrap();
        assert!(!p.push(message(0, 2)).2, "with one in flight");
        assert!(p.done(&out.tp, out.epoch));
        // Done wakes the source itself; two wait now.
        let (out, _) = p.take_ready(Instant::now()).unwrap();
        assert_eq!(out.waiting.message.offset(), 1);
        p.put_back(out, Instant::now() + std::time::Duration::from_secs(1));
        assert!(!p.push(message(0, 3)).2, "behind a retry's wait");
        assert!(!p.push(message(9, 0)).2, "not this consumer's partition");
    }

    #[test]
    fn a_retried_message_goes_back_to_the_front_and_waits() {
        let mut p = Partitions::default();
        p.assign(tp(0));
        p.push(message(0, 0));
        p.push(message(0, 1));
        let now = Instant::now();
        let (out, _) = p.take_ready(now).unwrap();
        p.put_back(out, now + Duration::from_secs(1));
        assert!(
            p.take_ready(now).is_none(),
            "nothing passes the retried one"
        );
        assert_eq!(p.next_due(), Some(now + Duration::from_secs(1)));
        let (again, _) = p.take_ready(now + Duration::from_secs(1)).unwrap();
        assert_eq!(again.waiting.message.offset(), 0);
    }

    #[test]
    fn a_revoked_partition_commits_nothing_and_drops_what_it_held() {
        let mut p = Partitions::default();
        p.assign(tp(0));
        p.push(message(0, 0));
        p.push(message(0, 1));
        let (out, _) = p.take_ready(Instant::now()).unwrap();
        p.revoke(&tp(0));
        p.assign(tp(0));
        assert!(!p.done(&out.tp, out.epoch), "an old epoch does not commit");
        assert!(
            p.take_ready(Instant::now()).is_none(),
            "its queue was dropped"
        );
        p.push(message(2, 0));
        assert!(p.take_ready(Instant::now()).is_none(), "not ours");
    }

    #[test]
    fn a_full_partition_is_paused_and_resumed_as_it_drains() {
        let mut p = Partitions::default();
        p.assign(tp(0));
        let mut paused = 0;
        for offset in 0..PAUSE_AT as i64 + 5 {
            paused += usize::from(p.push(message(0, offset)).1.pause);
        }
        assert_eq!(paused, 1);
        let mut resumed = 0;
        loop {
            let Some((out, flow)) = p.take_ready(Instant::now()) else {
                break;
            };
            resumed += usize::from(flow.resume);
            assert!(p.done(&out.tp, out.epoch));
        }
        assert_eq!(resumed, 1);
        assert!(
            !p.push(message(0, 0)).1.pause,
            "an offset already past is dropped"
        );
    }
}
