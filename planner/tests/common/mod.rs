//! What the model-state tests share: building a model + AdamW manifest
//! from a list of parameter shapes, and the shapes of real models.

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

pub struct Encoder {
    vocab: u64,
    positions: u64,
    type_vocab: u64,
    hidden: u64,
    intermediate: u64,
    layers: u64,
}

/// A BERT/RoBERTa encoder (Hugging Face `BertModel` parameter names and shapes).
pub fn encoder_params(e: &Encoder) -> Params {
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
pub fn gpt2_params(hidden: u64, layers: u64) -> Params {
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

/// The model states of the tests: (name, parameters, published parameter
/// count in millions).
pub fn models() -> Vec<(&'static str, Params, u64)> {
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
