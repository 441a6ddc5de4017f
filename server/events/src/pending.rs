//! The tokens of an unfinished lane block, as one engine block sees them.
//!
//! Pages smaller than a lane block (SGLang's page of 1 token under a lane of hundreds)
//! each remember the tokens since the last lane-block boundary, so that a store naming
//! any of them as its parent can continue the block. Copied per page that is quadratic in
//! the pages of a lane block (65,536 one-token pages of one lane block would keep 8 GiB).
//! Instead the pages of one lane block share a buffer and each sees its first `len`
//! tokens: a page continuing the newest appends in place, one continuing an older page
//! (a branch) copies what that page sees first. The buffer only grows, so a view never
//! changes under anyone.

use std::cell::RefCell;
use std::rc::Rc;

/// See the module docs. Empty (no buffer) at a lane-block boundary.
#[derive(Debug, Clone, Default)]
pub struct Pending {
    buf: Option<Rc<RefCell<Vec<u32>>>>,
    len: usize,
}

impl Pending {
    pub fn from_tokens(tokens: &[u32]) -> Self {
        let mut p = Pending::default();
        p.push(tokens);
        p
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Appends `tokens` to what this view sees.
    pub fn push(&mut self, tokens: &[u32]) {
        if tokens.is_empty() {
            return;
        }
        match &self.buf {
            Some(b) if b.borrow().len() == self.len => b.borrow_mut().extend_from_slice(tokens),
            _ => {
                let mut v = Vec::with_capacity(self.len + tokens.len());
                self.with(|seen| v.extend_from_slice(seen));
                v.extend_from_slice(tokens);
                self.buf = Some(Rc::new(RefCell::new(v)));
            }
        }
        self.len += tokens.len();
    }

    /// Calls `f` with the tokens this view sees.
    pub fn with<R>(&self, f: impl FnOnce(&[u32]) -> R) -> R {
        match &self.buf {
            Some(b) => f(&b.borrow()[..self.len]),
            None => f(&[]),
        }
    }

    pub fn to_vec(&self) -> Vec<u32> {
        self.with(<[u32]>::to_vec)
    }

    /// Whether this view and `other` share a buffer.
    #[cfg(test)]
    pub fn shares(&self, other: &Pending) -> bool {
        matches!((&self.buf, &other.buf), (Some(a), Some(b)) if Rc::ptr_eq(a, b))
    }
}

/// Rebuilds shared views from plain token lists (a restored snapshot): a list that is a
/// prefix of a longer one of the same lane block shares its buffer. `lists` are the
/// views of one lane block; returns one view per list, in order.
pub fn share(lists: &[&[u32]]) -> Vec<Pending> {
    let mut order: Vec<usize> = (0..lists.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(lists[i].len()));
    let mut bufs: Vec<Pending> = Vec::new();
    let mut out = vec![Pending::default(); lists.len()];
    for i in order {
        let tokens = lists[i];
        if tokens.is_empty() {
            continue;
        }
        let view = bufs
            .iter()
            .find(|b| b.with(|seen| seen.starts_with(tokens)))
            .map(|b| Pending {
                buf: b.buf.clone(),
                len: tokens.len(),
            });
        out[i] = view.unwrap_or_else(|| {
            let p = Pending::from_tokens(tokens);
            bufs.push(p.clone());
            p
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_of_one_lane_block_share_a_buffer_and_a_branch_copies() {
        let mut a = Pending::from_tokens(&[1, 2]);
        let mut b = a.clone();
        b.push(&[3]);
        let mut c = b.clone();
        c.push(&[4, 5]);
        assert!(a.shares(&b) && b.shares(&c));
        assert_eq!(
            (a.to_vec(), b.to_vec(), c.to_vec()),
            (vec![1, 2], vec![1, 2, 3], vec![1, 2, 3, 4, 5])
        );
        // Continuing `a` again is a branch: it copies, and nobody's view changes.
        a.push(&[9]);
        assert!(!a.shares(&b));
        assert_eq!(
            (a.to_vec(), b.to_vec(), c.to_vec()),
            (vec![1, 2, 9], vec![1, 2, 3], vec![1, 2, 3, 4, 5])
        );
    }

    #[test]
    fn restored_lists_share_where_one_is_a_prefix_of_another() {
        let lists: [&[u32]; 5] = [&[1], &[1, 2, 3], &[], &[1, 2], &[1, 7]];
        let views = share(&lists);
        for (v, l) in views.iter().zip(lists) {
            assert_eq!(v.to_vec(), l);
        }
        assert!(views[0].shares(&views[1]) && views[3].shares(&views[1]));
        assert!(!views[4].shares(&views[1]));
    }

    #[test]
    fn memory_stays_linear_in_the_pages_of_a_lane_block() {
        // 4,096 one-token pages, each continuing the one before: one buffer in all.
        let mut views = vec![Pending::from_tokens(&[0])];
        for t in 1..4096 {
            let mut next = views.last().unwrap().clone();
            next.push(&[t]);
            views.push(next);
        }
        assert!(views.iter().all(|v| v.shares(&views[0])));
        assert_eq!(views[4095].to_vec(), (0..4096).collect::<Vec<u32>>());
        assert_eq!(views[10].to_vec(), (0..11).collect::<Vec<u32>>());
    }
}
