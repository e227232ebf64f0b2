//! Plan quality on the state of real model shapes: `balanced` must come
//! within 1% of the proven lower bound at every world size from 4 to 1024.
//!
//! The manifests are built from the layer shapes of the models, laid out as
//! `torch.distributed.checkpoint` sees a `{"model": ..., "optim": ...}`
//! state dict with AdamW: per parameter `exp_avg`, `exp_avg_sq` (same shape)
//! and a 0-D `step`, under `["optim", "state", index, name]`, and the
//! `param_groups` as one object leaf.

use std::sync::Arc;

mod common;

use common::{adamw_manifest, models};
use deeppart_planner::{plan, Algorithm, CostModel, Topology};

const WORLD_SIZES: [u64; 9] = [4, 8, 16, 32, 64, 128, 256, 512, 1024];
const MAX_GAP: f64 = 1.01;

#[test]
fn model_shapes_have_the_published_parameter_counts() {
    for (name, params, millions) in models() {
        let count: u64 = params
            .iter()
            .map(|(_, shape)| shape.iter().product::<u64>())
            .sum();
        assert_eq!(count / 1_000_000, millions, "{name}: {count} parameters");
        let m = adamw_manifest(&params);
        assert_eq!(m.len(), 4 * params.len() + 1);
        assert!(m.total_bytes() > 12 * count, "{name}");
    }
}

#[test]
fn balanced_is_within_one_percent_of_the_bound_on_model_states() {
    let mut failures = Vec::new();
    for (name, params, _) in models() {
        let manifest = Arc::new(adamw_manifest(&params));
        for ws in WORLD_SIZES {
            let p = plan(
                manifest.clone(),
                ws,
                Topology::default(),
                CostModel::default(),
                Algorithm::Balanced,
            )
            .unwrap();
            let g = plan(
                manifest.clone(),
                ws,
                Topology::default(),
                CostModel::default(),
                Algorithm::Greedy,
            )
            .unwrap();
            let st = &p.stats;
            println!(
                "{name:>18} ws={ws:>5}: balanced gap {:.5} (writers {:>4}, splits {:>4}, makespan {:.2} ms, bound {:.2} ms) | greedy gap {:.3}",
                st.gap,
                st.writers,
                st.splits,
                st.makespan_s * 1e3,
                st.lower_bound_s * 1e3,
                g.stats.gap
            );
            assert!(
                st.gap >= 1.0 - 1e-9,
                "{name} ws={ws}: makespan below the lower bound: {st:?}"
            );
            if st.gap > MAX_GAP {
                failures.push(format!("{name} ws={ws}: gap {:.5}", st.gap));
            }
            // Few splits: no more than about one per writer.
            assert!(st.splits <= st.writers as u64 + 1, "{name} ws={ws}: {st:?}");
        }
    }
    assert!(
        failures.is_empty(),
        "balanced gap above {MAX_GAP}: {failures:#?}"
    );
}

#[test]
fn balanced_is_within_one_percent_on_multi_gpu_nodes() {
    // The same states with 8 ranks per node: topology changes which ranks
    // write, never how well the work is balanced.
    for (name, params, _) in models() {
        let manifest = Arc::new(adamw_manifest(&params));
        for ws in [8u64, 64, 512] {
            let topo = Topology { ranks_per_node: 8 };
            let p = plan(
                manifest.clone(),
                ws,
                topo,
                CostModel::default(),
                Algorithm::Balanced,
            )
            .unwrap();
            assert!(p.stats.gap <= MAX_GAP, "{name} ws={ws}: {:?}", p.stats);
        }
    }
}
