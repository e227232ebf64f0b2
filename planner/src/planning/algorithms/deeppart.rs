//! The heuristic of the 2023 thesis, as its abstract describes it:
//! - find the "partition candidate": the sub-collection that dominates the
//!   size, looking through wrapper levels, so the tree's shape does not matter;
//! - partition sub-collections recursively, giving each a number of ranks in
//!   proportion to its size (small siblings are grouped until they make up one
//!   rank's share);
//! - split a single tensor between ranks when it alone gets several.
//!
//! It ignores owned load and per-piece costs; it is here as a baseline.

use std::collections::HashMap;

use crate::model::cost::CostModel;
use crate::model::manifest::{Manifest, PathKey};
use crate::planning::plan::Piece;

/// A node of the path tree of the replicated leaves.
#[derive(Default)]
struct Node {
    bytes: u64,
    children: Vec<usize>,
    leaf: Option<u32>,
}

struct Tree {
    nodes: Vec<Node>,
}

impl Tree {
    fn build(manifest: &Manifest) -> Tree {
        let mut nodes = vec![Node::default()];
        let mut index: HashMap<(usize, &PathKey), usize> = HashMap::new();
        for (i, leaf) in manifest.leaves().iter().enumerate() {
            if !leaf.is_replicated() {
                continue;
            }
            let mut at = 0;
            nodes[0].bytes += leaf.nbytes;
            for key in &leaf.path {
                at = match index.get(&(at, key)) {
                    Some(&n) => n,
                    None => {
                        nodes.push(Node::default());
                        let n = nodes.len() - 1;
                        nodes[at].children.push(n);
                        index.insert((at, key), n);
                        n
                    }
                };
                nodes[at].bytes += leaf.nbytes;
            }
            // A leaf's path is never a prefix of another's in a state tree; if
            // it is, the leaf is kept at its node beside the node's children.
            nodes[at].leaf = Some(i as u32);
        }
        Tree { nodes }
    }

    /// Items directly below `n`: its own leaf (as a pseudo-item) and children.
    fn items(&self, n: usize) -> Vec<Item> {
        let mut items = Vec::new();
        if let Some(l) = self.nodes[n].leaf {
            items.push(Item::Leaf(l));
        }
        items.extend(self.nodes[n].children.iter().map(|&c| Item::Node(c)));
        items
    }

    fn item_bytes(&self, manifest: &Manifest, item: &Item) -> u64 {
        match item {
            Item::Leaf(l) => manifest.leaves()[*l as usize].nbytes,
            Item::Node(n) => {
                let node = &self.nodes[*n];
                let own = node
                    .leaf
                    .map_or(0, |l| manifest.leaves()[l as usize].nbytes);
                if node.children.is_empty() {
                    node.bytes
                } else {
                    node.bytes.max(own)
                }
            }
        }
    }
}

#[derive(Clone, Copy)]
enum Item {
    Node(usize),
    Leaf(u32),
}

pub(super) fn plan(manifest: &Manifest, cost: &CostModel, ranks: &mut [Vec<Piece>]) {
    let tree = Tree::build(manifest);
    if tree.nodes[0].children.is_empty() {
        return;
    }
    let n = ranks.len() as u32;
    assign(manifest, cost, &tree, vec![Item::Node(0)], 0, n, ranks);
}

/// Assigns a group of items to the ranks `[lo, lo + n)`.
fn assign(
    manifest: &Manifest,
    cost: &CostModel,
    tree: &Tree,
    mut items: Vec<Item>,
    lo: u32,
    n: u32,
    ranks: &mut [Vec<Piece>],
) {
    // Look through wrappers: a lone sub-collection is replaced by its items.
    while items.len() == 1 {
        match items[0] {
            Item::Node(node) if n > 1 => {
                let inner = tree.items(node);
                if inner.is_empty() {
                    return;
                }
                items = inner;
            }
            _ => break,
        }
    }
    if n == 1 {
        for item in &items {
            collect_whole(manifest, tree, *item, &mut ranks[lo as usize]);
        }
        return;
    }
    if let [Item::Leaf(l)] = items[..] {
        split_leaf(manifest, cost, l, lo, n, ranks);
        return;
    }
    // Group items, largest first, until each group holds one rank's share.
    let sizes: Vec<u64> = items
        .iter()
        .map(|it| tree.item_bytes(manifest, it))
        .collect();
    let total: u64 = sizes.iter().sum();
    if total == 0 {
        // Nothing to balance; grouping would make one group of everything
        // with all `n` ranks again, and recurse forever.
        for item in &items {
            collect_whole(manifest, tree, *item, &mut ranks[lo as usize]);
        }
        return;
    }
    let mut order: Vec<usize> = (0..items.len()).collect();
    order.sort_by(|&a, &b| sizes[b].cmp(&sizes[a]).then(a.cmp(&b)));
    let share = (total as f64 / n as f64).max(1.0);
    let mut groups: Vec<(Vec<Item>, u64)> = Vec::new();
    let mut current: (Vec<Item>, u64) = (Vec::new(), 0);
    for &k in &order {
        current.0.push(items[k]);
        current.1 += sizes[k];
        if current.1 as f64 >= share {
            groups.push(std::mem::take(&mut current));
        }
    }
    if !current.0.is_empty() {
        let full = groups.len() as u32 >= n;
        match groups.last_mut() {
            Some(last) if full => {
                last.0.extend(current.0);
                last.1 += current.1;
            }
            _ => groups.push(current),
        }
    }
    // Ranks in proportion to size (largest remainder), at least one each.
    let g = groups.len();
    let mut counts: Vec<u32> = vec![1; g];
    let spare = n - g as u32;
    let exact: Vec<f64> = groups
        .iter()
        .map(|(_, b)| {
            if total == 0 {
                0.0
            } else {
                *b as f64 / total as f64 * spare as f64
            }
        })
        .collect();
    let mut given = 0;
    for (c, e) in counts.iter_mut().zip(&exact) {
        *c += e.floor() as u32;
        given += e.floor() as u32;
    }
    let mut by_remainder: Vec<usize> = (0..g).collect();
    by_remainder.sort_by(|&a, &b| {
        (exact[b] - exact[b].floor())
            .total_cmp(&(exact[a] - exact[a].floor()))
            .then(a.cmp(&b))
    });
    for &k in by_remainder.iter().take((spare - given) as usize) {
        counts[k] += 1;
    }
    let mut at = lo;
    for ((group, _), count) in groups.into_iter().zip(counts) {
        assign(manifest, cost, tree, group, at, count, ranks);
        at += count;
    }
}

/// Every leaf under an item, whole, to one rank.
fn collect_whole(manifest: &Manifest, tree: &Tree, item: Item, out: &mut Vec<Piece>) {
    match item {
        Item::Leaf(l) => out.push(super::whole(
            l as usize,
            manifest.leaves()[l as usize].units(),
        )),
        Item::Node(n) => {
            for it in tree.items(n) {
                collect_whole(manifest, tree, it, out);
            }
        }
    }
}

/// One leaf evenly over `n` ranks, in legal pieces (on the cost model's
/// grain, at least `min_piece_bytes`): each rank's piece ends at the last
/// legal cut within its even share of what is left.
fn split_leaf(
    manifest: &Manifest,
    cost: &CostModel,
    l: u32,
    lo: u32,
    n: u32,
    ranks: &mut [Vec<Piece>],
) {
    let leaf = &manifest.leaves()[l as usize];
    let units = leaf.units();
    let mut start = 0;
    for p in 0..n {
        let parts_left = (n - p) as f64;
        let share = leaf.range_bytes(start, units) as f64 / parts_left;
        let stop = if p + 1 < n {
            super::cut(leaf, start, share.ceil(), cost).unwrap_or(units)
        } else {
            units
        };
        ranks[(lo + p) as usize].push(Piece {
            leaf: l,
            start,
            stop,
        });
        start = stop;
        if start >= units {
            break;
        }
    }
}
