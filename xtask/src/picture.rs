//! `cargo xtask picture [STATE]`: the README's picture of `torchtools serve`'s page,
//! taken by the browser test that checks what it shows.

use anyhow::{Context, Result};
use std::path::Path;

/// The saved state the picture shows, and the picture.
const STATE: &str = "docs/serve-state.json";
const PICTURE: &str = "docs/serve-page.png";
/// The test that serves [`STATE`] with `serve --replay`, checks every column of every
/// table in Chromium and writes the picture.
const TEST: &str = "serve::the_readmes_picture_shows_a_saved_busy_server_every_column_filled";

/// With `state` (a file saved by `torchtools serve --save` or from `/api/state`), it
/// replaces [`STATE`] first; then the test runs and its picture becomes [`PICTURE`].
pub(crate) fn run(state: Option<&Path>) -> Result<()> {
    let root = crate::root();
    if let Some(state) = state {
        std::fs::copy(state, root.join(STATE))
            .with_context(|| format!("copying {} to {STATE}", state.display()))?;
    }
    let test = crate::steps::cargo(&[
        "test",
        "-q",
        "-p",
        "torchtools-cli",
        "--test",
        "it",
        TEST,
        "--",
        "--exact",
    ]);
    crate::steps::run("the page's browser test", test)
        .with_context(|| format!("on {STATE}: the picture is left as it was"))?;
    std::fs::copy(
        root.join("target/serve-page-readme.png"),
        root.join(PICTURE),
    )
    .context("copying the test's picture")?;
    println!("{PICTURE} taken from {STATE}");
    Ok(())
}
