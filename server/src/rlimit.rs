//! Open files: the soft limit is raised to the hard one at start.
//!
//! A client connection takes one descriptor and an event source about four (its TCP
//! connection and libzmq's mailbox per socket), so the common soft limit of 1,024 runs
//! out long before `--max-connections` or `--max-sources`; the hard limit is what the
//! operator allowed.

/// Descriptors the configured limits may need at once: every executor's connections,
/// every source, and a margin for files, listeners and the metrics endpoint.
pub fn wanted(executors: usize, max_connections: usize, max_sources: usize) -> u64 {
    (executors * max_connections + 4 * max_sources + 256) as u64
}

/// Raises the soft limit on open files to the hard one; returns (before, after).
pub fn raise_open_files() -> std::io::Result<(u64, u64)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit / setrlimit fill and read a struct owned here.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let before = lim.rlim_cur;
    if lim.rlim_cur < lim.rlim_max {
        lim.rlim_cur = lim.rlim_max;
        // SAFETY: as above.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok((before, lim.rlim_cur))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_limit_reaches_the_hard_one() {
        let (before, after) = raise_open_files().unwrap();
        assert!(after >= before);
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: reads into a struct owned here.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
        assert_eq!((lim.rlim_cur, after), (lim.rlim_max, lim.rlim_max));
    }
}
