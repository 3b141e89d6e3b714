//! The layer table and its agreement across ranks: registration
//! (`register*`: the strategy of each layer is resolved once here, by
//! [`GradSync::resolve`], and `Auto` by the cost model's decision table,
//! [`crate::cost::choose`], in [`GradSync::auto_choice`]), the layer's
//! state allocation (in the rank-local half, so a failure fails every rank
//! alike), and the collective checks that every rank registered the same
//! table under the same options (an FNV hash compared by one small
//! allreduce per registration, one more before the first step; the failure
//! model of [`crate::failure`]).

use super::layer::{zeros, Layer};
use super::plan::LayerPlanInput;
use super::{GradSync, LayerStats, Strategy};
use crate::codec::{Codec, CodecConfig, RgcMethod};
use crate::comm::Transport;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};

/// Handle of a registered layer (its index in registration order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LayerId(pub usize);

pub(super) const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
pub(super) fn fnv(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

const TAG_TABLE: crate::comm::Tag = crate::comm::tags::TABLE;

impl<C: Transport + Send + 'static> GradSync<C> {
    /// Compare `h` across ranks (one 24-byte collective); on a mismatch every
    /// rank returns [`Error::TableMismatch`] with `what()`. A rank that
    /// passes `Err` still enters the collective: every rank then returns
    /// the same [`Error::RankFailed`] (the failure model, [`crate::failure`]).
    pub(super) fn agree(&mut self, h: Result<u64>, what: impl FnOnce() -> String) -> Result<()> {
        let comm = self.comm.as_ref().ok_or_else(|| {
            Error::InvalidArgument("the layer table is fixed once steps have started".into())
        })?;
        let (rank, p) = (comm.rank(), comm.size());
        let mut v = match &h {
            Ok(h) => [0, *h, !*h],
            Err(_) => [(p - rank) as u64, 0, 0],
        };
        crate::dense::small_allreduce_max(comm, &mut v, TAG_TABLE)?;
        if v[0] != 0 {
            return crate::failure::agree(comm, h).map(|_| ());
        }
        let h = h?;
        if v[1] != h || !v[2] != h {
            return Err(Error::TableMismatch(what()));
        }
        Ok(())
    }

    /// The strategy a layer of `n` elements gets from [`register`](Self::register):
    /// with a profile, the cost model's choice ([`Strategy::Auto`]);
    /// otherwise `Dense` below `compress_threshold`, else the configured
    /// codec.
    pub fn resolve(&self, n: usize) -> Strategy {
        if self.cfg.profile.is_some() {
            if let Ok((s, _)) = self.auto_choice(n) {
                return s;
            }
        }
        if n < self.cfg.compress_threshold {
            Strategy::Dense
        } else {
            Strategy::Sparse {
                codec: self.cfg.codec.clone(),
                density: None,
            }
        }
    }

    /// `Auto` for a layer of `n` elements: the predicted-fastest of dense
    /// (the configured allreduce), RGC and optionally quantized RGC at
    /// `auto_density`, with the predictions (name, seconds) it chose among.
    pub fn auto_choice(&self, n: usize) -> Result<(Strategy, Vec<(String, f64)>)> {
        use crate::cost::{choose, predict, Query};
        let prof = self.cfg.profile.as_ref().ok_or_else(|| {
            Error::InvalidArgument(
                "Strategy::Auto needs Config::profile (gradsync calibrate)".into(),
            )
        })?;
        let d = self.cfg.auto_density;
        let method = match &self.cfg.codec {
            CodecConfig::Rgc { method, .. } => *method,
            _ => RgcMethod::Trimmed,
        };
        let method_name = serde_json::to_value(method)?
            .as_str()
            .unwrap_or("trimmed")
            .to_string();
        let preds = predict(
            prof,
            &Query {
                n,
                p: self.size,
                density: d,
                gradiveq_ratio: 8.0,
            },
            &method_name,
        )?;
        // The one decision table (crate::cost::choose) over what the
        // engine runs for this configuration.
        let allowed = crate::cost::engine_candidates(self.cfg.allreduce, self.cfg.auto_quant);
        let best = choose(&preds, &allowed)
            .ok_or_else(|| Error::InvalidArgument("no strategy to choose from".into()))?;
        let strategy = best
            .id
            .engine_strategy(d, method)
            .ok_or_else(|| Error::InvalidArgument(format!("the engine cannot run {}", best.id)))?;
        let considered = preds
            .iter()
            .filter(|p| allowed.contains(&p.id))
            .map(|p| (p.name.clone(), p.seconds))
            .collect();
        Ok((strategy, considered))
    }

    /// Register a layer with the default strategy ([`resolve`](Self::resolve)).
    /// Collective: all ranks must register the same layers in the same order.
    pub fn register(&mut self, name: &str, shape: &[usize]) -> Result<LayerId> {
        let strategy = self.default_strategy(shape);
        self.register_impl(name, shape, strategy)
    }

    /// What `register` (and the spec `"auto"`) gives a layer: the cost
    /// model's choice with a profile, else by size.
    pub(super) fn default_strategy(&self, shape: &[usize]) -> Result<Strategy> {
        if self.cfg.profile.is_some() {
            return Ok(Strategy::Auto);
        }
        shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .map(|n| self.resolve(n))
            .ok_or_else(|| Error::InvalidArgument(format!("shape {shape:?} overflows")))
    }

    /// Register a layer with an explicit strategy. Collective: one 16-byte
    /// allreduce compares a hash of the table so far; a rank whose table
    /// differs makes every rank fail with [`Error::TableMismatch`].
    pub fn register_with(
        &mut self,
        name: &str,
        shape: &[usize],
        strategy: Strategy,
    ) -> Result<LayerId> {
        self.register_impl(name, shape, Ok(strategy))
    }

    /// Register a layer with a strategy given as text, as the C ABI and the
    /// Python package do: `"auto"` ([`register`](Self::register)'s choice:
    /// the cost model with a profile, else by size), `"dense"`,
    /// `"gradiveq[:k=768,d=96|lambda=0.01,...]"`, or a codec string such
    /// as `"rgc:density=0.001"` or `"3lc:s=1.75"` ([`Strategy::parse`]).
    /// A spec that does not parse on one rank fails the registration
    /// collective on every rank, naming that rank.
    pub fn register_spec(&mut self, name: &str, shape: &[usize], spec: &str) -> Result<LayerId> {
        let strategy = match spec.trim() {
            "auto" => self.default_strategy(shape),
            s => Strategy::parse(s),
        };
        self.register_impl(name, shape, strategy)
    }

    /// Take part in a registration carrying an error the caller found
    /// before it had a valid name, shape or strategy (a binding given
    /// arguments of the wrong type): the registration collective fails on
    /// every rank, naming this one and `err`; nothing is registered
    /// anywhere. Returns that error.
    pub fn fail_register(&mut self, name: &str, err: Error) -> Error {
        match self.register_impl(name, &[0], Err(err)) {
            Err(e) => e,
            Ok(_) => Error::InvalidArgument("a failed registration succeeded".into()),
        }
    }

    pub(super) fn register_impl(
        &mut self,
        name: &str,
        shape: &[usize],
        strategy: Result<Strategy>,
    ) -> Result<LayerId> {
        if self.step > 0 || self.worker.is_some() {
            // Local misuse after the table was fixed: no peer is in a
            // registration collective any more (they are in steps).
            return Err(Error::InvalidArgument(
                "register every layer before the first step".into(),
            ));
        }
        let id = self.layers.len();
        // Everything rank-local first; a failure still enters the
        // registration collective so no peer waits in it.
        let (mom, delay) = (self.cfg.momentum != 0.0, self.cfg.delay > 1);
        // The layer's state is allocated here, in the rank-local half: a
        // rank that cannot allocate it fails the registration collective
        // on every rank instead of aborting after it (peers would wait).
        let local = strategy
            .and_then(|s| self.prepare_layer(id, name, shape, s))
            .and_then(|l| {
                let sparse = l.2.is_some();
                // Every layer needs its length in the step's buffers.
                drop(zeros(l.0, true, false)?);
                let st = (
                    zeros(l.0, sparse, true)?,
                    zeros(l.0, mom, true)?,
                    zeros(l.0, delay, true)?,
                    zeros(l.0, delay, true)?,
                );
                Ok((l, st))
            });
        let label = local
            .as_ref()
            .map_or_else(|_| String::new(), |l| l.0 .4.clone());
        let h = local.as_ref().map(|l| l.0 .3).map_err(|e| {
            let why = match e {
                Error::InvalidArgument(m) => m.clone(),
                e => e.to_string(),
            };
            Error::InvalidArgument(format!("layer {name:?} (#{id}): {why}"))
        });
        if let Some(why) = &self.broken {
            return Err(Error::TableMismatch(why.clone()));
        }
        let r = self.agree(h, || {
            format!("layer #{id} {name:?} (shape {shape:?}, {label}) is not the same on every rank")
        });
        if let Err(Error::TableMismatch(why)) = &r {
            // The ranks' tables are out of step (this collective may even
            // have met a peer's final table check): no rank may go on.
            self.broken = Some(why.clone());
        }
        r?;
        let ((n, strategy, codec, h, label, gvq, auto), (v, u, acc, prev)) = local?;
        self.table_hash = h;
        let layer = Layer {
            name: name.to_string(),
            shape: shape.to_vec(),
            n,
            strategy,
            codec,
            v,
            u,
            acc,
            prev,
            dir: Vec::new(),
            unit: Vec::new(),
            gvq,
            cur_density: None,
            non_finite: false,
            sent: false,
            stats: LayerStats {
                name: name.to_string(),
                auto,
                ..LayerStats::default()
            },
        };
        self.table.push(LayerPlanInput::new(n, &layer.strategy));
        self.layers.push(layer);
        log::debug!("gradsync: layer #{id} {name:?} {shape:?} ({n} elements): {label}");
        Ok(LayerId(id))
    }

    /// The rank-local part of [`register_with`](Self::register_with):
    /// element count, resolved strategy, codec, table hash, label, GradiVeQ
    /// state, whether `Auto` chose.
    #[allow(clippy::type_complexity)]
    pub(super) fn prepare_layer(
        &self,
        id: usize,
        name: &str,
        shape: &[usize],
        strategy: Strategy,
    ) -> Result<(
        usize,
        Strategy,
        Option<Box<dyn Codec>>,
        u64,
        String,
        Option<crate::gradiveq::schedule::GradiveqLayer>,
        bool,
    )> {
        let n = shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| Error::InvalidArgument(format!("shape {shape:?} overflows")))?;
        let auto = strategy == Strategy::Auto;
        let strategy = if strategy == Strategy::Auto {
            let (s, preds) = self.auto_choice(n)?;
            log::info!(
                "gradsync: layer {name:?} ({n} elements, {} ranks): auto chose {} from {}",
                self.size,
                s.label(),
                preds
                    .iter()
                    .map(|(k, t)| format!("{k} {:.1} us", t * 1e6))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            s
        } else {
            strategy
        };
        let gvq = match &strategy {
            Strategy::Gradiveq(sc) => {
                if self.cfg.delay > 1 {
                    return Err(Error::InvalidArgument(
                        "GradiVeQ cannot be combined with delay > 1".to_string(),
                    ));
                }
                Some(crate::gradiveq::schedule::GradiveqLayer::new(
                    n,
                    sc.clone(),
                )?)
            }
            _ => None,
        };
        let codec = match &strategy {
            // `Auto` was resolved above.
            Strategy::Dense | Strategy::Auto | Strategy::Gradiveq(_) => None,
            Strategy::Sparse { codec, density } => {
                let mut c = codec.build()?;
                // Error feedback only where it stays bounded (codec::feedback).
                c.feedback(n)?;
                if let Some(d) = density {
                    c.set_density(*d)?;
                }
                Some(c)
            }
        };
        let h = {
            let mut h = fnv(self.table_hash, b"layer");
            h = fnv(h, &(id as u64).to_le_bytes());
            h = fnv(h, name.as_bytes());
            h = fnv(h, &[0xff]);
            for d in shape {
                h = fnv(h, &(*d as u64).to_le_bytes());
            }
            fnv(h, serde_json::to_string(&strategy)?.as_bytes())
        };
        let label = strategy.label();
        Ok((n, strategy, codec, h, label, gvq, auto))
    }

    /// Check once, before the first step, that every rank registered the
    /// same number of layers.
    pub(super) fn check_table(&mut self) -> Result<()> {
        if self.table_checked {
            return Ok(());
        }
        let h = fnv(
            fnv(self.table_hash, b"complete"),
            &(self.layers.len() as u64).to_le_bytes(),
        );
        if let Some(why) = &self.broken {
            return Err(Error::TableMismatch(why.clone()));
        }
        let n = self.layers.len();
        let r = self.agree(Ok(h), || {
            format!("this rank registered {n} layers; some rank registered others")
        });
        match r {
            Ok(()) => {
                self.table_checked = true;
                Ok(())
            }
            Err(e) => {
                // Every rank got an error here: none may run a step.
                self.broken = Some(match &e {
                    Error::TableMismatch(why) => why.clone(),
                    e => e.to_string(),
                });
                Err(e)
            }
        }
    }
}
