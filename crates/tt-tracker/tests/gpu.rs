//! GPU tests.
