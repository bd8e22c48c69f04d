//! `cargo xtask picture [STATE]`: the README's picture of `torchtools serve`'s page,
//! taken by the browser test that checks what it shows.

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context, Result};

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
    let status = Command::new(env!("CARGO"))
        .args(["test", "-q", "-p", "torchtools-cli", "--test", "it", TEST])
        .args(["--", "--exact"])
        .current_dir(&root)
        .status()
        .context("starting cargo")?;
    if !status.success() {
        bail!("the page's test failed on {STATE} ({status}): the picture is left as it was");
    }
    std::fs::copy(
        root.join("target/serve-page-readme.png"),
        root.join(PICTURE),
    )
    .context("copying the test's picture")?;
    println!("{PICTURE} taken from {STATE}");
    Ok(())
}
