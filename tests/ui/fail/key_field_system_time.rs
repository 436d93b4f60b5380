use idem_runtime::idempotent;
use std::time::SystemTime;

#[derive(Debug)]
struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

pub struct Booking {
    pub room: u64,
    pub when: SystemTime,
}

#[idempotent(key = "req.room|req.when")]
async fn book(req: Booking) -> Result<u64, AppError> {
    Ok(req.room)
}

fn main() {}
