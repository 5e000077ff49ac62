//! A client of the attach server (see [`crate::protocol`]).
