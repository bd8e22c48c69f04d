//! A failure that ends `torchtools` with an exit status of its own (a leaf: every
//! command's module returns one).

/// A failure that has its own exit status.
#[derive(Debug)]
pub(crate) struct Exit(pub(crate) u8, pub(crate) String);

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.1)
    }
}

impl std::error::Error for Exit {}
