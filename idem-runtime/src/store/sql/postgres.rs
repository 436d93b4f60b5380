//! PostgreSQL store: being written (issue 3).
