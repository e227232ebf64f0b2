//! Fuzzes the manifest JSON parser: any UTF-8 input must parse or be
//! rejected with an error, never panic; an accepted manifest must survive a
//! round trip through `to_json` unchanged. Small accepted manifests are also
//! planned with every algorithm, which must succeed, produce a plan that
//! passes validation, never beat the lower bound, and round-trip as JSON.

#![no_main]

use std::sync::Arc;

use deeppart_planner::model::cost::{MAX_SECONDS, MIN_BANDWIDTH};
use deeppart_planner::{plan, Algorithm, CostModel, Manifest, Plan, Topology};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(manifest) = Manifest::from_json(text) else {
        return;
    };
    let again =
        Manifest::from_json(&manifest.to_json()).expect("a re-serialised manifest must parse");
    assert_eq!(again, manifest);
    assert_eq!(again.fingerprint(), manifest.fingerprint());

    if manifest.len() > 64 {
        return;
    }
    let max_owner = manifest.max_owner().map_or(0, |(_, o)| o as u64 + 1);
    if max_owner > 64 {
        return;
    }
    // A world size and cost model picked from the input, so the corpus
    // explores them too.
    let h = data
        .iter()
        .fold(0u64, |h, &b| h.wrapping_mul(31).wrapping_add(b as u64));
    let world_size = max_owner.max(1 + h % 17);
    let cost = match (h >> 8) % 4 {
        0 => CostModel::default(),
        1 => CostModel {
            writer_s: 0.0,
            min_piece_bytes: 1,
            ..CostModel::default()
        },
        2 => CostModel {
            fixed_s: 0.0,
            piece_s: 0.0,
            min_piece_bytes: 64,
            ..CostModel::default()
        },
        // Anywhere in the valid range, extremes included (a bandwidth that
        // made a piece's time overflow once kept `balanced` looping: issue 13).
        _ => {
            let at = |shift: u32, lo: f64, hi: f64| {
                let x = ((h >> shift) & 0x7f) as f64 / 127.0;
                (lo * (hi / lo).powf(x)).clamp(lo, hi)
            };
            let time = |shift: u32| {
                if (h >> shift) & 0x7f < 16 {
                    0.0
                } else {
                    at(shift, 1e-9, MAX_SECONDS)
                }
            };
            let shared =
                |shift: u32| ((h >> shift) & 1 == 1).then(|| at(shift + 1, MIN_BANDWIDTH, 1e15));
            CostModel {
                fixed_s: time(12),
                piece_s: time(19),
                writer_s: time(26),
                bandwidth: at(33, MIN_BANDWIDTH, 1e15),
                node_bandwidth: shared(40),
                aggregate_bandwidth: shared(48),
                min_piece_bytes: 1 + ((h >> 56) & 0xf) * 4096,
                align_bytes: 1 << ((h >> 60) & 0xf),
                ..CostModel::default()
            }
        }
    };
    let manifest = Arc::new(manifest);
    for algorithm in Algorithm::ALL {
        let p = plan(
            manifest.clone(),
            world_size,
            Topology::default(),
            cost,
            algorithm,
        )
        .unwrap_or_else(|e| panic!("{algorithm} failed: {e}"));
        let s = &p.stats;
        assert!(
            s.makespan_s >= s.lower_bound_s * (1.0 - 1e-9),
            "{algorithm}: makespan {} below the lower bound {}",
            s.makespan_s,
            s.lower_bound_s
        );
        let back = Plan::from_json(&p.to_json()).expect("a plan's JSON must read back");
        assert_eq!(back.ranks, p.ranks);
        assert_eq!(back.fingerprint, p.fingerprint);
    }
});
