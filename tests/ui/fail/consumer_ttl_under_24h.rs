use idem_runtime::idempotent;

#[derive(Debug)]
struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

pub struct OrderPaid {
    pub order_id: u64,
}

#[idempotent(consumer, event = "SETTLE", key = "e.order_id", ttl = "6h")]
async fn on_order_paid(e: OrderPaid) -> Result<(), AppError> {
    let _ = e.order_id;
    Ok(())
}

fn main() {}
