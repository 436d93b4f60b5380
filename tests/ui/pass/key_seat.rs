//! `seat` ends in `at`, but is one word, not an `*_at` instant.
use idem_runtime::idempotent;

#[derive(Debug)]
pub struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

pub struct Reserve {
    pub show_id: u64,
    pub seat: String,
}

#[idempotent(key = "req.show_id|req.seat")]
pub async fn reserve(req: Reserve) -> Result<u64, AppError> {
    Ok(req.show_id + req.seat.len() as u64)
}

fn main() {}
