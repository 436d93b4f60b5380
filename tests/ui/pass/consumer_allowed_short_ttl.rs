//! A consumer whose broker provably redelivers within the hour may say so.
use idem_runtime::idempotent;

#[derive(Debug)]
pub struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

pub struct OrderPaid {
    pub order_id: u64,
}

#[idempotent(
    consumer,
    event = "SETTLE",
    key = "e.order_id",
    ttl = "1h",
    allow = "ttl"
)]
pub async fn on_order_paid(e: OrderPaid) -> Result<(), AppError> {
    let _ = e.order_id;
    Ok(())
}

fn main() {}
