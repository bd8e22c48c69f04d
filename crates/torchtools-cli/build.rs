//! The CLI is built on libtorch-free cores, but a workspace-wide build unifies
//! features: tt-device may then come with `tch`, and the binary links libtorch. The
//! rpath lets that binary start too; in other builds it is unused and harmless.
fn main() {
    tt_sys::build::try_link_libtorch_rpath();
}
