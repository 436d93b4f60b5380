//! With `final_err`, an error that derives both serde traits is stored.
use idem_runtime::idempotent;

#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub enum PayError {
    Declined,
    #[serde(skip)]
    Idem(String),
}

impl From<idem_runtime::Error> for PayError {
    fn from(e: idem_runtime::Error) -> Self {
        PayError::Idem(e.to_string())
    }
}

impl PayError {
    pub fn is_final(&self) -> bool {
        matches!(self, PayError::Declined)
    }
}

#[idempotent(key = "card|amount", final_err = PayError::is_final)]
pub async fn charge(card: String, amount: u64) -> Result<u64, PayError> {
    Ok(card.len() as u64 + amount)
}

fn main() {}
