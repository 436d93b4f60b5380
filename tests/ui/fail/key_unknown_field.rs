use idem_runtime::idempotent;

#[derive(Debug)]
struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

pub struct Buy {
    pub user_id: u64,
}

#[idempotent(key = "req.usr_id")]
async fn buy(req: Buy) -> Result<u64, AppError> {
    Ok(req.user_id)
}

fn main() {}
