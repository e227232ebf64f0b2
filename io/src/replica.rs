//! Replica digests: a hash of every leaf of a rank's copy of the replicated
//! state, so that ranks can find the leaves on which their copies differ
//! (data-parallel replicas that silently diverged) by exchanging a few
//! bytes per leaf instead of the state.

/// Bytes of one leaf digest: a truncated BLAKE3 hash. 128 bits make an
/// accidental collision between two differing replicas negligible.
pub const DIGEST_LEN: usize = 16;

/// States smaller than this are hashed on the calling thread only.
const PARALLEL_BYTES: usize = 1 << 20;

/// The digest of one leaf's bytes.
pub fn leaf_digest(bytes: &[u8]) -> [u8; DIGEST_LEN] {
    let mut out = [0u8; DIGEST_LEN];
    out.copy_from_slice(&blake3::hash(bytes).as_bytes()[..DIGEST_LEN]);
    out
}

/// The digests of `leaves`, concatenated in order (`DIGEST_LEN` bytes
/// each), spread over at most `threads` threads (at least one). Leaves are
/// given to the threads whole, largest first, so the result does not
/// depend on `threads`.
pub fn leaf_digests(leaves: &[&[u8]], threads: usize) -> Vec<u8> {
    let mut out = vec![0u8; leaves.len() * DIGEST_LEN];
    let total: usize = leaves.iter().map(|l| l.len()).sum();
    let threads = threads.max(1).min(leaves.len().max(1));
    if threads == 1 || total < PARALLEL_BYTES {
        for (leaf, slot) in leaves.iter().zip(out.chunks_exact_mut(DIGEST_LEN)) {
            slot.copy_from_slice(&leaf_digest(leaf));
        }
        return out;
    }
    // Longest-processing-time assignment of whole leaves to threads.
    let mut order: Vec<usize> = (0..leaves.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(leaves[i].len()));
    let mut load = vec![0usize; threads];
    let mut groups: Vec<Vec<usize>> = vec![Vec::new(); threads];
    for i in order {
        let t = (0..threads).min_by_key(|&t| (load[t], t)).unwrap_or(0);
        load[t] += leaves[i].len();
        groups[t].push(i);
    }
    let digests: Vec<Vec<(usize, [u8; DIGEST_LEN])>> = std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .iter()
            .map(|group| {
                s.spawn(move || {
                    group
                        .iter()
                        .map(|&i| (i, leaf_digest(leaves[i])))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a hashing thread panicked"))
            .collect()
    });
    for (i, d) in digests.into_iter().flatten() {
        out[i * DIGEST_LEN..(i + 1) * DIGEST_LEN].copy_from_slice(&d);
    }
    out
}

/// For every leaf on which the ranks' digests (`per_rank[r]`: rank `r`'s
/// concatenated digests) differ: the leaf and the ranks that differ from
/// the majority (ties: from the group holding the lowest rank). Ranks whose
/// digest list has another length differ on every leaf.
pub fn differing_leaves(per_rank: &[&[u8]], leaves: usize) -> Vec<(usize, Vec<usize>)> {
    let mut out = Vec::new();
    for leaf in 0..leaves {
        let digest = |r: usize| -> Option<&[u8]> {
            let d = per_rank[r];
            (d.len() == leaves * DIGEST_LEN).then(|| &d[leaf * DIGEST_LEN..(leaf + 1) * DIGEST_LEN])
        };
        // Groups of ranks with equal digests, in order of their lowest rank.
        let mut groups: Vec<(Option<&[u8]>, Vec<usize>)> = Vec::new();
        for r in 0..per_rank.len() {
            let d = digest(r);
            match groups.iter_mut().find(|(g, _)| d.is_some() && *g == d) {
                Some((_, ranks)) => ranks.push(r),
                None => groups.push((d, vec![r])),
            }
        }
        if groups.len() <= 1 {
            continue;
        }
        let majority = groups
            .iter()
            .enumerate()
            .max_by_key(|(i, (_, ranks))| (ranks.len(), std::cmp::Reverse(*i)))
            .map(|(i, _)| i)
            .unwrap_or(0);
        let mut differ: Vec<usize> = groups
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != majority)
            .flat_map(|(_, (_, ranks))| ranks.iter().copied())
            .collect();
        differ.sort_unstable();
        out.push((leaf, differ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_do_not_depend_on_threads() {
        let big = vec![7u8; 3 << 20];
        let small = vec![1u8; 10];
        let leaves: Vec<&[u8]> = vec![&big, &small, &big[..1 << 20], &[]];
        let one = leaf_digests(&leaves, 1);
        assert_eq!(one.len(), 4 * DIGEST_LEN);
        assert_eq!(leaf_digests(&leaves, 3), one);
        assert_eq!(&one[..DIGEST_LEN], &leaf_digest(&big));
        assert_ne!(&one[..DIGEST_LEN], &one[2 * DIGEST_LEN..3 * DIGEST_LEN]);
    }

    #[test]
    fn one_changed_byte_changes_the_digest() {
        let a = vec![0u8; 1000];
        let mut b = a.clone();
        b[999] = 1;
        assert_ne!(leaf_digest(&a), leaf_digest(&b));
    }

    #[test]
    fn differing_leaves_names_the_minority() {
        let same = leaf_digests(&[b"x", b"y"], 1);
        let changed = leaf_digests(&[b"x", b"z"], 1);
        let ranks: Vec<&[u8]> = vec![&same, &same, &changed, &same];
        assert_eq!(differing_leaves(&ranks, 2), vec![(1, vec![2])]);
        assert!(differing_leaves(&[&same, &same], 2).is_empty());
        // A tie: the group without rank 0 differs.
        assert_eq!(differing_leaves(&[&same, &changed], 2), vec![(1, vec![1])]);
        // A rank with another number of leaves differs everywhere.
        let short = leaf_digests(&[b"x"], 1);
        assert_eq!(
            differing_leaves(&[&same, &same, &short], 2),
            vec![(0, vec![2]), (1, vec![2])]
        );
    }
}
