//! Shared test support for idem: the store conformance suite, which every
//! backend runs unchanged.

pub mod conformance;
pub mod consumer;
pub mod proxy;
pub mod services;
pub mod sql;
pub mod statements;
