use idem_runtime::idempotent;

#[derive(Debug)]
struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

#[idempotent(key = "user_id|seen")]
async fn check_in(user_id: u64, seen: Option<&std::time::Instant>) -> Result<u64, AppError> {
    let _ = seen;
    Ok(user_id)
}

fn main() {}
