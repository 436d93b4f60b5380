//! What [`RabbitMqSource::declare`](super::RabbitMqSource::declare) sets up
//! for a queue `q`: `q`, dead-lettering to the fanout exchange `q.dlx`;
//! `q.retry`, consumed by no one, dead-lettering back to `q` when a copy's
//! TTL runs out; `q.parked`, bound to `q.dlx`. And the names it derives,
//! held to AMQP's 255-byte short strings.

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, ExchangeKind};

use super::broker;
use crate::consumer::BrokerError;

/// The longest AMQP short string, which a queue's and an exchange's name is.
const SHORT_STRING_BYTES: usize = 255;

pub(super) struct Names {
    pub(super) queue: String,
    pub(super) retry: String,
    pub(super) parked: String,
    pub(super) dlx: String,
}

impl Names {
    /// The names `declare` derives from `queue`; an error naming it when the
    /// longest (`.parked`) would not be a short string: lapin would write it
    /// with a wrong length, and the broker close the connection on the
    /// corrupt frame.
    pub(super) fn of(queue: &str) -> Result<Names, BrokerError> {
        let parked = format!("{queue}.parked");
        if parked.len() > SHORT_STRING_BYTES {
            return Err(BrokerError::new(
                "rabbitmq",
                format!(
                    "the queue name `{queue}` is {} bytes: `<queue>.parked` would be {}, over \
                     AMQP's {SHORT_STRING_BYTES} (a queue name may have at most {})",
                    queue.len(),
                    parked.len(),
                    SHORT_STRING_BYTES - ".parked".len()
                ),
            ));
        }
        Ok(Names {
            queue: queue.to_owned(),
            retry: format!("{queue}.retry"),
            parked,
            dlx: format!("{queue}.dlx"),
        })
    }
}

/// Declares the queues and the exchange (see the module's doc).
pub(super) async fn declare(channel: &Channel, queue: &str) -> Result<(), BrokerError> {
    let n = Names::of(queue)?;
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .exchange_declare(
            &n.dlx,
            ExchangeKind::Fanout,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(broker)?;
    let parked = &n.parked;
    channel
        .queue_declare(parked, durable, FieldTable::default())
        .await
        .map_err(broker)?;
    channel
        .queue_bind(
            parked,
            &n.dlx,
            "",
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(broker)?;
    let mut main = FieldTable::default();
    main.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString(n.dlx.as_str().into()),
    );
    channel
        .queue_declare(&n.queue, durable, main)
        .await
        .map_err(broker)?;
    let mut retry = FieldTable::default();
    retry.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString("".into()),
    );
    retry.insert(
        "x-dead-letter-routing-key".into(),
        AMQPValue::LongString(n.queue.as_str().into()),
    );
    channel
        .queue_declare(&n.retry, durable, retry)
        .await
        .map_err(broker)?;
    Ok(())
}
