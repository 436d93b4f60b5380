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
}

#[idempotent(key = "req.order_id", fingerprint = "req.amount|currency")]
async fn charge(req: Charge) -> Result<u64, AppError> {
    Ok(req.order_id + req.amount)
}

fn main() {}
