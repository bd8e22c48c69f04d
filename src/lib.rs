//! torchtools
