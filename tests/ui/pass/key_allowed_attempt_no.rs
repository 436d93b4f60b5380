//! A payment attempt number the client assigns once per deliberate attempt (a
//! customer pressing "pay again" after a decline is a new intent) is fixed per
//! intent: `allow` exempts it.
use idem_runtime::idempotent;

#[derive(Debug)]
pub struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

pub struct Pay {
    pub order_id: u64,
    pub attempt_no: u32,
}

#[idempotent(key = "req.order_id|req.attempt_no", allow = "attempt_no")]
pub async fn pay(req: Pay) -> Result<u64, AppError> {
    Ok(req.order_id + u64::from(req.attempt_no))
}

fn main() {}
