//! With `final_err` returning `Option<S>`, only the final errors' stored form
//! `S` is serde: the error type wraps errors that are not.

use idem_runtime::idempotent;

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Declined {
    pub reason: String,
}

#[derive(Debug)]
pub enum PayError {
    Declined(Declined),
    Idem(idem_runtime::Error),
    Io(std::io::Error),
}

impl From<idem_runtime::Error> for PayError {
    fn from(e: idem_runtime::Error) -> Self {
        PayError::Idem(e)
    }
}

impl From<Declined> for PayError {
    fn from(d: Declined) -> Self {
        PayError::Declined(d)
    }
}

impl PayError {
    fn declined(&self) -> Option<Declined> {
        match self {
            PayError::Declined(d) => Some(d.clone()),
            _ => None,
        }
    }
}

#[idempotent(key = "card", final_err = PayError::declined)]
async fn pay(card: String) -> Result<u64, PayError> {
    Err(PayError::Declined(Declined { reason: card }))
}

// A closure, and a `Result` alias.
type PayResult<T> = Result<T, PayError>;

#[idempotent(key = "card", final_err = |e: &PayError| e.declined())]
async fn pay_again(card: String) -> PayResult<u64> {
    Err(PayError::Io(std::io::Error::other(card)))
}

fn main() {
    drop(pay("card-1".into()));
    drop(pay_again("card-1".into()));
}
