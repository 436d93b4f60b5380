use idem_runtime::idempotent;

#[derive(Debug)]
struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

pub struct Charge {
    pub order_id: u64,
    pub amount: u64,
    pub delivery_attempt: u32,
}

// In the fingerprint a counter turns every redelivery into a key reuse.
#[idempotent(scope = "charge", consumer, key = "e.order_id", fingerprint = "e.amount|e.delivery_attempt")]
async fn charge(e: Charge) -> Result<u64, AppError> {
    Ok(e.order_id + e.amount + u64::from(e.delivery_attempt))
}

fn main() {}
