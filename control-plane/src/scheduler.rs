//! Placement of N children across executors: a pure function of the executors' free slots and
//! of which of them already hold the snapshot, so it is tested without any server.

/// An executor that may take children.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub id: String,
    /// Slots left (its limit minus the children it runs or is starting).
    pub free: u32,
    /// It holds the snapshot already (no transfer before the first child can start).
    pub has_snapshot: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Policy {
    /// Balance children across executors (most free slots first).
    #[default]
    Spread,
    /// Fill the fullest executor that still has room before using the next.
    Pack,
}

/// What fetching a snapshot costs an executor that lacks it, in free slots: under `Spread`, a
/// non-holder gets a child once it has this many more free slots than the best holder.
/// Locality is a cost, not a filter (the caller only offers non-holders when the snapshot is
/// in the store).
pub const FETCH_COST_SLOTS: u32 = 2;

/// For each of `n` children, the index of the candidate it goes to, or None when no capacity
/// is left (the caller reports those children as failed; none is dropped silently).
/// `Pack` fills holders first; `Spread` balances free slots, counting a non-holder's slots
/// less by [`FETCH_COST_SLOTS`].
pub fn place(n: u32, candidates: &[Candidate], policy: Policy) -> Vec<Option<usize>> {
    let mut free: Vec<u32> = candidates.iter().map(|c| c.free).collect();
    let mut out = Vec::with_capacity(n as usize);
    let pack_order = {
        let mut idx: Vec<usize> = (0..candidates.len()).collect();
        // Snapshot holders first; among them the fullest first; ids break ties.
        idx.sort_by(|&a, &b| {
            let (ca, cb) = (&candidates[a], &candidates[b]);
            cb.has_snapshot
                .cmp(&ca.has_snapshot)
                .then(ca.free.cmp(&cb.free))
                .then(ca.id.cmp(&cb.id))
        });
        idx
    };
    for _ in 0..n {
        let pick = match policy {
            Policy::Pack => pack_order.iter().copied().find(|&i| free[i] > 0),
            Policy::Spread => {
                let score = |i: usize| {
                    let cost = if candidates[i].has_snapshot {
                        0
                    } else {
                        FETCH_COST_SLOTS
                    };
                    i64::from(free[i]) - i64::from(cost)
                };
                (0..candidates.len())
                    .filter(|&i| free[i] > 0)
                    .max_by(|&a, &b| {
                        let (ca, cb) = (&candidates[a], &candidates[b]);
                        score(a)
                            .cmp(&score(b))
                            .then(ca.has_snapshot.cmp(&cb.has_snapshot))
                            .then(cb.id.cmp(&ca.id))
                    })
            }
        };
        if let Some(i) = pick {
            free[i] -= 1;
        }
        out.push(pick);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(id: &str, free: u32, has: bool) -> Candidate {
        Candidate {
            id: id.into(),
            free,
            has_snapshot: has,
        }
    }

    fn counts(p: &[Option<usize>], k: usize) -> Vec<usize> {
        (0..k)
            .map(|i| p.iter().filter(|x| **x == Some(i)).count())
            .collect()
    }

    #[test]
    fn spread_balances_with_locality_as_a_cost() {
        let cands = [c("a", 10, true), c("b", 10, true), c("c", 10, false)];
        // The non-holder joins once the holders are FETCH_COST_SLOTS fuller than it.
        let p = place(8, &cands, Policy::Spread);
        assert_eq!(counts(&p, 3), vec![4, 3, 1]);
        let p = place(25, &cands, Policy::Spread);
        assert_eq!(counts(&p, 3), vec![9, 9, 7]);
        // Holders full: the rest go to the non-holder rather than failing.
        let cands = [c("a", 2, true), c("c", 10, false)];
        assert_eq!(counts(&place(9, &cands, Policy::Spread), 2), vec![2, 7]);
    }

    #[test]
    fn spread_evens_out_unequal_load() {
        let cands = [c("a", 2, true), c("b", 6, true)];
        let p = place(6, &cands, Policy::Spread);
        // b alone until both have 2 left, then alternating (ties to the smaller id).
        assert_eq!(counts(&p, 2), vec![1, 5]);
        assert_eq!(&p[..5], &[Some(1), Some(1), Some(1), Some(1), Some(0)]);
    }

    #[test]
    fn pack_fills_the_fullest_holder_first() {
        let cands = [c("a", 5, true), c("b", 2, true), c("c", 1, false)];
        let p = place(4, &cands, Policy::Pack);
        assert_eq!(p, vec![Some(1), Some(1), Some(0), Some(0)]);
    }

    #[test]
    fn overflow_is_reported_per_child() {
        let cands = [c("a", 1, true), c("b", 1, false)];
        let p = place(4, &cands, Policy::Spread);
        assert_eq!(p, vec![Some(0), Some(1), None, None]);
        assert_eq!(place(2, &[], Policy::Pack), vec![None, None]);
    }
}
