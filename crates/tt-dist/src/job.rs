//! One fate for a job across nodes. The launchers of every node meet at node 0's
//! launcher (`MASTER_ADDR:MASTER_PORT`, as torchrun's agents meet at its store): each
//! attempt starts on every node together, a rank that fails on any node stops every
//! node's ranks within moments, a restart restarts every node, and every launcher ends
//! with the same status, naming the node and rank that failed.
//!
//! The ranks' own rendezvous (their c10d store) is on a port node 0's launcher picks
//! for each attempt and hands to every node, so the launchers' meeting point and the
//! ranks' never collide, and a restarted attempt never meets the last one's store.
//!
//! The messages are JSON lines over TCP. Every launcher, node 0's included, is a client
//! of the coordinator thread of node 0's launcher; each side says it is alive every
//! [`ALIVE_EVERY`], and one silent for [`SILENT_FOR`] is taken as lost (a host that
//! went down closes no connection).

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::{Error, Result, EXIT_PREEMPTED};

/// How often each side says it is alive.
pub(crate) const ALIVE_EVERY: Duration = Duration::from_secs(2);
/// Silence after which the other side is taken as lost.
pub(crate) const SILENT_FOR: Duration = Duration::from_secs(30);

/// How one node's ranks ended in one attempt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct NodeEnd {
    /// 0 when every rank succeeded, [`EXIT_PREEMPTED`] when one was preempted, else the
    /// first failed rank's status.
    pub code: i32,
    /// The rank (global) that failed or was preempted first.
    pub rank: Option<usize>,
    /// How, in words ("exited with status 3").
    pub how: String,
    /// The exception it recorded (`TORCHELASTIC_ERROR_FILE`).
    pub error: Option<String>,
    /// Its ranks were stopped because another node's failed: a consequence, not a cause.
    pub stopped: bool,
}

/// How the whole job ended, the same on every node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct JobEnd {
    /// The launch's status: 0, [`EXIT_PREEMPTED`], or the failed rank's.
    pub code: i32,
    /// The node and rank that failed (or were preempted), and how.
    pub node: Option<usize>,
    pub rank: Option<usize>,
    pub how: String,
    pub error: Option<String>,
    /// Restarts made.
    pub restarts: u32,
}

/// A launcher to the coordinator.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Up {
    /// The first message: which node this is.
    Hello {
        node: usize,
        host: String,
    },
    /// A rank of this node failed (or was preempted) in `attempt`: stop the others now.
    Failing {
        attempt: u32,
        end: NodeEnd,
    },
    /// Every rank of this node has ended in `attempt`.
    Ended {
        attempt: u32,
        end: NodeEnd,
    },
    Alive,
}

/// The coordinator to a launcher.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Down {
    /// Start the ranks of `attempt`, their store at `MASTER_ADDR:port`; `after`: what
    /// ended the attempt before (a restart).
    Start {
        attempt: u32,
        port: u16,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        after: Option<String>,
    },
    /// A rank failed somewhere: stop this node's ranks of `attempt`, then say `Ended`.
    Stop {
        attempt: u32,
    },
    /// The job is over.
    Finish {
        end: JobEnd,
    },
    /// This launcher cannot join (a node rank taken twice, one out of range).
    Refused {
        reason: String,
    },
    Alive,
}

fn send<T: Serialize>(stream: &Mutex<TcpStream>, message: &T) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(message).map_err(std::io::Error::other)?;
    line.push(b'\n');
    let mut s = stream.lock().unwrap_or_else(|e| e.into_inner());
    s.write_all(&line)
}

/// Reads JSON lines from `stream` into `to` as `(from, Some(message))`, then
/// `(from, None)` at the end of the stream or at a line that is not a message. (A
/// reader, not a stream: whatever it buffered past a first line read elsewhere is
/// read here too.)
fn read_lines<T: for<'de> Deserialize<'de> + Send + 'static, K: Copy + Send + 'static>(
    stream: BufReader<TcpStream>,
    from: K,
    to: Sender<(K, Option<T>)>,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("torchtools-job".into())
        .spawn(move || {
            for line in stream.lines() {
                let Ok(line) = line else { break };
                match serde_json::from_str(&line) {
                    Ok(message) => {
                        if to.send((from, Some(message))).is_err() {
                            return;
                        }
                    }
                    Err(_) => break,
                }
            }
            let _ = to.send((from, None));
        })
}

/// The coordinator: node 0's launcher runs it on a thread, serving every node's
/// launcher (its own included) at the job's port.
pub(crate) struct Coordinator {
    thread: Option<JoinHandle<()>>,
}

impl Coordinator {
    /// Listens on `port` (every interface) for `nnodes` launchers, and runs the job
    /// from there on a thread: a node missing after `join_timeout` ends the job.
    pub(crate) fn start(
        port: u16,
        nnodes: usize,
        max_restarts: u32,
        join_timeout: Duration,
    ) -> Result<Coordinator> {
        let listener = TcpListener::bind(("0.0.0.0", port)).map_err(|cause| Error::Io {
            what: format!(
                "listening on port {port} for the other nodes' launchers (is --master-port \
                 free on this host?)"
            ),
            cause,
        })?;
        let thread = std::thread::Builder::new()
            .name("torchtools-coordinator".into())
            .spawn(move || {
                let mut job = Job::new(nnodes, max_restarts);
                if let Err(why) = job.gather(&listener, join_timeout) {
                    job.finish(&JobEnd {
                        code: 1,
                        node: None,
                        rank: None,
                        how: why,
                        error: None,
                        restarts: 0,
                    });
                    return;
                }
                drop(listener);
                job.run();
            })
            .map_err(|cause| Error::Io {
                what: "starting the job's coordinator".into(),
                cause,
            })?;
        Ok(Coordinator {
            thread: Some(thread),
        })
    }
}

impl Drop for Coordinator {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The coordinator's view of the job.
struct Job {
    nnodes: usize,
    max_restarts: u32,
    nodes: Vec<Option<Arc<Mutex<TcpStream>>>>,
    hosts: Vec<String>,
    events: Receiver<(usize, Option<Up>)>,
    sender: Sender<(usize, Option<Up>)>,
    last_seen: Vec<Instant>,
}

impl Job {
    fn new(nnodes: usize, max_restarts: u32) -> Job {
        let (sender, events) = mpsc::channel();
        Job {
            nnodes,
            max_restarts,
            nodes: vec![None; nnodes],
            hosts: vec![String::new(); nnodes],
            events,
            sender,
            last_seen: vec![Instant::now(); nnodes],
        }
    }

    /// Accepts launchers until every node has said hello; `Err` names the missing ones
    /// at the deadline.
    fn gather(
        &mut self,
        listener: &TcpListener,
        timeout: Duration,
    ) -> std::result::Result<(), String> {
        let deadline = Instant::now() + timeout;
        listener
            .set_nonblocking(true)
            .map_err(|e| format!("cannot poll the job's port: {e}"))?;
        while self.nodes.iter().any(Option::is_none) {
            if Instant::now() >= deadline {
                let missing: Vec<String> = (0..self.nnodes)
                    .filter(|n| self.nodes[*n].is_none())
                    .map(|n| n.to_string())
                    .collect();
                return Err(format!(
                    "node(s) {} never joined within {:?} (TORCHTOOLS_DIST_TIMEOUT): start \
                     `torchtools launch --node-rank N` with the same --nnodes, --master-addr \
                     and --master-port on each",
                    missing.join(", "),
                    timeout
                ));
            }
            match listener.accept() {
                Ok((stream, _)) => self.hello(stream),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
        Ok(())
    }

    /// A new connection's first line: which node it is.
    fn hello(&mut self, stream: TcpStream) {
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_read_timeout(Some(SILENT_FOR));
        let Ok(reader) = stream.try_clone() else {
            return;
        };
        let mut first = String::new();
        let mut reader = BufReader::new(reader);
        if reader.read_line(&mut first).is_err() {
            return;
        }
        let _ = stream.set_read_timeout(None);
        let writer = Arc::new(Mutex::new(stream));
        let refuse = |reason: String| {
            let _ = send(&writer, &Down::Refused { reason });
        };
        let (node, host) = match serde_json::from_str::<Up>(&first) {
            Ok(Up::Hello { node, host }) => (node, host),
            _ => return refuse("not a torchtools launcher of this job".into()),
        };
        if node >= self.nnodes {
            return refuse(format!(
                "--node-rank {node} but the job has --nnodes {}: node ranks go from 0 to {}",
                self.nnodes,
                self.nnodes - 1
            ));
        }
        if self.nodes[node].is_some() {
            return refuse(format!(
                "node {node} has joined already (from {}): give each node its own --node-rank",
                self.hosts[node]
            ));
        }
        // The rest of the lines (an `Alive` may already be buffered behind the first),
        // read by a thread of their own.
        if read_lines::<Up, usize>(reader, node, self.sender.clone()).is_err() {
            return;
        }
        self.nodes[node] = Some(writer);
        self.hosts[node] = host;
        self.last_seen[node] = Instant::now();
    }

    fn broadcast(&mut self, message: &Down) {
        for node in self.nodes.iter().flatten() {
            let _ = send(node, message);
        }
    }

    fn finish(&mut self, end: &JobEnd) {
        self.broadcast(&Down::Finish { end: end.clone() });
        for node in self.nodes.iter().flatten() {
            let s = node.lock().unwrap_or_else(|e| e.into_inner());
            let _ = s.shutdown(Shutdown::Write);
        }
    }

    /// Attempts until one succeeds, is preempted, or fails with no restart left.
    fn run(&mut self) {
        let mut restarts = 0;
        let mut attempt = 0;
        let mut after = None;
        loop {
            let port = match crate::port::pick_port("0.0.0.0") {
                Ok(p) => p,
                Err(e) => {
                    return self.finish(&JobEnd {
                        code: 1,
                        node: None,
                        rank: None,
                        how: format!("no free port for the ranks' store on node 0: {e}"),
                        error: None,
                        restarts,
                    })
                }
            };
            self.broadcast(&Down::Start {
                attempt,
                port,
                after: after.take(),
            });
            let (cause, lost) = self.attempt(attempt);
            let Some((node, end)) = cause else {
                return self.finish(&JobEnd {
                    code: 0,
                    node: None,
                    rank: None,
                    how: String::new(),
                    error: None,
                    restarts,
                });
            };
            // A preempted job is stopped on purpose; a lost node cannot be restarted.
            let host = &self.hosts[node];
            if end.code != EXIT_PREEMPTED && lost.is_empty() && restarts < self.max_restarts {
                restarts += 1;
                attempt += 1;
                let rank = end.rank.map_or(String::new(), |r| format!("rank {r} "));
                after = Some(format!("{rank}{} on node {node} ({host})", end.how));
                continue;
            }
            return self.finish(&JobEnd {
                code: end.code,
                node: Some(node),
                rank: end.rank,
                how: format!("{} on node {node} ({host})", end.how),
                error: end.error,
                restarts,
            });
        }
    }

    /// Runs one attempt to its end on every node: the first failure (or preemption)
    /// stops every node. Returns the cause, if any, and the nodes lost.
    fn attempt(&mut self, attempt: u32) -> (Option<(usize, NodeEnd)>, BTreeSet<usize>) {
        let mut ended: BTreeSet<usize> = BTreeSet::new();
        let mut lost: BTreeSet<usize> = BTreeSet::new();
        let mut cause: Option<(usize, NodeEnd)> = None;
        let mut preempted: Option<(usize, NodeEnd)> = None;
        let mut stopped = false;
        let mut last_alive = Instant::now();
        while ended.len() + lost.len() < self.nnodes {
            if last_alive.elapsed() >= ALIVE_EVERY {
                self.broadcast(&Down::Alive);
                last_alive = Instant::now();
            }
            let event = match self.events.recv_timeout(Duration::from_millis(200)) {
                Ok(e) => Some(e),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => break,
            };
            let mut failing: Option<(usize, NodeEnd)> = None;
            match event {
                Some((node, Some(message))) => {
                    self.last_seen[node] = Instant::now();
                    match message {
                        Up::Failing { attempt: a, end } if a == attempt => {
                            failing = Some((node, end));
                        }
                        Up::Ended { attempt: a, end } if a == attempt => {
                            ended.insert(node);
                            if end.code != 0 && !end.stopped {
                                failing = Some((node, end));
                            }
                        }
                        _ => {}
                    }
                }
                Some((node, None)) if !ended.contains(&node) && lost.insert(node) => {
                    self.nodes[node] = None;
                    failing = Some((node, lost_end()));
                }
                Some((_, None)) => {}
                None => {}
            }
            for node in 0..self.nnodes {
                let silent = self.last_seen[node].elapsed() >= SILENT_FOR;
                if silent && !ended.contains(&node) && lost.insert(node) {
                    if let Some(s) = self.nodes[node].take() {
                        let _ = s
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .shutdown(Shutdown::Both);
                    }
                    failing.get_or_insert((node, lost_end()));
                }
            }
            if let Some((node, end)) = failing {
                if end.code == EXIT_PREEMPTED {
                    preempted.get_or_insert((node, end));
                } else if cause.is_none() {
                    cause = Some((node, end));
                }
                if !stopped {
                    self.broadcast(&Down::Stop { attempt });
                    stopped = true;
                }
            }
        }
        (cause.or(preempted), lost)
    }
}

fn lost_end() -> NodeEnd {
    NodeEnd {
        code: 1,
        rank: None,
        how: format!(
            "its launcher was lost (connection closed, or silent for {}s)",
            SILENT_FOR.as_secs()
        ),
        error: None,
        stopped: false,
    }
}

/// A launcher's connection to the coordinator.
pub(crate) struct Link {
    writer: Arc<Mutex<TcpStream>>,
    messages: Receiver<((), Option<Down>)>,
    last_heard: std::cell::Cell<Instant>,
    _alive: JoinHandle<()>,
}

impl Link {
    /// Connects to the coordinator at `addr:port` as node `node`, trying until
    /// `timeout` (node 0's launcher may start after this one).
    pub(crate) fn connect(addr: &str, port: u16, node: usize, timeout: Duration) -> Result<Link> {
        let deadline = Instant::now() + timeout;
        let stream = loop {
            let error = match (addr, port).to_socket_addrs() {
                Ok(mut addrs) => match addrs.next() {
                    Some(a) => match TcpStream::connect_timeout(&a, Duration::from_secs(2)) {
                        Ok(s) => break s,
                        Err(e) => e.to_string(),
                    },
                    None => "the name resolves to no address".into(),
                },
                Err(e) => e.to_string(),
            };
            if Instant::now() >= deadline {
                return Err(Error::Job {
                    reason: format!(
                        "node 0's launcher at {addr}:{port} did not answer within {timeout:?} \
                     (TORCHTOOLS_DIST_TIMEOUT): {error}. Start `torchtools launch --node-rank 0` \
                     there with the same --nnodes and --master-port"
                    ),
                });
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let io = |what: &str| {
            let what = what.to_owned();
            move |cause| Error::Io { what, cause }
        };
        let _ = stream.set_nodelay(true);
        let reader = stream
            .try_clone()
            .map_err(io("connecting to node 0's launcher"))?;
        let writer = Arc::new(Mutex::new(stream));
        let host = crate::iface::host_name().unwrap_or_default();
        send(&writer, &Up::Hello { node, host }).map_err(io("joining the job"))?;
        let (to, messages) = mpsc::channel();
        read_lines::<Down, ()>(BufReader::new(reader), (), to)
            .map_err(io("starting the job's reader"))?;
        let alive = {
            let writer = Arc::clone(&writer);
            std::thread::Builder::new()
                .name("torchtools-alive".into())
                .spawn(move || {
                    while send(&writer, &Up::Alive).is_ok() {
                        std::thread::sleep(ALIVE_EVERY);
                    }
                })
                .map_err(io("starting the job's keep-alive"))?
        };
        Ok(Link {
            writer,
            messages,
            last_heard: std::cell::Cell::new(Instant::now()),
            _alive: alive,
        })
    }

    /// Sends `message`; an error means the coordinator is gone.
    pub(crate) fn send(&self, message: &Up) -> Result<()> {
        send(&self.writer, message).map_err(|cause| Error::Io {
            what: "telling node 0's launcher".into(),
            cause,
        })
    }

    /// The next message other than `Alive`, waiting at most `wait`: `Ok(None)` when
    /// none came. An error when the coordinator is lost.
    pub(crate) fn next(&self, wait: Duration) -> Result<Option<Down>> {
        let until = Instant::now() + wait;
        loop {
            let left = until.saturating_duration_since(Instant::now());
            match self.messages.recv_timeout(left) {
                Ok(((), Some(Down::Alive))) => self.last_heard.set(Instant::now()),
                Ok(((), Some(m))) => {
                    self.last_heard.set(Instant::now());
                    return Ok(Some(m));
                }
                Ok(((), None)) | Err(RecvTimeoutError::Disconnected) => {
                    return Err(lost_coordinator("its connection closed"))
                }
                Err(RecvTimeoutError::Timeout) => {
                    if self.last_heard.get().elapsed() >= SILENT_FOR {
                        return Err(lost_coordinator(&format!(
                            "silent for {}s",
                            SILENT_FOR.as_secs()
                        )));
                    }
                    return Ok(None);
                }
            }
        }
    }
}

fn lost_coordinator(how: &str) -> Error {
    Error::Job {
        reason: format!(
            "lost node 0's launcher, which runs the job ({how}): this node's ranks were stopped"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_one_json_line_each_and_read_back() {
        let up = Up::Failing {
            attempt: 2,
            end: NodeEnd {
                code: 137,
                rank: Some(3),
                how: "was killed (SIGKILL)".into(),
                error: None,
                stopped: false,
            },
        };
        let line = serde_json::to_string(&up).unwrap();
        assert!(!line.contains('\n'));
        assert_eq!(serde_json::from_str::<Up>(&line).unwrap(), up);
        let down = Down::Start {
            attempt: 1,
            port: 4242,
            after: None,
        };
        let line = serde_json::to_string(&down).unwrap();
        assert_eq!(line, r#"{"start":{"attempt":1,"port":4242}}"#);
    }
}
