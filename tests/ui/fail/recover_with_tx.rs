use idem_runtime::idempotent;

#[derive(Debug)]
pub struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

#[idempotent(key = "order_no", tx = tx, recover)]
async fn create_order(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    order_no: String,
) -> Result<u64, AppError> {
    let _ = tx;
    Ok(order_no.len() as u64)
}

fn main() {}
