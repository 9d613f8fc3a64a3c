//! Batching: a step's sequences cut into microbatches. The flat microbatch (`[T]` tokens with
//! `cu_seqlens`, or padded / packed shapes) and the policies that make them (padded, packed,
//! flat-ffd, flat-balanced, verl's Karmarkar-Karp, flat-planned), with sequences longer than
//! the token budget cut into chunks.

pub mod microbatch;
pub mod policy;
pub mod verl_kk;
