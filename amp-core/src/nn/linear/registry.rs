//! Where `amp::nn::Linear` layers built from `Var`s are found again: Rust has
//! no module tree to walk, so `amp::initialize` looks each `VarMap` entry up
//! here by its tensor id to learn whether it is a Linear weight (and to
//! convert its storage and attach a gradient sink). Entries hold weak
//! references: a dropped layer leaves nothing alive.

use super::layer_scaling::LayerScaling;
use crate::scaling::sink::GradSink;
use crate::scaling::weight::Weight;
use candle_core::TensorId;
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::sync::{RwLock, Weak};

/// Weak references to a layer's shared parts.
#[derive(Debug)]
pub(crate) struct LinearParts {
    pub(crate) name: String,
    pub(crate) weight: Weak<RwLock<Weight>>,
    pub(crate) scaling: Weak<Mutex<Option<LayerScaling>>>,
    pub(crate) sink: Weak<Mutex<Option<GradSink>>>,
    pub(crate) saved_bytes: Weak<Mutex<usize>>,
    pub(crate) high_precision: Weak<std::sync::atomic::AtomicBool>,
    pub(crate) casts: Weak<Mutex<super::layer_scaling::Casts>>,
    pub(crate) ahead: Weak<Mutex<super::ahead::Ahead>>,
}

impl LinearParts {
    fn alive(&self) -> bool {
        self.weight.strong_count() > 0
    }
}

pub(super) fn table() -> &'static Mutex<HashMap<TensorId, LinearParts>> {
    static TABLE: OnceLock<Mutex<HashMap<TensorId, LinearParts>>> = OnceLock::new();
    TABLE.get_or_init(Mutex::default)
}

/// Records a layer under the id of the `Var` it was built from.
pub(crate) fn register(id: TensorId, parts: LinearParts) {
    if let Ok(mut t) = table().lock() {
        t.retain(|_, p| p.alive());
        t.insert(id, parts);
    }
}
