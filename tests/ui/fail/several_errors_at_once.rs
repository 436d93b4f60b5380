use idem_runtime::idempotent;

#[derive(Debug)]
struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

pub struct CreateOrder {
    pub user_id: u64,
    pub created_at: u64,
}

#[idempotent(key = "req.user_id|req.created_at", tll = "24h", event = "ORDER")]
async fn create_order(req: CreateOrder) -> Result<u64, AppError> {
    Ok(req.user_id + req.created_at)
}

fn main() {}
