use idem_runtime::idempotent;
use idem_runtime::recovery::Recovery;

#[derive(Debug)]
pub struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

#[derive(Clone)]
pub struct Orders;

impl Orders {
    #[idempotent(scope = "orders.create", key = "order_no", recover)]
    async fn create(&self, order_no: String) -> Result<u64, AppError> {
        Ok(order_no.len() as u64)
    }
}

fn main() {
    // The service the worker calls `create` on is missing.
    let _ = Recovery::new().register(idem_runtime::recoverable!(Orders::create));
}
