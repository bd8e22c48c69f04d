//! Gives this crate's tests an rpath to libtorch when the `tch` feature is on.
fn main() {
    if std::env::var_os("CARGO_FEATURE_TCH").is_some() {
        tt_sys::build::link_libtorch_rpath();
    }
}
