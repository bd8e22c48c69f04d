//! The network interface that reaches the rendezvous host, for Gloo and NCCL.
//!
//! Gloo binds to the address the host's name resolves to; on many machines that is
//! `127.0.0.1` (`/etc/hosts`), and every rank then offers a loopback address to peers on
//! other hosts ("Gloo connectFullMesh failed ... remote=[127.0.0.1]"). Naming the
//! interface (`GLOO_SOCKET_IFNAME`, `NCCL_SOCKET_IFNAME`) fixes it; this finds it.

use std::net::{IpAddr, SocketAddr, ToSocketAddrs, UdpSocket};

use crate::{Error, Result};

/// The variables that name the interface, Gloo's then NCCL's.
pub const SOCKET_IFNAME_VARS: [&str; 2] = ["GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"];

/// An interface chosen for the ranks, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SocketInterface {
    /// The interface's name (`eth0`).
    pub name: String,
    /// Its address on the route to the master.
    pub local: IpAddr,
    /// The variables to set (those the user did not set), with the name.
    pub set: Vec<(&'static str, String)>,
}

impl std::fmt::Display for SocketInterface {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let vars: Vec<String> = self.set.iter().map(|(k, v)| format!("{k}={v}")).collect();
        write!(
            f,
            "{} (the interface whose route reaches the master, address {}; this host's name \
             resolves to a loopback address, which peers on other hosts cannot reach)",
            vars.join(" "),
            self.local
        )
    }
}

/// The interface to name for ranks that meet at `master_addr`, when one must be named:
/// `GLOO_SOCKET_IFNAME` unset, `master_addr` not a loopback address, and this host's
/// name resolving to one. `None` when nothing needs setting (a user's own setting
/// always wins); an error naming `master_addr` when no interface reaches it.
pub fn socket_interface_for(master_addr: &str) -> Result<Option<SocketInterface>> {
    let user_set = |v: &str| std::env::var_os(v).is_some_and(|s| !s.is_empty());
    if user_set(SOCKET_IFNAME_VARS[0]) {
        return Ok(None);
    }
    let master = resolve(master_addr).ok_or_else(|| {
        Error::Launch(format!(
            "MASTER_ADDR {master_addr:?} does not resolve to an address: give the first \
             node's address or a name this host resolves"
        ))
    })?;
    if master.is_loopback() || !hostname_is_loopback() {
        return Ok(None);
    }
    let (name, local) = route_to(master).ok_or_else(|| {
        Error::Launch(format!(
            "no network interface of this host reaches MASTER_ADDR {master_addr} ({master}): \
             check the address and this host's routes (`ip route get {master}`), or name the \
             interface with GLOO_SOCKET_IFNAME"
        ))
    })?;
    let set = SOCKET_IFNAME_VARS
        .iter()
        .filter(|v| !user_set(v))
        .map(|v| (*v, name.clone()))
        .collect();
    Ok(Some(SocketInterface { name, local, set }))
}

fn resolve(host: &str) -> Option<IpAddr> {
    (host, 0).to_socket_addrs().ok()?.map(|a| a.ip()).next()
}

/// This host's name (`gethostname`).
pub(crate) fn host_name() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } != 0 {
        return None;
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    Some(String::from_utf8_lossy(&buf[..end]).into_owned())
}

/// Whether this host's name resolves to a loopback address (or does not resolve).
fn hostname_is_loopback() -> bool {
    let Some(name) = host_name() else {
        return true;
    };
    match (name.as_str(), 0).to_socket_addrs() {
        Ok(mut addrs) => addrs.next().is_none_or(|a| a.ip().is_loopback()),
        Err(_) => true,
    }
}

/// The local interface (name, address) the kernel routes `to` through: a UDP socket
/// connected there (no packet is sent) tells the source address, and the interface
/// holding it is the one.
fn route_to(to: IpAddr) -> Option<(String, IpAddr)> {
    let any: SocketAddr = if to.is_ipv4() {
        "0.0.0.0:0".parse().ok()?
    } else {
        "[::]:0".parse().ok()?
    };
    let socket = UdpSocket::bind(any).ok()?;
    socket.connect(SocketAddr::new(to, 9)).ok()?;
    let local = socket.local_addr().ok()?.ip();
    interface_with(local).map(|name| (name, local))
}

/// The name of the interface that holds `addr` (`getifaddrs`).
fn interface_with(addr: IpAddr) -> Option<String> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs allocates the list and writes its head; freed below.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return None;
    }
    let mut found = None;
    let mut cur = list;
    while !cur.is_null() {
        // SAFETY: cur is a node of the list getifaddrs returned, not yet freed.
        let entry = unsafe { &*cur };
        // SAFETY: ifa_addr, when not null, points to a sockaddr of the family it says.
        let ip = unsafe { sockaddr_ip(entry.ifa_addr) };
        if ip == Some(addr) && !entry.ifa_name.is_null() {
            // SAFETY: ifa_name is a NUL-terminated string owned by the list.
            let name = unsafe { std::ffi::CStr::from_ptr(entry.ifa_name) };
            found = Some(name.to_string_lossy().into_owned());
            break;
        }
        cur = entry.ifa_next;
    }
    // SAFETY: the list came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(list) };
    found
}

/// The IP address of a `sockaddr` of family `AF_INET` or `AF_INET6`.
///
/// # Safety
/// `sa` is null or points to a valid `sockaddr` of the family its `sa_family` says.
unsafe fn sockaddr_ip(sa: *const libc::sockaddr) -> Option<IpAddr> {
    if sa.is_null() {
        return None;
    }
    // SAFETY: the caller's contract.
    match i32::from(unsafe { (*sa).sa_family }) {
        libc::AF_INET => {
            // SAFETY: the family says it is a sockaddr_in.
            let v4 = unsafe { &*(sa as *const libc::sockaddr_in) };
            Some(IpAddr::from(u32::from_be(v4.sin_addr.s_addr).to_be_bytes()))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says it is a sockaddr_in6.
            let v6 = unsafe { &*(sa as *const libc::sockaddr_in6) };
            Some(IpAddr::from(v6.sin6_addr.s6_addr))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_loopback_route_is_the_loopback_interface() {
        let (name, local) = route_to("127.0.0.1".parse().unwrap()).unwrap();
        assert_eq!(local, "127.0.0.1".parse::<IpAddr>().unwrap());
        assert_eq!(name, "lo");
        // A loopback master needs no interface named.
        assert_eq!(socket_interface_for("127.0.0.1").unwrap(), None);
        assert!(socket_interface_for("no-such-host.invalid").is_err());
    }
}
