//! Gives the facade's own examples and tests an rpath to libtorch, and re-exports the
//! libtorch lib dir to dependents as `DEP_TORCHTOOLS_LIBTORCH_LIB` (`links = "torchtools"`).
fn main() {
    if std::env::var_os("CARGO_FEATURE_TCH").is_none() {
        return;
    }
    if let Some(lib) = tt_sys::build::link_libtorch_rpath() {
        println!("cargo:libtorch_lib={}", lib.dir.display());
    }
}
