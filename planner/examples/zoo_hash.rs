//! One hash over every plan of the zoo (planner/tests/fixtures/zoo): each
//! algorithm at world sizes 4..4096, one and eight ranks per node, default
//! cost model. A change that must leave plans alone prints the same hash
//! before and after: `cargo run --release -p deeppart-planner --example zoo_hash`.

use std::fs;
use std::path::PathBuf;
use std::sync::Arc;

use deeppart_planner::{plan, Algorithm, CostModel, Manifest, Topology};
use serde_json::Value;

fn main() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/zoo");
    let index: Value =
        serde_json::from_str(&fs::read_to_string(dir.join("index.json")).unwrap()).unwrap();
    let mut all = blake3::Hasher::new();
    let mut count = 0;
    for e in index.as_array().unwrap() {
        let text = fs::read_to_string(dir.join(e["file"].as_str().unwrap())).unwrap();
        let m = Arc::new(Manifest::from_json(&text).unwrap());
        for a in Algorithm::ALL {
            for ws in [4u64, 16, 64, 256, 1024, 4096] {
                for rpn in [1u32, 8] {
                    let t = Topology {
                        ranks_per_node: rpn.min(ws as u32),
                    };
                    let p = plan(m.clone(), ws, t, CostModel::default(), a).unwrap();
                    all.update(p.assignment_digest().as_bytes());
                    count += 1;
                }
            }
        }
    }
    println!("{count} zoo plans: {}", all.finalize().to_hex());
}
