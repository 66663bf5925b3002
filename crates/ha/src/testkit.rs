//! Real etcd servers for tests: one member or a cluster, on 127.0.0.1 ports of their own,
//! in a temporary directory, killed and removed on drop.
//!
//! The `etcd` binary is Debian's `etcd-server` (`scripts/setup.sh` installs it);
//! `PAGEWIRE_ETCD` names another one. A test that needs etcd and finds none fails with
//! that advice instead of passing without having run.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// How long a cluster may take to answer `/health` after it started.
const READY_WITHIN: Duration = Duration::from_secs(20);

/// One member's process and ports.
#[derive(Debug)]
struct Member {
    name: String,
    client: u16,
    peer: u16,
    /// Plain HTTP for `/health` and `/metrics`, also when clients must use TLS.
    metrics: u16,
    child: Option<Child>,
}

/// A running etcd cluster of one or more members.
#[derive(Debug)]
pub struct EtcdCluster {
    dir: PathBuf,
    members: Vec<Member>,
    /// More flags for every member.
    extra: Vec<String>,
    /// `http`, or `https` for clients of a cluster started with TLS.
    scheme: &'static str,
}

/// Certificates for an etcd with TLS, made by `openssl` in a directory: a CA, the
/// members' certificate (IP SAN 127.0.0.1), a client certificate (CN `pagewire`), and a
/// second CA that signed none of them.
#[derive(Debug, Clone)]
pub struct TestCerts {
    /// The CA's certificate (PEM).
    pub ca: PathBuf,
    /// The members' certificate and key.
    pub server: (PathBuf, PathBuf),
    /// A client certificate and key signed by the CA.
    pub client: (PathBuf, PathBuf),
    /// A CA that signed nothing here.
    pub other_ca: PathBuf,
}

impl TestCerts {
    /// Makes them in `dir` (P-256 keys, valid 2 days). Panics without `openssl`.
    pub fn make(dir: &Path) -> TestCerts {
        std::fs::create_dir_all(dir).expect("create the certificates' directory");
        let run = |args: &[&str]| {
            let out = Command::new("openssl")
                .args(args)
                .current_dir(dir)
                .output()
                .unwrap_or_else(|e| panic!("run openssl (scripts/setup.sh installs it): {e}"));
            assert!(
                out.status.success(),
                "openssl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
        ];
        for ca in ["ca", "other-ca"] {
            let (key, pem, subj) = (
                format!("{ca}.key"),
                format!("{ca}.pem"),
                format!("/CN={ca}"),
            );
            let mut a = vec!["req", "-x509"];
            a.extend(ec);
            a.extend(["-keyout", &key, "-out", &pem, "-days", "2", "-subj", &subj]);
            run(&a);
        }
        std::fs::write(
            dir.join("server.ext"),
            "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n",
        )
        .expect("write server.ext");
        std::fs::write(dir.join("client.ext"), "extendedKeyUsage=clientAuth\n")
            .expect("write client.ext");
        for (who, cn) in [("server", "/CN=etcd"), ("client", "/CN=pagewire")] {
            let (key, csr, pem, ext) = (
                format!("{who}.key"),
                format!("{who}.csr"),
                format!("{who}.pem"),
                format!("{who}.ext"),
            );
            let mut a = vec!["req"];
            a.extend(ec);
            a.extend(["-keyout", &key, "-out", &csr, "-subj", cn]);
            run(&a);
            run(&[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                &pem,
                "-days",
                "2",
                "-extfile",
                &ext,
            ]);
        }
        TestCerts {
            ca: dir.join("ca.pem"),
            server: (dir.join("server.pem"), dir.join("server.key")),
            client: (dir.join("client.pem"), dir.join("client.key")),
            other_ca: dir.join("other-ca.pem"),
        }
    }
}

/// The etcd binary: `PAGEWIRE_ETCD`, or `etcd` on `PATH`.
fn etcd_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("PAGEWIRE_ETCD") {
        return PathBuf::from(p);
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("etcd"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "this test needs a real etcd server and found no `etcd` on PATH: \
                 run scripts/setup.sh (Debian's etcd-server) or set PAGEWIRE_ETCD"
            )
        })
}

/// A port nobody listens on right now (the kernel's pick, released at once).
fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind 127.0.0.1:0")
}

impl EtcdCluster {
    /// Starts `n` members and waits until the cluster answers `/health` with a leader.
    /// A member that exits at start (another process took one of its ports between our
    /// pick and its bind) makes a fresh try with other ports, twice at most.
    pub fn start(n: usize) -> EtcdCluster {
        Self::start_with(n, &[])
    }

    /// [`EtcdCluster::start`] with more flags for every member (`--auth-token-ttl=2`).
    pub fn start_with(n: usize, extra: &[&str]) -> EtcdCluster {
        Self::start_scheme(n, extra, "http")
    }

    /// Members that serve clients over TLS only, with `certs`' server certificate, and
    /// ask every client for a certificate signed by `certs.ca`.
    pub fn start_tls(n: usize, certs: &TestCerts) -> EtcdCluster {
        let flags = [
            format!("--cert-file={}", certs.server.0.display()),
            format!("--key-file={}", certs.server.1.display()),
            format!("--trusted-ca-file={}", certs.ca.display()),
            "--client-cert-auth".to_string(),
        ];
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        Self::start_scheme(n, &flags, "https")
    }

    fn start_scheme(n: usize, extra: &[&str], scheme: &'static str) -> EtcdCluster {
        assert!(n >= 1, "a cluster has at least one member");
        let mut tries = 0;
        loop {
            match Self::try_start(n, extra, scheme) {
                Ok(c) => return c,
                Err(why) if tries < 2 => {
                    tries += 1;
                    eprintln!("etcd did not start, trying other ports: {why}");
                }
                Err(why) => panic!("{why}"),
            }
        }
    }

    fn try_start(n: usize, extra: &[&str], scheme: &'static str) -> Result<EtcdCluster, String> {
        static SEQ: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "pagewire-etcd-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create etcd's temporary directory");
        let members: Vec<Member> = (0..n)
            .map(|i| Member {
                name: format!("m{i}"),
                client: free_port(),
                peer: free_port(),
                metrics: free_port(),
                child: None,
            })
            .collect();
        let mut c = EtcdCluster {
            dir,
            members,
            extra: extra.iter().map(|s| s.to_string()).collect(),
            scheme,
        };
        for i in 0..n {
            c.spawn(i);
        }
        c.wait_ready()?;
        Ok(c)
    }

    fn initial_cluster(&self) -> String {
        self.members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer))
            .collect::<Vec<_>>()
            .join(",")
    }

    fn spawn(&mut self, i: usize) {
        let exe = etcd_binary();
        let initial = self.initial_cluster();
        let m = &self.members[i];
        let data = self.dir.join(&m.name);
        let log = std::fs::File::create(self.dir.join(format!("{}.log", m.name)))
            .expect("create etcd's log file");
        let client = format!("{}://127.0.0.1:{}", self.scheme, m.client);
        let metrics = format!("http://127.0.0.1:{}", m.metrics);
        let peer = format!("http://127.0.0.1:{}", m.peer);
        let child = Command::new(&exe)
            .arg(format!("--name={}", m.name))
            .arg(format!("--data-dir={}", data.display()))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-metrics-urls={metrics}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster={initial}"))
            .arg("--initial-cluster-state=new")
            .arg(format!("--initial-cluster-token={}", self.dir.display()))
            .arg("--logger=zap")
            .arg("--log-level=warn")
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("clone log file"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", exe.display()));
        self.members[i].child = Some(child);
    }

    /// Polls every member's `/health` until one says the cluster is healthy.
    fn wait_ready(&mut self) -> Result<(), String> {
        let by = Instant::now() + READY_WITHIN;
        loop {
            if self.members.iter().any(|m| health(m.metrics)) {
                return Ok(());
            }
            let exited =
                self.members
                    .iter_mut()
                    .find_map(|m| match m.child.as_mut().map(Child::try_wait) {
                        Some(Ok(Some(st))) => Some((m.name.clone(), st)),
                        _ => None,
                    });
            if let Some((name, st)) = exited {
                return Err(format!(
                    "etcd member {name} exited ({st}):\n{}",
                    self.log_tail(&name)
                ));
            }
            if Instant::now() > by {
                let names: Vec<_> = self.members.iter().map(|m| m.name.clone()).collect();
                let logs: Vec<_> = names.iter().map(|n| self.log_tail(n)).collect();
                panic!(
                    "etcd not healthy within {READY_WITHIN:?}:\n{}",
                    logs.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn log_tail(&self, name: &str) -> String {
        let s = std::fs::read_to_string(self.dir.join(format!("{name}.log"))).unwrap_or_default();
        let start = s.len().saturating_sub(2000);
        format!("--- {name}.log ---\n{}", s.get(start..).unwrap_or(&s))
    }

    /// Client endpoints as the store takes them: `etcd://127.0.0.1:P;127.0.0.1:Q`.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("127.0.0.1:{}", m.client))
            .collect();
        format!("etcd://{}", hosts.join(";"))
    }

    /// The member that is raft leader now, if one says so (its `/metrics`).
    pub fn raft_leader(&self) -> Option<usize> {
        (0..self.members.len()).find(|&i| {
            self.members[i].child.is_some()
                && http_get(self.members[i].metrics, "/metrics")
                    .lines()
                    .any(|l| l.trim() == "etcd_server_is_leader 1")
        })
    }

    /// Stops member `i` (SIGSTOP): it keeps its sockets and answers nothing.
    pub fn pause(&self, i: usize) {
        self.signal(i, libc::SIGSTOP);
    }

    /// Resumes member `i` after [`EtcdCluster::pause`].
    pub fn resume(&self, i: usize) {
        self.signal(i, libc::SIGCONT);
    }

    fn signal(&self, i: usize, sig: libc::c_int) {
        if let Some(c) = &self.members[i].child {
            // SAFETY: kill(2) on a child this cluster spawned and has not reaped.
            unsafe { libc::kill(c.id() as libc::pid_t, sig) };
        }
    }

    /// Kills member `i` (SIGKILL) and reaps it.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The temporary directory (data and logs).
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Whether the member at `port` reports a healthy cluster (`/health`, with a leader).
fn health(port: u16) -> bool {
    http_get(port, "/health").contains("\"health\":\"true\"")
}

/// The reply to `GET path` from the member at `port` (empty when it did not answer).
fn http_get(port: u16, path: &str) -> String {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
        return String::new();
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let req = format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
    if s.write_all(req.as_bytes()).is_err() {
        return String::new();
    }
    let mut reply = String::new();
    let _ = s.read_to_string(&mut reply);
    reply
}

/// `[a, b]` with the one that leads first, once one of them leads within `within`;
/// `None` (both dropped) if neither does.
pub fn leader_first(
    a: crate::HaMaster,
    b: crate::HaMaster,
    within: Duration,
) -> Option<[crate::HaMaster; 2]> {
    let by = Instant::now() + within;
    loop {
        if a.wait_leader(Duration::from_millis(50)).is_some() {
            return Some([a, b]);
        }
        if b.wait_leader(Duration::from_millis(50)).is_some() {
            return Some([b, a]);
        }
        if Instant::now() >= by {
            return None;
        }
    }
}
