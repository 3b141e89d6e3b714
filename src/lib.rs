//! # gradsync
//!
//! Cheap gradient synchronization for data-parallel training on MPI clusters.
//!
//! * [`comm`]: the small point-to-point [`Transport`](comm::Transport) trait
//!   that every algorithm is written against, implemented for any rsmpi
//!   communicator ([`MpiComm`](comm::MpiComm)) and in process
//!   ([`LocalComm`](comm::LocalComm)) for tests.
//! * [`dense`]: verified dense collectives: Rabenseifner and ring allreduce,
//!   allgatherv (recursive doubling, or Bruck's for `p` not a power of two).
//! * [`select`]: communication-set selection for sparse codecs (exact,
//!   trimmed top-k, threshold binary search with reuse; RedSync §5.2).
//! * [`codec`]: the papers' compression codecs under one contract.
//! * [`sparse`]: packed per-layer units fused into one message per rank and
//!   exchanged by one allgatherv (RedSync §5.3).
//! * [`sync`]: the engine a training loop calls every step ([`sync::GradSync`]).
//! * [`gradiveq`]: GradiVeQ's PCA compressor and its compressed-domain ring
//!   all-reduce (Algorithm 1), with the training schedule.
//! * [`powersgd`]: PowerSGD's rank-r power step with error feedback (the
//!   logic: factors to allreduce and the reconstruction), the engine's
//!   `powersgd` strategy.
//! * [`gpu`]: device buffers: whether MPI is CUDA-aware, the
//!   host-staged allreduce of a device buffer, the GPU probe (feature
//!   `cuda`).
//! * [`cost`]: the α-β-γ cost model that predicts each strategy's time and
//!   drives the engine's `Auto` strategy.
//! * [`calibrate`]: measures a cluster's profile from inside a job
//!   ([`calibrate::calibrate`]) on top of [`cost`] and [`sync`], and checks a
//!   profile's predictions against measurements.
//! * [`comm::agree`]: the failure model — an error on some ranks reaches
//!   every rank in the same step, or the job is aborted; never a hang.
//!   [`failure`] is its old name, kept as an alias.
//! * [`cli`]: the `gradsync` command (benchmark, verification against MPI).
//!
//! ```
//! use gradsync::comm::{LocalComm, Transport};
//! use gradsync::dense::{allreduce, AllreduceAlgo, AllreduceOptions};
//! // Four in-process ranks; with MPI use `MpiComm::duplicate_of(&world)`.
//! let out = LocalComm::run(4, |comm| {
//!     let mut grad = vec![1.0f32; 10];
//!     allreduce(&comm, &mut grad, AllreduceAlgo::Ring, &AllreduceOptions::default()).unwrap();
//!     grad
//! });
//! assert!(out.iter().all(|g| g.iter().all(|&x| x == 4.0)));
//! ```
#![deny(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod calibrate;
#[cfg(feature = "cli")]
pub mod cli;
pub mod codec;
pub mod comm;
pub mod cost;
mod cpu;
pub mod dense;
mod error;
/// The failure model: the old name of [`comm::agree`], kept as an alias.
pub use comm::agree as failure;
pub mod gpu;
pub mod gradiveq;
pub mod powersgd;
pub mod select;
pub mod sparse;
pub mod strategy;
pub mod sync;

pub use error::{Error, Result};

/// The README's examples compile as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// The Rust guide's examples compile as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../docs/rust.md")]
pub struct RustGuideDoctests;

/// The cost-model guide's examples compile as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../docs/cost-model.md")]
pub struct CostModelGuideDoctests;
