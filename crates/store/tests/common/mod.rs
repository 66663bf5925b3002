//! Helpers shared by the store's integration tests: engine configs per backend, page
//! patterns derived from the key (so any process can check any page), registered buffers.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use pagewire_store::proto::{self, Hello, Request, Response};
use pagewire_store::{ClientConfig, Span, StoreClient};
use pagewire_transport::{BackendKind, EngineConfig};

/// The lines a child process (a test re-run as a role) tags with `@@ `, with what comes
/// before the tag dropped (libtest may have printed "test role ... " on the same line).
pub fn tagged_lines(out: std::process::ChildStdout) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if let Some(at) = line.find("@@ ")
                && tx.send(line[at + 3..].to_string()).is_err()
            {
                break;
            }
        }
    });
    rx
}

/// In a child: one line for [`tagged_lines`] on the parent's side.
pub fn say(line: impl AsRef<str>) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "@@ {}", line.as_ref());
    let _ = out.flush();
}

/// In a child: returns once the parent closed its stdin (the parent's way to end it,
/// which also ends it when the parent dies).
pub fn wait_stdin_closed() {
    let mut s = String::new();
    while std::io::stdin().read_line(&mut s).is_ok_and(|n| n > 0) {
        s.clear();
    }
}

/// This test binary re-run as its `role` test, told its part through `role_var` = `role`,
/// with `env` added; stdin and stdout piped (read stdout with [`tagged_lines`]), stderr
/// inherited, the child's log level from `PW_CHILD_LOG` (default `error`).
pub fn role_command(
    role_var: &str,
    role: &str,
    env: &[(&str, String)],
) -> std::io::Result<std::process::Command> {
    use std::process::Stdio;
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    cmd.args(["--exact", "role", "--nocapture", "--test-threads=1"])
        .env(role_var, role)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .env(
            "PAGEWIRE_LOG",
            std::env::var("PW_CHILD_LOG").unwrap_or("error".into()),
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    Ok(cmd)
}

/// An engine config for `kind` on localhost (verbs takes `RDMA_DEVICE`).
pub fn engine(kind: BackendKind) -> EngineConfig {
    let mut b = EngineConfig::builder()
        .backend(kind)
        .listen("127.0.0.1:0".parse().expect("literal"))
        .batch_timeout(Duration::from_secs(30))
        .io_timeout(Duration::from_secs(10));
    if kind == BackendKind::Verbs
        && let Ok(d) = std::env::var("RDMA_DEVICE")
    {
        b = b.rdma_device(d);
    }
    b.build().expect("engine config")
}

/// A client config for `kind` against `master`.
pub fn client_cfg(master: &str, kind: BackendKind, segment: u64) -> ClientConfig {
    let mut c = ClientConfig::new(master);
    c.engine = engine(kind);
    c.segment_size = segment;
    c.timeout = Duration::from_secs(10);
    c.connect_timeout = Duration::from_secs(5);
    c
}

/// splitmix64 step.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The bytes a page with this key and seed holds.
pub fn fill(key: &str, seed: u64, out: &mut [u8]) {
    let mut h = seed ^ 0xcbf2_9ce4_8422_2325;
    for b in key.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let v = mix(h.wrapping_add(i as u64)).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

/// A buffer registered with a client, freed after it.
pub struct Buf {
    pub mem: Vec<u8>,
}

impl Buf {
    /// `len` zero bytes registered with `c`.
    pub fn new(c: &StoreClient, len: usize) -> Buf {
        let mut mem = vec![0u8; len];
        // SAFETY: the vector lives in the returned `Buf`; tests keep each `Buf` alive
        // until the client is closed or the buffer unregistered.
        unsafe { c.register_buffer(mem.as_mut_ptr(), len) }.expect("register buffer");
        Buf { mem }
    }
    pub fn addr(&self) -> u64 {
        self.mem.as_ptr() as u64
    }
    /// One span of `len` bytes at `off`.
    pub fn span(&self, off: usize, len: usize) -> Span {
        assert!(off + len <= self.mem.len());
        Span::new(self.addr() + off as u64, len as u64)
    }
}

/// One request frame as bytes (for tests that speak the master's protocol by hand).
pub fn frame(req: &Request, id: u32) -> Vec<u8> {
    let mut b = Vec::new();
    req.encode(id, &mut b);
    b
}

/// Reads one response frame.
pub fn reply(s: &mut TcpStream) -> anyhow::Result<Response> {
    let mut h = [0u8; proto::HEADER_LEN];
    s.read_exact(&mut h)?;
    let header = proto::decode_header(&h, proto::DEFAULT_MAX_FRAME)?;
    let mut body = vec![0u8; header.len as usize];
    s.read_exact(&mut body)?;
    Ok(proto::decode_response(header.kind, &body)?)
}

/// A raw master connection that said Hello (no token) and got its Welcome.
pub fn authenticated(addr: SocketAddr) -> anyhow::Result<TcpStream> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    let hello = Request::Hello(Hello {
        token: Vec::new(),
        client_id: 0,
        endpoint: "127.0.0.1:9".into(),
    });
    s.write_all(&frame(&hello, 1))?;
    anyhow::ensure!(matches!(reply(&mut s)?, Response::Welcome(_)), "no Welcome");
    Ok(s)
}
