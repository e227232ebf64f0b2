//! Fuzzes the plan JSON reader: any UTF-8 input must be accepted or rejected
//! with an error, never panic; an accepted plan must survive a round trip
//! through `to_json` with the same pieces, fingerprint and stats.

#![no_main]

use deeppart_planner::Plan;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(plan) = Plan::from_json(text) else {
        return;
    };
    let again = Plan::from_json(&plan.to_json()).expect("a re-serialised plan must read back");
    assert_eq!(again.ranks, plan.ranks);
    assert_eq!(again.fingerprint, plan.fingerprint);
    assert_eq!(*again.manifest, *plan.manifest);
    assert_eq!(again.world_size, plan.world_size);
    assert_eq!(again.stats.makespan_s, plan.stats.makespan_s);
    assert_eq!(again.stats.lower_bound_s, plan.stats.lower_bound_s);
});
