//! The rendezvous port a job's rank 0 listens on.

use std::net::TcpListener;

use crate::{Error, Result};

/// A free TCP port on `addr` (and on every interface, where the ranks' store listens),
/// for a job's rendezvous.
///
/// Picked outside the kernel's ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`,
/// 32768-60999 by default) where it can be: a port is only checked free here and taken
/// later by rank 0, and in between any outgoing connection on the host may be given an
/// ephemeral port, the one just checked included (a busy host then failed rank 0 with
/// `EADDRINUSE`). Outside that range only an explicit bind can take it. Where the range
/// covers every port, the kernel's own pick (`bind` to port 0), as torchrun does.
pub fn free_port(addr: &str) -> Result<u16> {
    pick_port(addr).map_err(|source| Error::Io {
        what: format!("finding a free port on {addr}"),
        cause: source,
    })
}

/// [`free_port`]'s search, with the system's error.
pub(crate) fn pick_port(addr: &str) -> std::io::Result<u16> {
    use std::hash::{BuildHasher, Hasher};
    let free = |port: u16| {
        TcpListener::bind((addr, port)).is_ok() && TcpListener::bind(("0.0.0.0", port)).is_ok()
    };
    let outside = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|text| parse_port_range(&text))
        .map(ports_outside)
        .unwrap_or_default();
    if !outside.is_empty() {
        // A random start (std's hasher keys are random per process), then up to 64
        // ports from there: two launchers starting together do not try the same ones.
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u32(std::process::id());
        let start = hasher.finish() as usize;
        let found = (0..64)
            .map(|i| outside[start.wrapping_add(i * 7919) % outside.len()])
            .find(|&port| free(port));
        if let Some(port) = found {
            return Ok(port);
        }
    }
    TcpListener::bind((addr, 0))?.local_addr().map(|a| a.port())
}

/// `ip_local_port_range`'s two numbers.
fn parse_port_range(text: &str) -> Option<(u16, u16)> {
    let mut it = text.split_whitespace().map(|n| n.parse::<u16>().ok());
    let (lo, hi) = (it.next()??, it.next()??);
    (lo <= hi).then_some((lo, hi))
}

/// The unprivileged ports (1024 and up) outside the ephemeral range `(lo, hi)`.
fn ports_outside((lo, hi): (u16, u16)) -> Vec<u16> {
    (1024..=u16::MAX).filter(|&p| p < lo || p > hi).collect()
}

#[cfg(test)]
mod tests {
    use super::{free_port, parse_port_range, ports_outside};
    use std::net::TcpListener;

    #[test]
    fn a_rendezvous_port_is_picked_outside_the_ephemeral_range() {
        assert_eq!(parse_port_range("32768\t60999\n"), Some((32768, 60999)));
        assert_eq!(parse_port_range("60999 32768"), None);
        assert_eq!(parse_port_range("x"), None);
        let outside = ports_outside((32768, 60999));
        assert_eq!(outside.first(), Some(&1024));
        assert!(outside.contains(&32767) && outside.contains(&61000));
        assert!(!outside.contains(&32768) && !outside.contains(&60999));
        assert_eq!(outside.last(), Some(&u16::MAX));
        // The whole range ephemeral: nothing outside (the kernel picks then).
        assert!(ports_outside((1024, u16::MAX)).is_empty());
        // On this host: outside the range, and free on the address and everywhere.
        let port = free_port("127.0.0.1").unwrap();
        let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|t| parse_port_range(&t));
        if let Some((lo, hi)) = range.filter(|&r| !ports_outside(r).is_empty()) {
            assert!(port < lo || port > hi, "{port} in {lo}-{hi}");
        }
        let _taken = TcpListener::bind(("0.0.0.0", port)).unwrap();
    }
}
