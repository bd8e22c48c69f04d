//! `serve --peer URL`: other servers' pages shown on this one. Each peer's
//! `/api/state` is read on a thread of its own, every [`PEER_EVERY`], within
//! [`CONNECT_WITHIN`] and [`ANSWER_WITHIN`] and of a bounded size; the page
//! shows each under its name, and a peer that does not answer as such, with why.
//! `serve` gives the schema it reads and the most bytes of a state ([`Expect`]).

use std::io::{Read as _, Write as _};
use std::net::{TcpStream, ToSocketAddrs};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

/// What a peer's state must be: of `schema`, at most `max_bytes` long.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Expect {
    pub(crate) schema: u32,
    pub(crate) max_bytes: usize,
}

/// How often each peer is read.
const PEER_EVERY: Duration = Duration::from_secs(2);
/// The longest a peer may take to accept a connection.
const CONNECT_WITHIN: Duration = Duration::from_secs(2);
/// The longest a peer may take to answer whole, once connected.
const ANSWER_WITHIN: Duration = Duration::from_secs(5);
/// The most bytes of an answer's head (its status line and headers).
const MAX_HEAD: usize = 64 << 10;
/// The most peers one page shows.
const MAX_PEERS: usize = 64;
/// `serve`'s port, when a peer's URL names none.
const DEFAULT_PORT: u16 = 9836;

/// Another server, as `--peer http://HOST:PORT` names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Peer {
    host: String,
    port: u16,
}

impl Peer {
    /// Its URL, as the page shows it.
    fn url(&self) -> String {
        if self.host.contains(':') {
            format!("http://[{}]:{}", self.host, self.port)
        } else {
            format!("http://{}:{}", self.host, self.port)
        }
    }
}

/// A peer's URL, checked: `http://HOST[:PORT][/]` (an IPv6 address in brackets), the
/// port `serve`'s own by default.
pub(crate) fn parse(text: &str) -> Result<Peer, String> {
    let how = "a peer is another `torchtools serve`, named as http://HOST:PORT";
    let rest = text
        .trim()
        .strip_prefix("http://")
        .ok_or_else(|| format!("{text:?} is not an http:// URL ({how})"))?;
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.is_empty() || rest.contains(['/', '?', '#', '@', ' ']) {
        return Err(format!(
            "{text:?}: give the server alone, without a path, user or query ({how})"
        ));
    }
    let (host, port) = match rest.strip_prefix('[') {
        Some(v6) => {
            let (host, after) = v6
                .split_once(']')
                .ok_or_else(|| format!("{text:?}: an IPv6 address needs its closing `]`"))?;
            (host, after.strip_prefix(':'))
        }
        None => match rest.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (rest, None),
        },
    };
    let port = match port {
        None => DEFAULT_PORT,
        Some(p) => p
            .parse::<u16>()
            .ok()
            .filter(|&p| p > 0)
            .ok_or_else(|| format!("{text:?}: {p:?} is not a port (1 to 65535)"))?,
    };
    let name_ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | ':');
    if host.is_empty() || !host.chars().all(name_ok) {
        return Err(format!(
            "{text:?}: {host:?} is not a host name or address ({how})"
        ));
    }
    Ok(Peer {
        host: host.to_owned(),
        port,
    })
}

/// The peers of `--peer` and of `--peers FILE` (one URL per line; blank lines and
/// lines starting `#` skipped), checked before the server starts.
pub(crate) fn all(given: &[Peer], file: Option<&Path>) -> Result<Vec<Peer>, String> {
    let mut peers = given.to_vec();
    if let Some(path) = file {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("--peers {}: {e}", path.display()))?;
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let peer = parse(line)
                .map_err(|e| format!("--peers {}, line {}: {e}", path.display(), n + 1))?;
            peers.push(peer);
        }
    }
    let mut seen = std::collections::HashSet::new();
    peers.retain(|p| seen.insert(p.url()));
    if peers.len() > MAX_PEERS {
        return Err(format!(
            "{} peers: one page shows at most {MAX_PEERS} (serve a page per group of servers)",
            peers.len()
        ));
    }
    Ok(peers)
}

/// One peer as the page shows it.
#[derive(Serialize, Clone, Debug)]
pub(crate) struct PeerView {
    /// Its URL.
    pub(crate) url: String,
    /// Its name: the host its state names, else its URL's host.
    pub(crate) name: String,
    /// Its `/api/state` as it last answered (without its own peers); `None` while it
    /// does not answer.
    pub(crate) state: Option<serde_json::Value>,
    /// When it last answered, in seconds since the Unix epoch.
    pub(crate) answered_unix: Option<f64>,
    /// Why it does not answer now.
    pub(crate) error: Option<String>,
}

/// The peers as last read, shared with the state's reader.
pub(crate) type Views = Arc<Mutex<Vec<PeerView>>>;

/// Starts reading `peers`, each on a thread of its own: the views, filled in as they
/// answer (each "not read yet" until its first answer or failure).
pub(crate) fn watch(peers: Vec<Peer>, expect: Expect) -> std::io::Result<Views> {
    let views: Views = Arc::new(Mutex::new(
        peers
            .iter()
            .map(|p| PeerView {
                url: p.url(),
                name: p.host.clone(),
                state: None,
                answered_unix: None,
                error: Some("not read yet".into()),
            })
            .collect(),
    ));
    for (i, peer) in peers.into_iter().enumerate() {
        let views = Arc::clone(&views);
        std::thread::Builder::new()
            .name(format!("peer {i}"))
            .spawn(move || loop {
                let read = state_of(&peer, expect);
                if let Some(view) = views.lock().unwrap_or_else(|e| e.into_inner()).get_mut(i) {
                    match read {
                        Ok(state) => {
                            if let Some(host) = state.get("host").and_then(|h| h.as_str()) {
                                view.name = host.to_owned();
                            }
                            view.state = Some(state);
                            view.answered_unix = Some(tt_device::now_unix());
                            view.error = None;
                        }
                        Err(why) => {
                            view.state = None;
                            view.error = Some(why);
                        }
                    }
                }
                std::thread::sleep(PEER_EVERY);
            })?;
    }
    Ok(views)
}

/// `peer`'s `/api/state`, checked (a JSON object of this schema, without its own
/// peers), or why it cannot be had.
fn state_of(peer: &Peer, expect: Expect) -> Result<serde_json::Value, String> {
    let body = get(peer, "/api/state", expect.max_bytes)?;
    let mut state: serde_json::Value =
        serde_json::from_slice(&body).map_err(|e| format!("its state is not JSON: {e}"))?;
    let Some(map) = state.as_object_mut() else {
        return Err("its state is not a JSON object".into());
    };
    let schema = map.get("schema").and_then(serde_json::Value::as_u64);
    if schema != Some(u64::from(expect.schema)) {
        return Err(format!(
            "its state is of schema {}, this torchtools reads schema {} (run the same \
             version on every server)",
            schema.map_or("missing".into(), |s| s.to_string()),
            expect.schema
        ));
    }
    if let Some(error) = map.get("error").and_then(|e| e.as_str()) {
        return Err(format!("it cannot read its machine: {error}"));
    }
    map.remove("peers");
    Ok(state)
}

/// The body of `GET path` from `peer`: within [`CONNECT_WITHIN`] and [`ANSWER_WITHIN`],
/// a body of at most `max_bytes`, status 200.
fn get(peer: &Peer, path: &str, max_bytes: usize) -> Result<Vec<u8>, String> {
    let addrs: Vec<_> = (peer.host.as_str(), peer.port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {}: {e}", peer.host))?
        .collect();
    let mut last = format!("{} has no address", peer.host);
    let mut stream = None;
    for addr in addrs {
        match TcpStream::connect_timeout(&addr, CONNECT_WITHIN) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = format!("cannot connect to {addr}: {e}"),
        }
    }
    let mut stream = stream.ok_or(last)?;
    let deadline = Instant::now() + ANSWER_WITHIN;
    let host = peer.url();
    let host = host.trim_start_matches("http://");
    let io = |e: std::io::Error| format!("reading its answer: {e}");
    stream.set_write_timeout(Some(ANSWER_WITHIN)).map_err(io)?;
    write!(
        stream,
        "GET {path} HTTP/1.0\r\nHost: {host}\r\nAccept: application/json\r\nUser-Agent: \
         torchtools-serve\r\n\r\n"
    )
    .map_err(io)?;
    let limit = MAX_HEAD + max_bytes;
    let mut answer = Vec::new();
    let mut chunk = [0u8; 64 << 10];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!(
                "no whole answer within {}",
                tt_device::format_duration(ANSWER_WITHIN)
            ));
        }
        stream.set_read_timeout(Some(left)).map_err(io)?;
        match stream.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) if answer.len() + n > limit => {
                return Err(format!("its answer is over {} MiB", limit >> 20))
            }
            Ok(n) => answer.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                continue
            }
            Err(e) => return Err(io(e)),
        }
    }
    let split = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .filter(|&at| at <= MAX_HEAD)
        .ok_or("its answer is not HTTP")?;
    let head = String::from_utf8_lossy(&answer[..split]);
    let status = head.lines().next().unwrap_or_default();
    if status.split_whitespace().nth(1) != Some("200") {
        return Err(format!(
            "it answered {:?} (is it a `torchtools serve` that knows the name {host}? \
             give it `--host {}`)",
            status, peer.host
        ));
    }
    Ok(answer[split + 4..].to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_is_named_by_its_server_alone() {
        let ok = |t: &str| parse(t).map(|p| (p.host, p.port));
        assert_eq!(ok("http://node2:9836"), Ok(("node2".into(), 9836)));
        assert_eq!(
            ok("http://10.0.0.2/"),
            Ok(("10.0.0.2".into(), DEFAULT_PORT))
        );
        assert_eq!(ok("http://[fd00::2]:80"), Ok(("fd00::2".into(), 80)));
        assert_eq!(
            parse("http://[fd00::2]:80").unwrap().url(),
            "http://[fd00::2]:80"
        );
        for (bad, says) in [
            ("node2:9836", "not an http:// URL"),
            ("https://node2", "not an http:// URL"),
            ("http://node2:9836/api/state", "without a path"),
            ("http://user@node2", "without a path"),
            ("http://node2:0", "not a port"),
            ("http://node2:99999", "not a port"),
            ("http://", "without a path"),
            ("http://no\u{1b}de", "not a host name"),
            ("http://[fd00::2", "closing"),
        ] {
            let err = parse(bad).expect_err(bad);
            assert!(err.contains(says), "{bad}: {err}");
        }
    }

    #[test]
    fn a_file_of_peers_is_checked_line_by_line() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("peers");
        std::fs::write(&file, "# the lab\nhttp://a:1\n\nhttp://b:2\n").unwrap();
        let given = [parse("http://a:1").unwrap()];
        let peers = all(&given, Some(&file)).unwrap();
        assert_eq!(peers.len(), 2, "{peers:?}");
        std::fs::write(&file, "http://a:1\nb:2\n").unwrap();
        let err = all(&[], Some(&file)).unwrap_err();
        assert!(err.contains("line 2"), "{err}");
        let err = all(&[], Some(&dir.path().join("none"))).unwrap_err();
        assert!(err.contains("--peers"), "{err}");
    }
}
