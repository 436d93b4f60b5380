//! A batch's settlement date is fixed per intent: `allow` exempts it.
use idem_runtime::idempotent;

#[derive(Debug)]
pub struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

pub struct Batch {
    pub merchant_id: u64,
    pub settle_date: String,
}

#[idempotent(key = "batch.merchant_id|batch.settle_date", allow = "settle_date")]
pub async fn settle(batch: Batch) -> Result<u64, AppError> {
    Ok(batch.merchant_id + batch.settle_date.len() as u64)
}

fn main() {}
