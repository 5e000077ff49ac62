//! The hashes that name blocks, as plain identifiers.
//!
//! How they are computed (xxh3-64, chained from a salt) is the block
//! manager's business (`kvbm_core::tokens`); events and logs only carry
//! them, so the types live here with the rest of the vocabulary.

use serde::{Deserialize, Serialize};
use std::fmt;

macro_rules! hash_newtype {
    ($(#[$m:meta])* $name:ident) => {
        $(#[$m])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub u64);

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!(stringify!($name), "({:#018x})"), self.0)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{:016x}", self.0)
            }
        }
    };
}

hash_newtype!(
    /// xxh3-64 of the salt bytes (seed 0); seeds every other hash.
    SaltHash
);
hash_newtype!(
    /// xxh3-64 of one block's tokens, seeded with the salt hash.
    BlockHash
);
hash_newtype!(
    /// Names a full block together with its whole prefix.
    SequenceHash
);
