//! Connection steering: one SO_REUSEPORT listener per executor, and a BPF program on
//! the group that picks which executor's socket takes each new connection.
//!
//! Both programs send a connection to the executor pinned to the CPU that took its SYN,
//! so the softirq, the executor and the reply share one core: eBPF first (a
//! socket-filter program loaded with the bpf(2) syscall, `bpf_get_smp_processor_id()`
//! modulo the executors), classic BPF where eBPF is refused (`SKF_AD_CPU`), plain
//! SO_REUSEPORT hashing where both are. Each fallback is logged once.

use std::io;
use std::os::fd::{AsRawFd, RawFd};

use crate::config::Steering;

const SO_ATTACH_REUSEPORT_CBPF: libc::c_int = 51;
const SO_ATTACH_REUSEPORT_EBPF: libc::c_int = 52;
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_TYPE_SOCKET_FILTER: u32 = 1;
const BPF_FUNC_GET_SMP_PROCESSOR_ID: i32 = 8;

/// One eBPF instruction, as `struct bpf_insn`.
#[repr(C)]
#[derive(Clone, Copy)]
struct Insn {
    code: u8,
    regs: u8,
    off: i16,
    imm: i32,
}

/// `r0 = bpf_get_smp_processor_id() % executors; return r0` — the index into the group
/// (executor i is pinned to CPU i modulo the CPUs).
fn ebpf_program(executors: u32) -> [Insn; 3] {
    [
        Insn {
            code: 0x85,
            regs: 0,
            off: 0,
            imm: BPF_FUNC_GET_SMP_PROCESSOR_ID,
        }, // call
        Insn {
            code: 0x97,
            regs: 0,
            off: 0,
            imm: executors as i32,
        }, // r0 %= imm (alu64)
        Insn {
            code: 0x95,
            regs: 0,
            off: 0,
            imm: 0,
        }, // exit
    ]
}

/// Loads the eBPF program; the returned fd is closed when dropped.
fn load_ebpf(executors: u32) -> io::Result<std::os::fd::OwnedFd> {
    let prog = ebpf_program(executors);
    let license = b"GPL\0";
    // union bpf_attr, BPF_PROG_LOAD layout: prog_type, insn_cnt, insns, license, ...
    let mut attr = [0u8; 128];
    attr[0..4].copy_from_slice(&BPF_PROG_TYPE_SOCKET_FILTER.to_ne_bytes());
    attr[4..8].copy_from_slice(&(prog.len() as u32).to_ne_bytes());
    attr[8..16].copy_from_slice(&(prog.as_ptr() as u64).to_ne_bytes());
    attr[16..24].copy_from_slice(&(license.as_ptr() as u64).to_ne_bytes());
    attr[48..56].copy_from_slice(b"kvix_cpu");
    // SAFETY: attr is a valid bpf_attr for BPF_PROG_LOAD; the pointers outlive the call.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_PROG_LOAD,
            attr.as_ptr(),
            attr.len() as u32,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel returned a fresh fd that nothing else owns.
    Ok(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as RawFd) })
}

fn setsockopt<T>(fd: RawFd, opt: libc::c_int, value: &T) -> io::Result<()> {
    // SAFETY: value points at a live T of the size passed.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            opt,
            (value as *const T).cast(),
            std::mem::size_of::<T>() as u32,
        )
    };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn attach_ebpf(fd: RawFd, executors: u32) -> io::Result<()> {
    let prog = load_ebpf(executors)?;
    // The socket group keeps its own reference; our fd may close after attaching.
    setsockopt(fd, SO_ATTACH_REUSEPORT_EBPF, &prog.as_raw_fd())
}

fn attach_cbpf(fd: RawFd, executors: u32) -> io::Result<()> {
    // A = cpu; A %= executors; return A
    let filter = [
        libc::sock_filter {
            code: 0x20,
            jt: 0,
            jf: 0,
            k: (-0x1000i32 + 36) as u32,
        }, // ld [SKF_AD_CPU]
        libc::sock_filter {
            code: 0x94,
            jt: 0,
            jf: 0,
            k: executors,
        }, // alu mod k
        libc::sock_filter {
            code: 0x16,
            jt: 0,
            jf: 0,
            k: 0,
        }, // ret a
    ];
    let prog = libc::sock_fprog {
        len: filter.len() as u16,
        filter: filter.as_ptr() as *mut _,
    };
    setsockopt(fd, SO_ATTACH_REUSEPORT_CBPF, &prog)
}

/// Attaches the best steering at or below `wanted` to the group of `fd`; returns what
/// is in force. `ebpf`/`cbpf` are the attach steps (replaced in tests to force refusals).
pub fn attach_with(
    fd: RawFd,
    executors: u32,
    wanted: Steering,
    ebpf: impl Fn(RawFd, u32) -> io::Result<()>,
    cbpf: impl Fn(RawFd, u32) -> io::Result<()>,
) -> Steering {
    if executors <= 1 {
        return Steering::None;
    }
    if wanted == Steering::Ebpf {
        match ebpf(fd, executors) {
            Ok(()) => return Steering::Ebpf,
            Err(e) => tracing::warn!(
                "eBPF connection steering refused ({e}); falling back to classic BPF"
            ),
        }
    }
    if wanted != Steering::None {
        match cbpf(fd, executors) {
            Ok(()) => return Steering::Cbpf,
            Err(e) => tracing::warn!(
                "classic BPF connection steering refused ({e}); using plain SO_REUSEPORT"
            ),
        }
    }
    Steering::None
}

/// Attaches steering with the real kernel calls.
pub fn attach(fd: RawFd, executors: u32, wanted: Steering) -> Steering {
    attach_with(fd, executors, wanted, attach_ebpf, attach_cbpf)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refuse(_: RawFd, _: u32) -> io::Result<()> {
        Err(io::Error::from_raw_os_error(libc::EPERM))
    }
    fn accept(_: RawFd, _: u32) -> io::Result<()> {
        Ok(())
    }

    #[test]
    fn refusals_fall_back_one_step_at_a_time() {
        assert_eq!(
            attach_with(3, 2, Steering::Ebpf, accept, refuse),
            Steering::Ebpf
        );
        assert_eq!(
            attach_with(3, 2, Steering::Ebpf, refuse, accept),
            Steering::Cbpf
        );
        assert_eq!(
            attach_with(3, 2, Steering::Ebpf, refuse, refuse),
            Steering::None
        );
        assert_eq!(
            attach_with(3, 2, Steering::Cbpf, accept, refuse),
            Steering::None
        );
        assert_eq!(
            attach_with(3, 2, Steering::None, accept, accept),
            Steering::None
        );
        assert_eq!(
            attach_with(3, 1, Steering::Ebpf, accept, accept),
            Steering::None
        );
    }

    fn group(n: usize) -> Vec<socket2::Socket> {
        let mut socks = Vec::new();
        let mut addr: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
        for _ in 0..n {
            let s =
                socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
            s.set_reuse_port(true).unwrap();
            s.bind(&addr.into()).unwrap();
            s.listen(128).unwrap();
            addr = s.local_addr().unwrap().as_socket().unwrap();
            socks.push(s);
        }
        socks
    }

    /// Pins the calling thread to one CPU.
    fn pin(cpu: usize) {
        // SAFETY: a zeroed cpu_set_t with one bit set, for this thread (pid 0).
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            assert_eq!(
                libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set),
                0
            );
        }
    }

    /// The real kernel paths: where the kernel accepts a program, a connection made from
    /// CPU c lands on socket c (its SYN is processed on c, on loopback); where it refuses,
    /// the fallback is reported and connections still land somewhere.
    #[test]
    fn real_programs_steer_by_cpu_or_fall_back_and_connections_still_land() {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        for wanted in [Steering::Ebpf, Steering::Cbpf] {
            let socks = group(2);
            let got = attach(socks[0].as_raw_fd(), 2, wanted);
            assert!(
                got == wanted || got != Steering::Ebpf,
                "never reports more than asked"
            );
            let addr = socks[0].local_addr().unwrap().as_socket().unwrap();
            for s in &socks {
                s.set_nonblocking(true).unwrap();
            }
            let mut made = 0;
            for cpu in 0..cpus.min(2) {
                let conns = std::thread::spawn(move || {
                    pin(cpu);
                    (0..8)
                        .map(|_| std::net::TcpStream::connect(addr).unwrap())
                        .collect::<Vec<_>>()
                })
                .join()
                .unwrap();
                made += conns.len();
                let landed: Vec<usize> = socks
                    .iter()
                    .map(|s| std::iter::from_fn(|| s.accept().ok()).count())
                    .collect();
                assert_eq!(landed.iter().sum::<usize>(), conns.len(), "{landed:?}");
                if got != Steering::None {
                    assert_eq!(
                        landed[cpu % 2],
                        conns.len(),
                        "{got:?}: connections from CPU {cpu} landed {landed:?}"
                    );
                }
            }
            assert!(made > 0);
        }
    }
}
