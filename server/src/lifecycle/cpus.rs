//! The CPU each executor is pinned to (`--pin`).

/// The CPU each executor is pinned to, among those this process may run on (a container's
/// cpuset, `taskset`): a CPU outside them is refused by a cgroup cpuset, and escapes the
/// operator's `taskset`.
pub fn executor_cpus(executors: usize) -> Vec<usize> {
    assign_cpus(&allowed_cpus(), executors)
}

/// The CPUs this process may run on, in order (every online CPU if that cannot be read).
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: sched_getaffinity fills the zeroed set it is given, of the size given.
    let allowed = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        (libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0).then(
            || {
                (0..libc::CPU_SETSIZE as usize)
                    .filter(|&c| libc::CPU_ISSET(c, &set))
                    .collect::<Vec<_>>()
            },
        )
    };
    allowed
        .filter(|a| !a.is_empty())
        .unwrap_or_else(|| (0..crate::config::online_cpus()).collect())
}

/// Executor i gets an allowed CPU c with c % executors == i where there is one (the
/// connection steering sends a connection to executor `cpu % executors`, the CPU that
/// took its SYN), else the next allowed CPU no executor has; more executors than CPUs
/// share them in turn.
fn assign_cpus(allowed: &[usize], executors: usize) -> Vec<usize> {
    let mut taken = vec![false; allowed.len()];
    let mut out = vec![usize::MAX; executors];
    for (i, cpu) in out.iter_mut().enumerate() {
        if let Some(k) = (0..allowed.len()).find(|&k| !taken[k] && allowed[k] % executors == i) {
            taken[k] = true;
            *cpu = allowed[k];
        }
    }
    for (i, cpu) in out.iter_mut().enumerate() {
        if *cpu != usize::MAX {
            continue;
        }
        *cpu = match (0..allowed.len()).find(|&k| !taken[k]) {
            Some(k) => {
                taken[k] = true;
                allowed[k]
            }
            None => allowed[i % allowed.len()],
        };
    }
    out
}

#[cfg(test)]
mod tests {
    use super::assign_cpus;

    #[test]
    fn executors_get_allowed_cpus_matching_the_steering_where_they_can() {
        assert_eq!(assign_cpus(&[0, 1, 2, 3], 4), [0, 1, 2, 3]);
        // A container's cpuset: each executor i on a CPU with cpu % 4 == i.
        assert_eq!(assign_cpus(&[2, 3, 4, 5], 4), [4, 5, 2, 3]);
        assert_eq!(assign_cpus(&[8, 9], 2), [8, 9]);
        // No CPU of the right residue: the next free one.
        assert_eq!(assign_cpus(&[4, 8], 2), [4, 8]);
        assert_eq!(assign_cpus(&[1], 1), [1]);
        // More executors than CPUs: shared in turn, never outside the set.
        assert_eq!(assign_cpus(&[6, 7], 4), [6, 7, 6, 7]);
    }
}
