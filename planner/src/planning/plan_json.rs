//! A plan's JSON form: its inputs (manifest, world size, topology, cost
//! model, algorithm), fingerprint, pieces per rank and stats. A plan read
//! back goes through the pipeline's checks like a new one.

use std::sync::Arc;

use serde_json::{json, Value};

use crate::error::PlanError;
use crate::model::cost::{CostModel, Topology};
use crate::model::manifest::{path_from_json, Manifest};
use crate::planning::plan::{Algorithm, Piece, Plan, PlanSource};

/// Version of the plan JSON form.
pub const PLAN_JSON_VERSION: u64 = 1;

impl Plan {
    /// The plan as JSON: its inputs (manifest, world size, topology, cost
    /// model, algorithm), fingerprint, pieces per rank and stats.
    pub fn to_json_value(&self) -> Value {
        let leaves = self.manifest.leaves();
        let ranks: Vec<Value> = self
            .ranks
            .iter()
            .map(|list| {
                Value::Array(
                    list.iter()
                        .map(|p| {
                            json!({
                                "leaf": p.leaf,
                                "path": crate::model::manifest::path_to_json(&leaves[p.leaf as usize].path),
                                "start": p.start,
                                "stop": p.stop,
                            })
                        })
                        .collect(),
                )
            })
            .collect();
        let s = &self.stats;
        json!({
            "version": PLAN_JSON_VERSION,
            "planner_version": crate::planning::inputs::PLANNER_VERSION,
            "fingerprint": self.fingerprint,
            "world_size": self.world_size,
            "algorithm": self.algorithm.name(),
            "topology": self.topology,
            "cost": self.cost,
            "manifest": self.manifest.to_json_value(),
            "ranks": ranks,
            "stats": {
                "makespan": s.makespan_s,
                "lower_bound": s.lower_bound_s,
                "gap": s.gap,
                "pieces": s.pieces,
                "splits": s.splits,
                "writers": s.writers,
                "max_rank_bytes": s.max_rank_bytes,
                "plan_ms": s.plan_ms,
            },
        })
    }

    pub fn to_json(&self) -> String {
        self.to_json_value().to_string()
    }

    /// Reads a plan written by [`Plan::to_json`]. The pieces are validated
    /// against the embedded manifest, the fingerprint is recomputed and
    /// must match, and the stats are recomputed rather than trusted.
    pub fn from_json(text: &str) -> Result<Plan, PlanError> {
        let bad = |m: String| PlanError::Malformed(m);
        let v: Value = serde_json::from_str(text).map_err(|e| bad(format!("invalid JSON: {e}")))?;
        let version = v
            .get("version")
            .and_then(Value::as_u64)
            .ok_or_else(|| bad("missing version".into()))?;
        if version != PLAN_JSON_VERSION {
            return Err(bad(format!("unsupported plan version {version}")));
        }
        let world_size = v
            .get("world_size")
            .and_then(Value::as_u64)
            .ok_or_else(|| bad("missing or invalid world_size".into()))?;
        let world_size = crate::planning::inputs::check_world_size(world_size)?;
        let algorithm: Algorithm = v
            .get("algorithm")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("missing algorithm".into()))?
            .parse()?;
        let topology: Topology =
            serde_json::from_value(v.get("topology").cloned().unwrap_or(Value::Null))
                .map_err(|e| bad(format!("invalid topology: {e}")))?;
        let cost: CostModel = serde_json::from_value(v.get("cost").cloned().unwrap_or(Value::Null))
            .map_err(|e| bad(format!("invalid cost: {e}")))?;
        let manifest = Manifest::from_json_value(
            v.get("manifest")
                .ok_or_else(|| bad("missing manifest".into()))?,
        )
        .map_err(|e| bad(format!("embedded manifest: {e}")))?;
        let raw_ranks = v
            .get("ranks")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("missing ranks".into()))?;
        if raw_ranks.len() != world_size as usize {
            return Err(bad(format!(
                "{} rank lists for world size {world_size}",
                raw_ranks.len()
            )));
        }
        let mut ranks = Vec::with_capacity(raw_ranks.len());
        for (r, list) in raw_ranks.iter().enumerate() {
            let list = list
                .as_array()
                .ok_or_else(|| bad(format!("rank {r} is not a list")))?;
            let mut pieces = Vec::with_capacity(list.len());
            for (i, p) in list.iter().enumerate() {
                let field = |name: &str| {
                    p.get(name).and_then(Value::as_u64).ok_or_else(|| {
                        bad(format!("rank {r} piece {i}: missing or invalid {name}"))
                    })
                };
                let leaf = u32::try_from(field("leaf")?)
                    .map_err(|_| bad(format!("rank {r} piece {i}: leaf out of range")))?;
                let piece = Piece {
                    leaf,
                    start: field("start")?,
                    stop: field("stop")?,
                };
                if let Some(path) = p.get("path") {
                    let path = path_from_json(path)
                        .map_err(|e| bad(format!("rank {r} piece {i}: {e}")))?;
                    match manifest.leaves().get(leaf as usize) {
                        Some(l) if l.path == path => {}
                        _ => {
                            return Err(bad(format!(
                                "rank {r} piece {i}: path does not match leaf {leaf}"
                            )))
                        }
                    }
                }
                pieces.push(piece);
            }
            ranks.push(pieces);
        }
        let stored_fp = v
            .get("fingerprint")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("missing fingerprint".into()))?
            .to_string();
        let plan_ms = v
            .get("stats")
            .and_then(|s| s.get("plan_ms"))
            .and_then(Value::as_f64)
            .unwrap_or(0.0);
        let plan = crate::planning::pipeline::assemble_plan(
            Arc::new(manifest),
            world_size,
            topology,
            cost,
            algorithm,
            ranks,
            plan_ms,
            PlanSource::Computed,
        )?;
        if plan.fingerprint != stored_fp {
            return Err(PlanError::FingerprintMismatch {
                expected: plan.fingerprint,
                actual: stored_fp,
            });
        }
        Ok(plan)
    }
}
