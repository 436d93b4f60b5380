//! Serializable but not deserializable: it could be stored, never replayed.
use idem_runtime::idempotent;

#[derive(Debug)]
struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

#[derive(serde::Serialize)]
pub struct Receipt {
    pub id: u64,
}

#[idempotent(key = "order_id")]
async fn pay(order_id: u64) -> Result<Receipt, AppError> {
    Ok(Receipt { id: order_id })
}

fn main() {}
