//! redis store tests: being written (issue 3).
