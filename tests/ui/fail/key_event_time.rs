use idem_runtime::idempotent;

#[derive(Debug)]
struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

struct Reading {
    meter_id: u64,
    event_time: u64,
}

#[idempotent(key = "r.meter_id|r.event_time")]
async fn record(r: Reading) -> Result<u64, AppError> {
    Ok(r.meter_id + r.event_time)
}

fn main() {}
