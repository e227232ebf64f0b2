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

use common::{adamw_manifest, Params};
use deeppart_planner::{plan, Algorithm, CostModel, Manifest, PathKey, Topology};

const WORLD_SIZES: [u64; 9] = [4, 8, 16, 32, 64, 128, 256, 512, 1024];
const MAX_GAP: f64 = 1.01;

struct Encoder {
    vocab: u64,
    positions: u64,
    type_vocab: u64,
    hidden: u64,
    intermediate: u64,
    layers: u64,
}

/// A BERT/RoBERTa encoder (Hugging Face `BertModel` parameter names and shapes).
fn encoder_params(e: &Encoder) -> Params {
    let h = e.hidden;
    let mut p: Params = vec![
        ("embeddings.word_embeddings.weight".into(), vec![e.vocab, h]),
        (
            "embeddings.position_embeddings.weight".into(),
            vec![e.positions, h],
        ),
        (
            "embeddings.token_type_embeddings.weight".into(),
            vec![e.type_vocab, h],
        ),
        ("embeddings.LayerNorm.weight".into(), vec![h]),
        ("embeddings.LayerNorm.bias".into(), vec![h]),
    ];
    for l in 0..e.layers {
        let pre = format!("encoder.layer.{l}");
        for lin in [
            "attention.self.query",
            "attention.self.key",
            "attention.self.value",
            "attention.output.dense",
        ] {
            p.push((format!("{pre}.{lin}.weight"), vec![h, h]));
            p.push((format!("{pre}.{lin}.bias"), vec![h]));
        }
        p.push((format!("{pre}.attention.output.LayerNorm.weight"), vec![h]));
        p.push((format!("{pre}.attention.output.LayerNorm.bias"), vec![h]));
        p.push((
            format!("{pre}.intermediate.dense.weight"),
            vec![e.intermediate, h],
        ));
        p.push((
            format!("{pre}.intermediate.dense.bias"),
            vec![e.intermediate],
        ));
        p.push((
            format!("{pre}.output.dense.weight"),
            vec![h, e.intermediate],
        ));
        p.push((format!("{pre}.output.dense.bias"), vec![h]));
        p.push((format!("{pre}.output.LayerNorm.weight"), vec![h]));
        p.push((format!("{pre}.output.LayerNorm.bias"), vec![h]));
    }
    p.push(("pooler.dense.weight".into(), vec![h, h]));
    p.push(("pooler.dense.bias".into(), vec![h]));
    p
}

/// GPT-2 (Hugging Face `GPT2LMHeadModel`; `lm_head` is tied to `wte`, so it
/// is not a separate leaf).
fn gpt2_params(hidden: u64, layers: u64) -> Params {
    let h = hidden;
    let mut p: Params = vec![
        ("transformer.wte.weight".into(), vec![50257, h]),
        ("transformer.wpe.weight".into(), vec![1024, h]),
    ];
    for l in 0..layers {
        let pre = format!("transformer.h.{l}");
        p.push((format!("{pre}.ln_1.weight"), vec![h]));
        p.push((format!("{pre}.ln_1.bias"), vec![h]));
        p.push((format!("{pre}.attn.c_attn.weight"), vec![h, 3 * h]));
        p.push((format!("{pre}.attn.c_attn.bias"), vec![3 * h]));
        p.push((format!("{pre}.attn.c_proj.weight"), vec![h, h]));
        p.push((format!("{pre}.attn.c_proj.bias"), vec![h]));
        p.push((format!("{pre}.ln_2.weight"), vec![h]));
        p.push((format!("{pre}.ln_2.bias"), vec![h]));
        p.push((format!("{pre}.mlp.c_fc.weight"), vec![h, 4 * h]));
        p.push((format!("{pre}.mlp.c_fc.bias"), vec![4 * h]));
        p.push((format!("{pre}.mlp.c_proj.weight"), vec![4 * h, h]));
        p.push((format!("{pre}.mlp.c_proj.bias"), vec![h]));
    }
    p.push(("transformer.ln_f.weight".into(), vec![h]));
    p.push(("transformer.ln_f.bias".into(), vec![h]));
    p
}

fn models() -> Vec<(&'static str, Params, u64)> {
    let bert = |hidden, intermediate, layers| Encoder {
        vocab: 30522,
        positions: 512,
        type_vocab: 2,
        hidden,
        intermediate,
        layers,
    };
    let xlmr = Encoder {
        vocab: 250002,
        positions: 514,
        type_vocab: 1,
        hidden: 1024,
        intermediate: 4096,
        layers: 24,
    };
    // (name, parameters, expected parameter count in millions)
    vec![
        ("bert-base", encoder_params(&bert(768, 3072, 12)), 109),
        ("bert-large", encoder_params(&bert(1024, 4096, 24)), 335),
        ("gpt2-small", gpt2_params(768, 12), 124),
        ("gpt2-medium", gpt2_params(1024, 24), 354),
        ("xlm-roberta-large", encoder_params(&xlmr), 559),
    ]
}

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

/// `m` (an [`adamw_manifest`]) laid out as pipeline 4 x data parallel over
/// `world` ranks, the rule of the zoo's `Layout::Pp` (planner/tests/zoo.rs)
/// and of `bench/layouts.py`'s `pp`: parameter `i` of `n` and its optimizer
/// state on stage `4 i / n`, held by the ranks of block `s` of `world / 4`;
/// the `param_groups` object on every rank.
fn pipeline_4_x_dp(m: &Manifest, world: u32) -> Manifest {
    let params = m
        .leaves()
        .iter()
        .filter(|l| l.path.first() == Some(&common::s("model")))
        .count()
        .max(1);
    let mut model_index = 0;
    let leaves = m
        .leaves()
        .iter()
        .map(|l| {
            let i = match l.path.as_slice() {
                [PathKey::Str(o), PathKey::Str(st), PathKey::Int(i), ..]
                    if o == "optim" && st == "state" =>
                {
                    Some(*i as usize)
                }
                [PathKey::Str(o), ..] if o == "model" => {
                    model_index += 1;
                    Some(model_index - 1)
                }
                _ => None,
            };
            let stage = i.map(|i| (4 * i / params).min(3) as u32);
            l.clone().with_holders(stage)
        })
        .collect();
    let groups = (0..4)
        .map(|s| (s * world / 4..(s + 1) * world / 4).collect())
        .collect();
    Manifest::with_groups(leaves, groups).unwrap()
}

/// Issue 46: BERT-base-shaped PP = 4 x DP at 256 ranks and more was reported
/// at 1.0147 of the bound; every model state here under PP x DP, 64 to 4096
/// ranks, one and eight ranks per node, within 1.01.
#[test]
fn balanced_is_within_one_percent_on_pipeline_x_data_parallel() {
    let mut failures = Vec::new();
    let mut worst = (0.0f64, String::new());
    for (name, params, _) in models() {
        let flat = adamw_manifest(&params);
        for ws in [64u64, 256, 1024, 4096] {
            let m = Arc::new(pipeline_4_x_dp(&flat, ws as u32));
            assert_eq!(m.groups().len(), 4);
            for ranks_per_node in [1, 8] {
                let p = plan(
                    m.clone(),
                    ws,
                    Topology { ranks_per_node },
                    CostModel::default(),
                    Algorithm::Balanced,
                )
                .unwrap();
                let st = &p.stats;
                let case = format!(
                    "{name} PP=4 x DP P={ws} ranks_per_node={ranks_per_node}: gap {:.5} (writers {}, splits {}, makespan {:.4} ms, bound {:.4} ms)",
                    st.gap,
                    st.writers,
                    st.splits,
                    st.makespan_s * 1e3,
                    st.lower_bound_s * 1e3
                );
                println!("{case}");
                assert!(st.gap >= 1.0 - 1e-9, "makespan below the bound: {case}");
                for (r, list) in p.ranks.iter().enumerate() {
                    for piece in list {
                        let leaf = &m.leaves()[piece.leaf as usize];
                        assert!(m.holders(leaf).contains(r as u32), "not a holder: {case}");
                    }
                }
                if st.gap > worst.0 {
                    worst = (st.gap, case.clone());
                }
                if st.gap > MAX_GAP {
                    failures.push(case);
                }
            }
        }
    }
    println!("worst: {}", worst.1);
    assert!(
        failures.is_empty(),
        "balanced gap above {MAX_GAP}: {failures:#?}"
    );
}
