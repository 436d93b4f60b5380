//! Names that mention retries or deliveries without counting them are fine:
//! a delivery address, a delivery note number, the sku that was attempted, the
//! id of a retry policy, a retry limit, and a parameter that is a delivery
//! (whose fields are judged, not its name).
use idem_runtime::idempotent;

#[derive(Debug)]
pub struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

pub struct Ship {
    pub delivery_address: String,
    pub delivery_no: String,
    pub attempted_sku: u64,
    pub retry_policy_id: u64,
    pub max_retries: u32,
}

#[idempotent(
    key = "req.delivery_address|req.delivery_no|req.attempted_sku|req.retry_policy_id",
    fingerprint = "req.max_retries"
)]
pub async fn ship(req: Ship) -> Result<u64, AppError> {
    Ok(req.attempted_sku + req.retry_policy_id + u64::from(req.max_retries))
}

pub struct Delivery {
    pub order_id: u64,
}

#[idempotent(key = "delivery.order_id")]
pub async fn deliver(delivery: Delivery) -> Result<u64, AppError> {
    Ok(delivery.order_id)
}

fn main() {}
