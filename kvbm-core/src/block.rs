//! The block lifecycle as types.
//!
//! ```text
//! Empty ─init─▶ Partial ─ready─▶ ReadyForScheduling ─schedule_compute─▶ Inflight
//!                 ▲  ▲                 │                                  │
//!                 │  └─cancel_schedule─┘                                  │
//!                 └────────────── compute_done (not full) ◀───────────────┤
//!                                                  compute_done (full) ───▶ Complete ─register─▶ Registered
//! ```
//!
//! Each state is its own type (`MutableBlock<Partial>`, ...), so an illegal
//! transition does not compile; the two conditional ones (`ready` with
//! nothing to compute, `fill_from` with a block of the wrong size) return a
//! [`TransitionError`] that hands the block back, so nothing is lost.
//!
//! A mutable block has exactly one owner; dropping it returns the slot to
//! its pool's free list. Registration ([`MutableBlock::register`], in the
//! block's own pool) turns a `Complete` block into an
//! [`ImmutableBlock`]: immutable and shared through an `Arc`. When the last
//! holder drops it, the block stays registered but *inactive*: still
//! findable by its sequence hash, and the first candidate for eviction.
//! A [`WeakBlock`] either upgrades (from a live `Arc`, or by reviving the
//! inactive block from the pool) or reports that the block is gone.
//!
//! Design note on `ready`: the lifecycle diagram moves Partial to
//! ReadyForScheduling when tokens are added, and Inflight back to Partial
//! when a compute finishes on a block that is not full. Both only make sense
//! if a not-yet-full block can be scheduled (the tail block of a decoding
//! request is computed every step), so `ready` accepts any block holding
//! uncomputed tokens; a full block simply has nowhere else to go.

use crate::pool::{PoolShared, RevivedOrGone};
use crate::tokens::{
    BlockMeta, SaltHash, SequenceHash, Token, TokenBlock, block_hash, sequence_hash,
};
use kvbm_events::tier::{BlockId, Tier};
use std::fmt;
use std::mem::ManuallyDrop;
use std::ops::Deref;
use std::sync::{Arc, Weak};

/// Why a conditional transition was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockError {
    /// `ready` on a block whose tokens are all computed (or that has none).
    #[error("block {block} has no uncomputed tokens to schedule")]
    NothingToSchedule {
        /// The block.
        block: BlockId,
    },
    /// `fill_from` with a token block of another size than the pool's.
    #[error("block {block} holds {expected} tokens, the token block has {got}")]
    WrongBlockSize {
        /// The block.
        block: BlockId,
        /// The pool's block size.
        expected: usize,
        /// The token block's size.
        got: usize,
    },
}

/// A refused transition: the error and the block, unchanged.
pub struct TransitionError<B> {
    /// What was wrong.
    pub error: BlockError,
    /// The block, in the state it was in before the call.
    pub block: B,
}

impl<B> fmt::Debug for TransitionError<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransitionError")
            .field("error", &self.error)
            .finish_non_exhaustive()
    }
}

impl<B> fmt::Display for TransitionError<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.error.fmt(f)
    }
}

impl<B> std::error::Error for TransitionError<B> {}

/// Typestate: freshly allocated, holds nothing.
#[derive(Debug)]
pub struct Empty;

/// The token contents of a block that is being filled and computed.
#[derive(Debug, Clone)]
pub struct BlockContents {
    salt: SaltHash,
    parent: Option<SequenceHash>,
    position: usize,
    tokens: Vec<Token>,
    computed: usize,
}

impl BlockContents {
    /// Tokens in the block.
    pub fn tokens(&self) -> &[Token] {
        &self.tokens
    }
    /// How many of them have been computed.
    pub fn computed(&self) -> usize {
        self.computed
    }
    /// The parent block's sequence hash.
    pub fn parent(&self) -> Option<SequenceHash> {
        self.parent
    }
}

/// Typestate: initialised with a salt; accepts tokens.
#[derive(Debug)]
pub struct Partial(BlockContents);
/// Typestate: holds uncomputed tokens, waiting for the scheduler.
#[derive(Debug)]
pub struct ReadyForScheduling(BlockContents);
/// Typestate: being computed by a forward pass.
#[derive(Debug)]
pub struct Inflight(BlockContents);
/// Typestate: full and computed, hashes known; ready to register.
#[derive(Debug)]
pub struct Complete(BlockMeta);

/// A block with a single owner, in lifecycle state `S`. Dropping it in any
/// state returns the slot to the pool's free list.
pub struct MutableBlock<S> {
    pool: ManuallyDrop<Arc<PoolShared>>,
    id: BlockId,
    state: ManuallyDrop<S>,
}

impl<S> fmt::Debug for MutableBlock<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MutableBlock")
            .field("tier", &self.pool.tier())
            .field("id", &self.id)
            .field("state", &std::any::type_name::<S>())
            .finish()
    }
}

impl<S> MutableBlock<S> {
    pub(crate) fn new(pool: Arc<PoolShared>, id: BlockId, state: S) -> Self {
        MutableBlock {
            pool: ManuallyDrop::new(pool),
            id,
            state: ManuallyDrop::new(state),
        }
    }

    /// The block's index in its pool and storage.
    pub fn id(&self) -> BlockId {
        self.id
    }
    /// The tier of the pool the block belongs to.
    pub fn tier(&self) -> Tier {
        self.pool.tier()
    }
    /// Identity of the owning pool (unique per process).
    pub fn pool_id(&self) -> u64 {
        self.pool.id()
    }
    /// Tokens per block in the owning pool.
    pub fn block_size(&self) -> usize {
        self.pool.block_size()
    }

    /// Moves to another state without running `Drop` (which would free the
    /// slot).
    fn transition<T>(self, f: impl FnOnce(S) -> T) -> MutableBlock<T> {
        let (pool, id, state) = self.into_parts();
        MutableBlock::new(pool, id, f(state))
    }

    /// Takes the block apart without returning it to the pool: ownership of
    /// the slot moves to the caller (the pool, at registration).
    pub(crate) fn into_parts(self) -> (Arc<PoolShared>, BlockId, S) {
        let mut me = ManuallyDrop::new(self);
        // SAFETY: `me` is never used or dropped again, so each field is
        // taken exactly once.
        unsafe {
            (
                ManuallyDrop::take(&mut me.pool),
                me.id,
                ManuallyDrop::take(&mut me.state),
            )
        }
    }
}

impl<S> Drop for MutableBlock<S> {
    fn drop(&mut self) {
        self.pool.release_mutable(self.id);
        // SAFETY: drop runs once; the fields are not used afterwards.
        unsafe {
            ManuallyDrop::drop(&mut self.state);
            ManuallyDrop::drop(&mut self.pool);
        }
    }
}

impl MutableBlock<Empty> {
    /// Empty → Partial: starts a block at `position` in a sequence whose
    /// previous full block has sequence hash `parent`.
    pub fn init(
        self,
        salt: SaltHash,
        parent: Option<SequenceHash>,
        position: usize,
    ) -> MutableBlock<Partial> {
        let cap = self.block_size();
        self.transition(|_| {
            Partial(BlockContents {
                salt,
                parent,
                position,
                tokens: Vec::with_capacity(cap),
                computed: 0,
            })
        })
    }

    /// Empty → Complete for a block whose contents arrive by copy (the
    /// destination of an offload or onboard): the tokens and hashes are
    /// already known, there is nothing to compute.
    pub fn fill_from(
        self,
        block: &TokenBlock,
    ) -> Result<MutableBlock<Complete>, TransitionError<MutableBlock<Empty>>> {
        if block.tokens().len() != self.block_size() {
            return Err(TransitionError {
                error: BlockError::WrongBlockSize {
                    block: self.id,
                    expected: self.block_size(),
                    got: block.tokens().len(),
                },
                block: self,
            });
        }
        let meta = block.meta();
        Ok(self.transition(|_| Complete(meta)))
    }

    /// Empty → Complete for a block that receives a copy of `source` (from
    /// another tier): it will be registered under the same hashes. Refused
    /// when the two pools' block sizes differ.
    pub fn copy_of(
        self,
        source: &ImmutableBlock,
    ) -> Result<MutableBlock<Complete>, TransitionError<MutableBlock<Empty>>> {
        let got = source.0.pool.block_size();
        if got != self.block_size() {
            return Err(TransitionError {
                error: BlockError::WrongBlockSize {
                    block: self.id,
                    expected: self.block_size(),
                    got,
                },
                block: self,
            });
        }
        let meta = *source.meta();
        Ok(self.transition(|_| Complete(meta)))
    }
}

impl MutableBlock<Partial> {
    /// Adds tokens up to the block's capacity; returns how many were taken.
    pub fn add_tokens(&mut self, tokens: &[Token]) -> usize {
        let room = self.block_size() - self.state.0.tokens.len();
        let take = room.min(tokens.len());
        self.state.0.tokens.extend_from_slice(&tokens[..take]);
        take
    }

    /// True when the block holds `block_size` tokens.
    pub fn is_full(&self) -> bool {
        self.state.0.tokens.len() == self.block_size()
    }

    /// The block's contents so far.
    pub fn contents(&self) -> &BlockContents {
        &self.state.0
    }

    /// Partial → ReadyForScheduling. Refused when every token is computed.
    pub fn ready(
        self,
    ) -> Result<MutableBlock<ReadyForScheduling>, TransitionError<MutableBlock<Partial>>> {
        if self.state.0.tokens.len() == self.state.0.computed {
            return Err(TransitionError {
                error: BlockError::NothingToSchedule { block: self.id },
                block: self,
            });
        }
        Ok(self.transition(|Partial(c)| ReadyForScheduling(c)))
    }
}

impl MutableBlock<ReadyForScheduling> {
    /// ReadyForScheduling → Inflight.
    pub fn schedule_compute(self) -> MutableBlock<Inflight> {
        self.transition(|ReadyForScheduling(c)| Inflight(c))
    }
    /// ReadyForScheduling → Partial.
    pub fn cancel_schedule(self) -> MutableBlock<Partial> {
        self.transition(|ReadyForScheduling(c)| Partial(c))
    }
    /// The block's contents.
    pub fn contents(&self) -> &BlockContents {
        &self.state.0
    }
}

/// Where a finished compute leaves a block.
#[derive(Debug)]
pub enum ComputeDone {
    /// Full: hashes are computed, ready to register.
    Complete(MutableBlock<Complete>),
    /// Not full: back to accepting tokens.
    Partial(MutableBlock<Partial>),
}

impl MutableBlock<Inflight> {
    /// Inflight → Complete (full) or Partial (not full).
    pub fn compute_done(self) -> ComputeDone {
        let full = self.state.0.tokens.len() == self.block_size();
        if full {
            ComputeDone::Complete(self.transition(|Inflight(c)| {
                let bh = block_hash(&c.tokens, c.salt);
                Complete(BlockMeta {
                    salt_hash: c.salt,
                    block_hash: bh,
                    sequence_hash: sequence_hash(c.parent, bh, c.salt),
                    parent_sequence_hash: c.parent,
                    position: c.position,
                })
            }))
        } else {
            ComputeDone::Partial(self.transition(|Inflight(mut c)| {
                c.computed = c.tokens.len();
                Partial(c)
            }))
        }
    }
}

impl MutableBlock<Complete> {
    /// The hashes it will be registered under.
    pub fn meta(&self) -> &BlockMeta {
        &self.state.0
    }
    /// The sequence hash it will be registered under.
    pub fn sequence_hash(&self) -> SequenceHash {
        self.state.0.sequence_hash
    }
    pub(crate) fn into_meta(self) -> (Arc<PoolShared>, BlockId, BlockMeta) {
        let (pool, id, Complete(meta)) = self.into_parts();
        (pool, id, meta)
    }
}

/// The shared, immutable state of a registered block. Reached through
/// [`ImmutableBlock`]; when the last one drops, the pool makes the block
/// inactive (still registered, reusable, evictable).
pub struct RegisteredBlock {
    pool: Arc<PoolShared>,
    id: BlockId,
    epoch: u64,
    generation: u32,
    meta: BlockMeta,
    priority: u32,
}

impl RegisteredBlock {
    pub(crate) fn new(
        pool: Arc<PoolShared>,
        id: BlockId,
        epoch: u64,
        generation: u32,
        meta: BlockMeta,
        priority: u32,
    ) -> Self {
        RegisteredBlock {
            pool,
            id,
            epoch,
            generation,
            meta,
            priority,
        }
    }
}

impl Drop for RegisteredBlock {
    fn drop(&mut self) {
        self.pool.release_registered(self.id, self.epoch);
    }
}

/// A registered block: immutable, shared, cheap to clone (`Arc`).
#[derive(Clone)]
pub struct ImmutableBlock(pub(crate) Arc<RegisteredBlock>);

impl ImmutableBlock {
    /// The block's index in its pool and storage.
    pub fn id(&self) -> BlockId {
        self.0.id
    }
    /// The tier it lives on.
    pub fn tier(&self) -> Tier {
        self.0.pool.tier()
    }
    /// Identity of the owning pool.
    pub fn pool_id(&self) -> u64 {
        self.0.pool.id()
    }
    /// The sequence hash it is registered under.
    pub fn sequence_hash(&self) -> SequenceHash {
        self.0.meta.sequence_hash
    }
    /// Its hashes and position.
    pub fn meta(&self) -> &BlockMeta {
        &self.0.meta
    }
    /// Tokens per block in its pool.
    pub fn block_size(&self) -> usize {
        self.0.pool.block_size()
    }
    /// Eviction priority: lower values are evicted first.
    pub fn priority(&self) -> u32 {
        self.0.priority
    }
    /// A weak handle, for holders that must not keep the block alive (the
    /// offload in-queue).
    pub fn downgrade(&self) -> WeakBlock {
        WeakBlock {
            weak: Arc::downgrade(&self.0),
            pool: Arc::downgrade(&self.0.pool),
            id: self.0.id,
            generation: self.0.generation,
            sequence_hash: self.0.meta.sequence_hash,
            tier: self.tier(),
        }
    }
    /// Number of strong handles to this registration (for diagnostics).
    pub fn strong_count(&self) -> usize {
        Arc::strong_count(&self.0)
    }
}

impl Deref for ImmutableBlock {
    type Target = RegisteredBlock;
    fn deref(&self) -> &RegisteredBlock {
        &self.0
    }
}

impl fmt::Debug for ImmutableBlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ImmutableBlock")
            .field("tier", &self.tier())
            .field("id", &self.id())
            .field("sequence_hash", &self.sequence_hash())
            .finish()
    }
}

/// Why a weak handle could not be upgraded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockGone {
    /// The block was evicted (its slot now holds something else) or its pool
    /// no longer exists.
    #[error("block {id} on {tier} ({sequence_hash}) is gone: evicted or pool dropped")]
    Evicted {
        /// Tier.
        tier: Tier,
        /// Block id it had.
        id: BlockId,
        /// Sequence hash it had.
        sequence_hash: SequenceHash,
    },
}

/// A handle that does not keep its block alive.
#[derive(Clone)]
pub struct WeakBlock {
    weak: Weak<RegisteredBlock>,
    pool: Weak<PoolShared>,
    id: BlockId,
    generation: u32,
    sequence_hash: SequenceHash,
    tier: Tier,
}

impl WeakBlock {
    /// Upgrades to a strong handle: from a live `Arc` when someone still
    /// holds the block, else by reviving it from the pool's inactive set if
    /// it has not been evicted since. Otherwise the block is gone.
    pub fn upgrade(&self) -> Result<ImmutableBlock, BlockGone> {
        if let Some(a) = self.weak.upgrade() {
            return Ok(ImmutableBlock(a));
        }
        let gone = BlockGone::Evicted {
            tier: self.tier,
            id: self.id,
            sequence_hash: self.sequence_hash,
        };
        let Some(pool) = self.pool.upgrade() else {
            return Err(gone);
        };
        match PoolShared::revive(&pool, self.id, self.generation) {
            RevivedOrGone::Revived(b) => Ok(b),
            RevivedOrGone::Gone => Err(gone),
        }
    }
    /// The sequence hash of the block it points to.
    pub fn sequence_hash(&self) -> SequenceHash {
        self.sequence_hash
    }
    /// The block id it points to.
    pub fn id(&self) -> BlockId {
        self.id
    }
    /// The tier it points into.
    pub fn tier(&self) -> Tier {
        self.tier
    }
}

impl fmt::Debug for WeakBlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WeakBlock")
            .field("tier", &self.tier)
            .field("id", &self.id)
            .field("sequence_hash", &self.sequence_hash)
            .finish()
    }
}
