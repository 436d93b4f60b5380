use idem_runtime::idempotent;
use idem_runtime::recovery::Recovery;

#[derive(Debug)]
pub struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

// No `recover`: nothing is stored for a worker, so there is nothing to register.
#[idempotent(scope = "orders.create", key = "order_no")]
async fn create_order(order_no: String) -> Result<u64, AppError> {
    Ok(order_no.len() as u64)
}

fn main() {
    let _ = Recovery::new().register(idem_runtime::recoverable!(create_order));
}
