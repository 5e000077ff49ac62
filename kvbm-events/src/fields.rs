//! Reading an event kind from named values, for inputs that name each field
//! (the `tracing` layer in `kvbm-ingest`).
//!
//! A source gives a value by field name and type ([`FieldSource`]); each
//! field type reads itself from a source ([`ReadField`]); and each kind's
//! reader, [`EventKind::read_fields`], follows from the kind's declaration:
//! every field is read under its declared name. So an input that names
//! fields can take a new kind without an edit.

use crate::event::{Direction, EntryPoint, EventKind, HookPhase, KindTag, ResumeCause};
use crate::hash::SequenceHash;
use crate::slot::SlotState;
use crate::tier::{BlockId, Tier};

/// Named values, read by type. Each method gives field `name` as that
/// type, or the source's error when the field is missing or does not
/// parse as the type.
pub trait FieldSource {
    /// Why a field could not be read.
    type Error;

    /// Whether the source has field `name` at all (for optional fields).
    fn has(&self, name: &'static str) -> bool;
    /// A whole number.
    fn number(&self, name: &'static str) -> Result<u64, Self::Error>;
    /// True or false.
    fn flag(&self, name: &'static str) -> Result<bool, Self::Error>;
    /// Free text.
    fn text(&self, name: &'static str) -> Result<String, Self::Error>;
    /// A list of whole numbers.
    fn numbers(&self, name: &'static str) -> Result<Vec<u64>, Self::Error>;
    /// A tier.
    fn tier(&self, name: &'static str) -> Result<Tier, Self::Error>;
    /// A direction between two tiers.
    fn direction(&self, name: &'static str) -> Result<Direction, Self::Error>;
    /// A slot state.
    fn state(&self, name: &'static str) -> Result<SlotState, Self::Error>;
    /// The error for field `name` holding a value its type cannot take
    /// (a number out of range, an unknown name).
    fn bad_value(&self, name: &'static str) -> Self::Error;
}

/// A type an event kind's field may have, read from a [`FieldSource`]. A
/// kind with a field of a new type does not compile until the type has an
/// impl here.
pub trait ReadField: Sized {
    /// Field `name` of `src` as this type.
    fn read<S: FieldSource + ?Sized>(src: &S, name: &'static str) -> Result<Self, S::Error>;
}

/// A type read from one whole number (alone or in a list).
pub trait FromNumber: Sized {
    /// `v` as this type, `None` when out of its range.
    fn from_number(v: u64) -> Option<Self>;
}

impl FromNumber for u64 {
    fn from_number(v: u64) -> Option<Self> {
        Some(v)
    }
}

impl FromNumber for u32 {
    fn from_number(v: u64) -> Option<Self> {
        u32::try_from(v).ok()
    }
}

impl FromNumber for SequenceHash {
    fn from_number(v: u64) -> Option<Self> {
        Some(SequenceHash(v))
    }
}

/// The number types read through [`FromNumber`].
macro_rules! read_numbers {
    ($($t:ty),*) => {$(
        impl ReadField for $t {
            fn read<S: FieldSource + ?Sized>(src: &S, name: &'static str) -> Result<Self, S::Error> {
                <$t>::from_number(src.number(name)?).ok_or_else(|| src.bad_value(name))
            }
        }
    )*};
}

read_numbers!(u32, u64, SequenceHash);

impl ReadField for bool {
    fn read<S: FieldSource + ?Sized>(src: &S, name: &'static str) -> Result<Self, S::Error> {
        src.flag(name)
    }
}

impl ReadField for String {
    fn read<S: FieldSource + ?Sized>(src: &S, name: &'static str) -> Result<Self, S::Error> {
        src.text(name)
    }
}

impl ReadField for Tier {
    fn read<S: FieldSource + ?Sized>(src: &S, name: &'static str) -> Result<Self, S::Error> {
        src.tier(name)
    }
}

impl ReadField for Direction {
    fn read<S: FieldSource + ?Sized>(src: &S, name: &'static str) -> Result<Self, S::Error> {
        src.direction(name)
    }
}

impl ReadField for SlotState {
    fn read<S: FieldSource + ?Sized>(src: &S, name: &'static str) -> Result<Self, S::Error> {
        src.state(name)
    }
}

impl ReadField for EntryPoint {
    fn read<S: FieldSource + ?Sized>(src: &S, name: &'static str) -> Result<Self, S::Error> {
        EntryPoint::from_name(&src.text(name)?).ok_or_else(|| src.bad_value(name))
    }
}

impl ReadField for HookPhase {
    fn read<S: FieldSource + ?Sized>(src: &S, name: &'static str) -> Result<Self, S::Error> {
        match src.text(name)?.as_str() {
            "Will" => Ok(HookPhase::Will),
            "Finished" => Ok(HookPhase::Finished),
            _ => Err(src.bad_value(name)),
        }
    }
}

impl ReadField for ResumeCause {
    fn read<S: FieldSource + ?Sized>(src: &S, name: &'static str) -> Result<Self, S::Error> {
        Ok(match src.text(name)?.as_str() {
            "Resume" => ResumeCause::Resume,
            "Step" => ResumeCause::Step,
            "Deadline" => ResumeCause::Deadline,
            "Cleared" => ResumeCause::Cleared,
            "ClientGone" => ResumeCause::ClientGone,
            _ => return Err(src.bad_value(name)),
        })
    }
}

impl<T: ReadField> ReadField for Option<T> {
    /// Absent is `None`; present must read.
    fn read<S: FieldSource + ?Sized>(src: &S, name: &'static str) -> Result<Self, S::Error> {
        if src.has(name) {
            T::read(src, name).map(Some)
        } else {
            Ok(None)
        }
    }
}

/// `EventKind::read_fields`, from the kinds as declared (see
/// `with_event_kinds!` in [`crate::event`]).
macro_rules! read_fields_of_kinds {
    ($( $variant:ident { $($field:ident: $fty:ty),* } )*) => {
        impl EventKind {
            /// Kind `tag` read from named values: each field under its
            /// declared name, by its type ([`ReadField`]).
            pub fn read_fields<S: FieldSource + ?Sized>(
                tag: KindTag,
                src: &S,
            ) -> Result<EventKind, S::Error> {
                Ok(match tag {
                    $(KindTag::$variant => EventKind::$variant {
                        $($field: <$fty as ReadField>::read(src, stringify!($field))?),*
                    },)*
                })
            }
        }
    };
}

with_event_kinds!(read_fields);

impl<T: FromNumber> ReadField for Vec<T> {
    fn read<S: FieldSource + ?Sized>(src: &S, name: &'static str) -> Result<Self, S::Error> {
        src.numbers(name)?
            .into_iter()
            .map(|v| T::from_number(v).ok_or_else(|| src.bad_value(name)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Values as text, by name; every type parsed from its text.
    struct Map(HashMap<&'static str, String>);

    #[derive(Debug, PartialEq)]
    enum Err {
        Missing(&'static str),
        Bad(&'static str),
    }

    impl Map {
        fn get(&self, name: &'static str) -> Result<&str, Err> {
            self.0
                .get(name)
                .map(String::as_str)
                .ok_or(Err::Missing(name))
        }
    }

    impl FieldSource for Map {
        type Error = Err;
        fn has(&self, name: &'static str) -> bool {
            self.0.contains_key(name)
        }
        fn number(&self, name: &'static str) -> Result<u64, Err> {
            self.get(name)?.parse().map_err(|_| Err::Bad(name))
        }
        fn flag(&self, name: &'static str) -> Result<bool, Err> {
            self.get(name)?.parse().map_err(|_| Err::Bad(name))
        }
        fn text(&self, name: &'static str) -> Result<String, Err> {
            self.get(name).map(str::to_owned)
        }
        fn numbers(&self, name: &'static str) -> Result<Vec<u64>, Err> {
            let s = self.get(name)?;
            s.split(',')
                .filter(|p| !p.is_empty())
                .map(|p| p.parse().map_err(|_| Err::Bad(name)))
                .collect()
        }
        fn tier(&self, name: &'static str) -> Result<Tier, Err> {
            match self.get(name)? {
                "G1" => Ok(Tier::Device),
                "G2" => Ok(Tier::Host),
                "G3" => Ok(Tier::Disk),
                _ => Err(Err::Bad(name)),
            }
        }
        fn direction(&self, _: &'static str) -> Result<Direction, Err> {
            Ok(Direction::HOST_TO_DISK)
        }
        fn state(&self, _: &'static str) -> Result<SlotState, Err> {
            Ok(SlotState::Decoding)
        }
        fn bad_value(&self, name: &'static str) -> Err {
            Err::Bad(name)
        }
    }

    fn map(pairs: &[(&'static str, &str)]) -> Map {
        Map(pairs.iter().map(|&(k, v)| (k, v.to_owned())).collect())
    }

    #[test]
    fn a_kind_is_read_field_by_field_under_its_declared_names() {
        let src = map(&[("tier", "G2"), ("block", "7"), ("sequence_hash", "99")]);
        assert_eq!(
            EventKind::read_fields(KindTag::BlockRegistered, &src),
            Ok(EventKind::BlockRegistered {
                tier: Tier::Host,
                block: 7,
                sequence_hash: SequenceHash(99),
                duplicate_of: None,
            })
        );
        assert_eq!(
            KindTag::BlockRegistered.field_names(),
            ["tier", "block", "sequence_hash", "duplicate_of"]
        );
        let src = map(&[("tier", "G2"), ("blocks", "1,2,3")]);
        assert_eq!(
            EventKind::read_fields(KindTag::BlocksAllocated, &src),
            Ok(EventKind::BlocksAllocated {
                tier: Tier::Host,
                blocks: vec![1, 2, 3],
            })
        );
    }

    #[test]
    fn a_missing_field_or_a_value_out_of_range_is_refused_by_name() {
        let src = map(&[("tier", "G2"), ("block", "7")]);
        assert_eq!(
            EventKind::read_fields(KindTag::BlockEvicted, &src),
            Err(Err::Missing("sequence_hash"))
        );
        let src = map(&[("tier", "G2"), ("blocks", "1,4294967296")]);
        assert_eq!(
            EventKind::read_fields(KindTag::BlocksAllocated, &src),
            Err(Err::Bad("blocks"))
        );
        let src = map(&[("breakpoint", "1"), ("cause", "Later")]);
        assert_eq!(
            EventKind::read_fields(KindTag::Resumed, &src),
            Err(Err::Bad("cause"))
        );
    }
}
