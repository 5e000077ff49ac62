//! The attach server (see [`crate::protocol`]).
