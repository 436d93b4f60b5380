//! MySQL / MariaDB store: being written (issue 3).
