use idem_runtime::idempotent;

#[derive(Debug)]
struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

#[idempotent(consumer, event = "", key = "order_id")]
async fn on_paid(order_id: u64) -> Result<(), AppError> {
    let _ = order_id;
    Ok(())
}

fn main() {}
