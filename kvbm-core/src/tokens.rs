//! Tokens, token blocks and the chained hashes that name them.
//!
//! A request's tokens are cut into blocks of `block_size`. Only full blocks
//! are hashed, and each full block gets three hashes:
//!
//! - the **salt hash**: xxh3-64 of the salt bytes with seed 0 (one per
//!   model/LoRA/tenant, so equal tokens under different salts never match);
//! - the **block hash**: xxh3-64 of the block's tokens as little-endian `u32`
//!   bytes, seeded with the salt hash;
//! - the **sequence hash**: for the first block, its block hash; otherwise
//!   xxh3-64 of the 16 bytes `[parent sequence hash, block hash]` (both
//!   little-endian `u64`), seeded with the salt hash.
//!
//! The sequence hash names a block *and its whole prefix*, so a pool can find
//! the longest cached prefix of a request by looking up sequence hashes in
//! order and stopping at the first miss. The scheme is pinned by golden-value
//! tests below: changing it silently would make every recorded log and every
//! cache on disk unreadable.

pub use kvbm_events::hash::{BlockHash, SaltHash, SequenceHash};
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// One token id.
pub type Token = u32;

/// Errors from building token sequences.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// A block must hold at least one token.
    #[error("block size must be at least 1 token (got 0)")]
    ZeroBlockSize,
    /// A token block was built from the wrong number of tokens.
    #[error("a token block needs exactly {expected} tokens, got {got}")]
    WrongBlockLength {
        /// The block size.
        expected: usize,
        /// What was given.
        got: usize,
    },
}

/// Hashes a salt (model name, LoRA id, tenant, ...). An empty salt is fine.
pub fn salt_hash(salt: &[u8]) -> SaltHash {
    SaltHash(xxh3_64_with_seed(salt, 0))
}

/// Hashes one block's tokens under a salt.
pub fn block_hash(tokens: &[Token], salt: SaltHash) -> BlockHash {
    // Tokens are hashed as their little-endian bytes so the value does not
    // depend on the host's endianness. A stack buffer covers common block
    // sizes without allocating.
    const STACK_TOKENS: usize = 256;
    if tokens.len() <= STACK_TOKENS {
        let mut buf = [0u8; STACK_TOKENS * 4];
        for (i, t) in tokens.iter().enumerate() {
            buf[i * 4..i * 4 + 4].copy_from_slice(&t.to_le_bytes());
        }
        BlockHash(xxh3_64_with_seed(&buf[..tokens.len() * 4], salt.0))
    } else {
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        BlockHash(xxh3_64_with_seed(&bytes, salt.0))
    }
}

/// Chains a block hash onto its parent's sequence hash.
pub fn sequence_hash(
    parent: Option<SequenceHash>,
    block: BlockHash,
    salt: SaltHash,
) -> SequenceHash {
    match parent {
        None => SequenceHash(block.0),
        Some(p) => {
            let mut buf = [0u8; 16];
            buf[..8].copy_from_slice(&p.0.to_le_bytes());
            buf[8..].copy_from_slice(&block.0.to_le_bytes());
            SequenceHash(xxh3_64_with_seed(&buf, salt.0))
        }
    }
}

/// What identifies a full block, without its tokens: enough to register a
/// copy of it on another tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BlockMeta {
    /// The salt hash it was hashed under.
    pub salt_hash: SaltHash,
    /// Hash of its tokens.
    pub block_hash: BlockHash,
    /// Hash of it and its whole prefix.
    pub sequence_hash: SequenceHash,
    /// The previous block's sequence hash, `None` for the first block.
    pub parent_sequence_hash: Option<SequenceHash>,
    /// Index of the block in its sequence.
    pub position: usize,
}

/// A full block of tokens with its hashes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenBlock {
    tokens: Vec<Token>,
    salt_hash: SaltHash,
    block_hash: BlockHash,
    sequence_hash: SequenceHash,
    parent_sequence_hash: Option<SequenceHash>,
    /// Index of this block in its sequence (0 for the first block).
    position: usize,
}

impl TokenBlock {
    /// Builds a full block. `tokens.len()` is the block size; it must be
    /// non-zero.
    pub fn new(
        tokens: Vec<Token>,
        salt_hash: SaltHash,
        parent: Option<&TokenBlock>,
    ) -> Result<Self, TokenError> {
        if tokens.is_empty() {
            return Err(TokenError::ZeroBlockSize);
        }
        if let Some(p) = parent
            && p.tokens.len() != tokens.len()
        {
            return Err(TokenError::WrongBlockLength {
                expected: p.tokens.len(),
                got: tokens.len(),
            });
        }
        Ok(Self::from_raw_parts(
            tokens,
            salt_hash,
            parent.map(|p| p.sequence_hash),
            parent.map_or(0, |p| p.position + 1),
        ))
    }

    pub(crate) fn from_raw_parts(
        tokens: Vec<Token>,
        salt_hash: SaltHash,
        parent_sequence_hash: Option<SequenceHash>,
        position: usize,
    ) -> Self {
        let block_hash = block_hash(&tokens, salt_hash);
        let sequence_hash = sequence_hash(parent_sequence_hash, block_hash, salt_hash);
        TokenBlock {
            tokens,
            salt_hash,
            block_hash,
            sequence_hash,
            parent_sequence_hash,
            position,
        }
    }

    /// The block's tokens (exactly `block_size` of them).
    pub fn tokens(&self) -> &[Token] {
        &self.tokens
    }
    /// The salt hash this block was hashed under.
    pub fn salt_hash(&self) -> SaltHash {
        self.salt_hash
    }
    /// Hash of this block's tokens alone.
    pub fn block_hash(&self) -> BlockHash {
        self.block_hash
    }
    /// Hash of this block and its whole prefix.
    pub fn sequence_hash(&self) -> SequenceHash {
        self.sequence_hash
    }
    /// The previous block's sequence hash, `None` for the first block.
    pub fn parent_sequence_hash(&self) -> Option<SequenceHash> {
        self.parent_sequence_hash
    }
    /// Index of this block in its sequence.
    pub fn position(&self) -> usize {
        self.position
    }
    /// The block's identity without its tokens.
    pub fn meta(&self) -> BlockMeta {
        BlockMeta {
            salt_hash: self.salt_hash,
            block_hash: self.block_hash,
            sequence_hash: self.sequence_hash,
            parent_sequence_hash: self.parent_sequence_hash,
            position: self.position,
        }
    }
}

/// A growing sequence of tokens: full blocks (hashed) plus a partial tail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenSequence {
    block_size: usize,
    salt_hash: SaltHash,
    blocks: Vec<TokenBlock>,
    tail: Vec<Token>,
}

impl TokenSequence {
    /// An empty sequence. Fails on a zero block size.
    pub fn new(block_size: usize, salt_hash: SaltHash) -> Result<Self, TokenError> {
        if block_size == 0 {
            return Err(TokenError::ZeroBlockSize);
        }
        Ok(TokenSequence {
            block_size,
            salt_hash,
            blocks: Vec::new(),
            tail: Vec::with_capacity(block_size),
        })
    }

    /// A sequence holding `tokens`.
    pub fn from_tokens(
        tokens: &[Token],
        block_size: usize,
        salt_hash: SaltHash,
    ) -> Result<Self, TokenError> {
        let mut s = Self::new(block_size, salt_hash)?;
        s.extend(tokens);
        Ok(s)
    }

    /// Appends one token; returns the block it completed, if any.
    pub fn append(&mut self, token: Token) -> Option<&TokenBlock> {
        self.tail.push(token);
        if self.tail.len() == self.block_size {
            self.seal_tail();
            self.blocks.last()
        } else {
            None
        }
    }

    /// Appends tokens; returns the range of block indices completed by them.
    pub fn extend(&mut self, tokens: &[Token]) -> std::ops::Range<usize> {
        let first = self.blocks.len();
        let mut rest = tokens;
        while !rest.is_empty() {
            let room = self.block_size - self.tail.len();
            let take = room.min(rest.len());
            self.tail.extend_from_slice(&rest[..take]);
            rest = &rest[take..];
            if self.tail.len() == self.block_size {
                self.seal_tail();
            }
        }
        first..self.blocks.len()
    }

    fn seal_tail(&mut self) {
        let tokens = std::mem::replace(&mut self.tail, Vec::with_capacity(self.block_size));
        let parent = self.blocks.last().map(|b| b.sequence_hash);
        let position = self.blocks.len();
        self.blocks.push(TokenBlock::from_raw_parts(
            tokens,
            self.salt_hash,
            parent,
            position,
        ));
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    /// The salt hash every block is hashed under.
    pub fn salt_hash(&self) -> SaltHash {
        self.salt_hash
    }
    /// The full (hashed) blocks, in order.
    pub fn blocks(&self) -> &[TokenBlock] {
        &self.blocks
    }
    /// Tokens after the last full block (fewer than `block_size`).
    pub fn tail(&self) -> &[Token] {
        &self.tail
    }
    /// Total number of tokens.
    pub fn total_tokens(&self) -> usize {
        self.blocks.len() * self.block_size + self.tail.len()
    }
    /// Sequence hashes of the full blocks, in order — what prefix matching
    /// looks up.
    pub fn sequence_hashes(&self) -> Vec<SequenceHash> {
        self.blocks.iter().map(|b| b.sequence_hash).collect()
    }
    /// Drops tokens beyond `len` (e.g. after a preemption rolls back
    /// speculative tokens). Blocks that become partial move back to the tail.
    pub fn truncate(&mut self, len: usize) {
        if len >= self.total_tokens() {
            return;
        }
        let full = len / self.block_size;
        let rem = len % self.block_size;
        if full < self.blocks.len() {
            let mut tail = Vec::with_capacity(self.block_size);
            tail.extend_from_slice(&self.blocks[full].tokens[..rem]);
            self.blocks.truncate(full);
            self.tail = tail;
        } else {
            self.tail.truncate(rem);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    // Golden values: these pin the hashing scheme. They were computed with
    // Python's `xxhash` package (an independent xxh3 implementation) from
    // the formula in the module docs. If one changes, every recorded log and
    // persisted cache stops matching — do not "fix" the numbers, fix the code.
    #[test]
    fn golden_salt_hashes() {
        assert_eq!(salt_hash(b""), SaltHash(0x2d06800538d394c2));
        assert_eq!(salt_hash(b"kvbm"), SaltHash(0xbfb778761abdbd6d));
    }

    #[test]
    fn golden_block_and_sequence_hashes() {
        let salt = salt_hash(b"kvbm");
        let seq = TokenSequence::from_tokens(&(0..8).collect::<Vec<u32>>(), 4, salt).unwrap();
        let b = seq.blocks();
        assert_eq!(b.len(), 2);
        assert_eq!(b[0].block_hash(), BlockHash(0x1f2aeffbdc6d95b6));
        assert_eq!(b[0].sequence_hash(), SequenceHash(0x1f2aeffbdc6d95b6));
        assert_eq!(b[1].block_hash(), BlockHash(0x48cdb9202a5ee69e));
        assert_eq!(b[1].sequence_hash(), SequenceHash(0x671d476ed8438042));
    }

    #[test]
    fn hashes_follow_the_documented_formula() {
        // Independent of the golden numbers: recompute from the definition.
        let salt_bytes = b"model-x";
        let salt = salt_hash(salt_bytes);
        assert_eq!(salt.0, xxh3_64_with_seed(salt_bytes, 0));
        let toks = [1u32, 2, 3, 0xdead_beef];
        let bytes: Vec<u8> = toks.iter().flat_map(|t| t.to_le_bytes()).collect();
        let bh = xxh3_64_with_seed(&bytes, salt.0);
        let seq = TokenSequence::from_tokens(&[toks, toks].concat(), 4, salt).unwrap();
        assert_eq!(seq.blocks()[0].block_hash().0, bh);
        assert_eq!(seq.blocks()[0].sequence_hash().0, bh);
        let mut pair = Vec::new();
        pair.extend_from_slice(&bh.to_le_bytes());
        pair.extend_from_slice(&bh.to_le_bytes());
        assert_eq!(
            seq.blocks()[1].sequence_hash().0,
            xxh3_64_with_seed(&pair, salt.0)
        );
    }

    #[test]
    fn zero_block_size_is_an_error() {
        assert_eq!(
            TokenSequence::new(0, SaltHash(0)).unwrap_err(),
            TokenError::ZeroBlockSize
        );
        assert_eq!(
            TokenBlock::new(vec![], SaltHash(0), None).unwrap_err(),
            TokenError::ZeroBlockSize
        );
    }

    #[test]
    fn only_full_blocks_are_hashed() {
        let mut s = TokenSequence::new(4, SaltHash(1)).unwrap();
        assert!(s.append(1).is_none());
        assert_eq!(s.extend(&[2, 3]), 0..0);
        assert_eq!(s.tail(), &[1, 2, 3]);
        let done = s.append(4).map(|b| b.position());
        assert_eq!(done, Some(0));
        assert_eq!(s.extend(&[5, 6, 7, 8, 9, 10, 11, 12, 13]), 1..3);
        assert_eq!(s.tail(), &[13]);
        assert_eq!(s.total_tokens(), 13);
    }

    #[test]
    fn salt_separates_equal_tokens() {
        let a = TokenSequence::from_tokens(&[1, 2, 3, 4], 4, salt_hash(b"a")).unwrap();
        let b = TokenSequence::from_tokens(&[1, 2, 3, 4], 4, salt_hash(b"b")).unwrap();
        assert_ne!(a.sequence_hashes(), b.sequence_hashes());
    }

    proptest! {
        // Appending in any chunking gives the same blocks and hashes.
        #[test]
        fn chunking_does_not_change_hashes(
            tokens in proptest::collection::vec(any::<u32>(), 0..200),
            bs in 1usize..17,
            cuts in proptest::collection::vec(0usize..50, 0..10),
        ) {
            let salt = salt_hash(b"p");
            let whole = TokenSequence::from_tokens(&tokens, bs, salt).unwrap();
            let mut pieces = TokenSequence::new(bs, salt).unwrap();
            let mut rest = &tokens[..];
            for c in cuts {
                let c = c.min(rest.len());
                pieces.extend(&rest[..c]);
                rest = &rest[c..];
            }
            for t in rest { pieces.append(*t); }
            prop_assert_eq!(&whole, &pieces);
            prop_assert_eq!(whole.blocks().len(), tokens.len() / bs);
            prop_assert_eq!(whole.tail().len(), tokens.len() % bs);
        }

        // Two sequences share a sequence hash at block i exactly when they
        // share the first (i+1)*bs tokens (up to hash collisions).
        #[test]
        fn sequence_hash_names_the_prefix(
            common in proptest::collection::vec(0u32..4, 0..40),
            a in proptest::collection::vec(0u32..4, 0..40),
            b in proptest::collection::vec(0u32..4, 0..40),
        ) {
            let bs = 4;
            let salt = SaltHash(7);
            let ta = [common.clone(), a].concat();
            let tb = [common, b].concat();
            let sa = TokenSequence::from_tokens(&ta, bs, salt).unwrap();
            let sb = TokenSequence::from_tokens(&tb, bs, salt).unwrap();
            for (i, (x, y)) in sa.blocks().iter().zip(sb.blocks()).enumerate() {
                let same_prefix = ta[..(i + 1) * bs] == tb[..(i + 1) * bs];
                prop_assert_eq!(x.sequence_hash() == y.sequence_hash(), same_prefix);
            }
        }

        #[test]
        fn truncate_matches_rebuild(
            tokens in proptest::collection::vec(any::<u32>(), 0..100),
            bs in 1usize..9,
            keep in 0usize..120,
        ) {
            let salt = SaltHash(3);
            let mut s = TokenSequence::from_tokens(&tokens, bs, salt).unwrap();
            s.truncate(keep);
            let k = keep.min(tokens.len());
            let rebuilt = TokenSequence::from_tokens(&tokens[..k], bs, salt).unwrap();
            prop_assert_eq!(s, rebuilt);
        }
    }
}
