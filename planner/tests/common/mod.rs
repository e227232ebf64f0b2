//! What the model-state tests share: building a model + AdamW manifest
//! from a list of parameter shapes.

// Each test crate uses part of this module.
#![allow(dead_code)]
use deeppart_planner::{DType, Leaf, Manifest, PathKey};

pub fn s(x: &str) -> PathKey {
    PathKey::Str(x.to_string())
}

/// A model's parameters: (name, shape).
pub type Params = Vec<(String, Vec<u64>)>;

/// Parameters to a model + AdamW manifest.
pub fn adamw_manifest(params: &[(String, Vec<u64>)]) -> Manifest {
    let f32 = DType::Float32;
    let mut leaves = Vec::with_capacity(4 * params.len() + 1);
    for (name, shape) in params {
        leaves.push(Leaf::tensor(vec![s("model"), s(name)], f32, shape.clone(), None).unwrap());
    }
    for (i, (_, shape)) in params.iter().enumerate() {
        let i = i as i64;
        for buf in ["exp_avg", "exp_avg_sq"] {
            let path = vec![s("optim"), s("state"), PathKey::Int(i), s(buf)];
            leaves.push(Leaf::tensor(path, f32, shape.clone(), None).unwrap());
        }
        let path = vec![s("optim"), s("state"), PathKey::Int(i), s("step")];
        leaves.push(Leaf::tensor(path, f32, vec![], None).unwrap());
    }
    // param_groups: hyperparameters plus the list of parameter indices, pickled.
    let groups_bytes = 400 + 8 * params.len() as u64;
    leaves.push(Leaf::object(vec![s("optim"), s("param_groups")], groups_bytes, None).unwrap());
    Manifest::new(leaves).unwrap()
}
