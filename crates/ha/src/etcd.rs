//! A synchronous facade over the async `etcd-client`: its futures run on one private
//! runtime worker thread, and each call blocks its caller until the answer or the call's
//! deadline, whichever comes first. The store is thread-based; this keeps tokio inside
//! this module.
//!
//! One client per member, used one at a time: a call goes to the member that answered
//! last and moves on to the next when that one fails (refused, no raft leader, silent for
//! its share of the deadline). The crate's own balancing over all members kept sending
//! calls to a dead member.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use etcd_client::{Compare, CompareOp, ConnectOptions, GetOptions, PutOptions, Txn, TxnOp};

use crate::error::{HaError, Result};

/// `etcd://h:p;h:p` (or `,`-separated) -> `["h:p", "h:p"]`.
pub fn parse_endpoints(url: &str) -> Result<Vec<String>> {
    let misuse = |reason: &str| HaError::Misuse {
        reason: format!("etcd address {url:?}: {reason}"),
    };
    let rest = url
        .strip_prefix("etcd://")
        .ok_or_else(|| misuse("must start with etcd://"))?;
    let hosts: Vec<String> = rest
        .split([';', ','])
        .map(str::trim)
        .filter(|h| !h.is_empty())
        .map(str::to_string)
        .collect();
    if hosts.is_empty() {
        return Err(misuse("names no host:port"));
    }
    for h in &hosts {
        let port_ok = h
            .rsplit_once(':')
            .is_some_and(|(host, p)| !host.is_empty() && p.parse::<u16>().is_ok());
        if !port_ok {
            return Err(misuse(&format!("{h:?} is not host:port")));
        }
    }
    Ok(hosts)
}

/// One key's value and the revision that created it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The value's bytes.
    pub value: Vec<u8>,
    /// The revision of the transaction that created the key (grows with every creation).
    pub create_revision: i64,
}

/// How fresh a read must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Read {
    /// Everything committed before the read was sent (etcd confirms its raft leadership
    /// first: a round of messages among the members).
    Linearizable,
    /// What the member that answers has applied, which may lag: no raft round, so much
    /// cheaper for etcd. For readers that only need some committed state, in order.
    Serializable,
}

impl Read {
    fn options(self) -> GetOptions {
        match self {
            Read::Linearizable => GetOptions::new(),
            Read::Serializable => GetOptions::new().with_serializable(),
        }
    }
}

/// What a [`Etcd::create_with_lease`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Created {
    /// The key was absent and now holds the value, created at this revision.
    Won(i64),
    /// The key exists already (its current entry).
    Held(Entry),
}

/// A user name and password for an etcd with authentication on. The password is never
/// printed (`Debug` shows the user only).
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    user: String,
    password: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("user", &self.user)
            .finish_non_exhaustive()
    }
}

/// The environment variable naming the etcd user.
pub const USER_ENV: &str = "PAGEWIRE_ETCD_USER";
/// The environment variable holding that user's password.
pub const PASSWORD_ENV: &str = "PAGEWIRE_ETCD_PASSWORD";
/// The environment variable naming a file that holds the password (its first line).
pub const PASSWORD_FILE_ENV: &str = "PAGEWIRE_ETCD_PASSWORD_FILE";

impl Credentials {
    /// A user and its password (both non-empty).
    pub fn new(user: impl Into<String>, password: impl Into<String>) -> Result<Credentials> {
        let (user, password) = (user.into(), password.into());
        if user.is_empty() || password.is_empty() {
            return Err(HaError::Misuse {
                reason: "etcd credentials need a user name and a password".into(),
            });
        }
        Ok(Credentials { user, password })
    }

    /// The user name.
    pub fn user(&self) -> &str {
        &self.user
    }

    /// From [`USER_ENV`] and [`PASSWORD_ENV`] or [`PASSWORD_FILE_ENV`]; `None` when no
    /// user is set. A user without a password, or both a password and a file, is a
    /// misuse (the message names the variables, never the password).
    pub fn from_env() -> Result<Option<Credentials>> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        Credentials::from_vars(var(USER_ENV), var(PASSWORD_ENV), var(PASSWORD_FILE_ENV))
    }

    /// [`Credentials::from_env`] given the three variables' values.
    fn from_vars(
        user: Option<String>,
        password: Option<String>,
        file: Option<String>,
    ) -> Result<Option<Credentials>> {
        let misuse = |reason: String| HaError::Misuse { reason };
        let Some(user) = user else {
            return match (password, file) {
                (None, None) => Ok(None),
                _ => Err(misuse(format!(
                    "{PASSWORD_ENV} or {PASSWORD_FILE_ENV} is set but {USER_ENV} is not"
                ))),
            };
        };
        let password = match (password, file) {
            (Some(p), None) => p,
            (None, Some(path)) => {
                let text = std::fs::read_to_string(&path)
                    .map_err(|e| misuse(format!("{PASSWORD_FILE_ENV}: reading {path:?}: {e}")))?;
                text.lines().next().unwrap_or("").to_string()
            }
            (Some(_), Some(_)) => {
                return Err(misuse(format!(
                    "set {PASSWORD_ENV} or {PASSWORD_FILE_ENV}, not both"
                )));
            }
            (None, None) => {
                return Err(misuse(format!(
                    "{USER_ENV} is set but neither {PASSWORD_ENV} nor {PASSWORD_FILE_ENV}"
                )));
            }
        };
        Credentials::new(user, password).map(Some)
    }
}

/// The environment variable naming the PEM file of the CA that signed etcd's server
/// certificates: set, connections to etcd use TLS.
pub const CA_ENV: &str = "PAGEWIRE_ETCD_CA";
/// The environment variable naming this process's client certificate (PEM), for an etcd
/// that asks for one (`--client-cert-auth`).
pub const CERT_ENV: &str = "PAGEWIRE_ETCD_CERT";
/// The environment variable naming the private key of that certificate (PEM).
pub const KEY_ENV: &str = "PAGEWIRE_ETCD_KEY";

/// TLS to etcd: the CA its members' certificates must chain to (the system's roots are
/// not trusted), and optionally a client certificate and key. A member's certificate
/// must name the host of its `host:port` (an IP address as an IP SAN).
#[derive(Clone)]
pub struct Tls {
    ca: Vec<u8>,
    identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("ca_bytes", &self.ca.len())
            .field("client_certificate", &self.identity.is_some())
            .finish()
    }
}

impl Tls {
    /// From PEM files: the CA's certificate(s), and a client certificate with its key.
    pub fn from_pem_files(ca: &str, client: Option<(&str, &str)>) -> Result<Tls> {
        let read = |what: &str, path: &str| -> Result<Vec<u8>> {
            let b = std::fs::read(path).map_err(|e| HaError::Misuse {
                reason: format!("etcd TLS {what} {path:?}: {e}"),
            })?;
            if !b.windows(11).any(|w| w == b"-----BEGIN ") {
                return Err(HaError::Misuse {
                    reason: format!("etcd TLS {what} {path:?}: not PEM"),
                });
            }
            Ok(b)
        };
        let ca = read("CA", ca)?;
        let identity = match client {
            Some((cert, key)) => Some((read("certificate", cert)?, read("key", key)?)),
            None => None,
        };
        Ok(Tls { ca, identity })
    }

    /// From [`CA_ENV`], [`CERT_ENV`] and [`KEY_ENV`]; `None` when none is set. A
    /// certificate without its key (or the reverse), or either without a CA, is a misuse.
    pub fn from_env() -> Result<Option<Tls>> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let (ca, cert, key) = (var(CA_ENV), var(CERT_ENV), var(KEY_ENV));
        let misuse = |reason: String| HaError::Misuse { reason };
        let client = match (&cert, &key) {
            (Some(c), Some(k)) => Some((c.as_str(), k.as_str())),
            (None, None) => None,
            _ => {
                return Err(misuse(format!(
                    "set both {CERT_ENV} and {KEY_ENV}, or neither"
                )));
            }
        };
        match ca {
            Some(ca) => Tls::from_pem_files(&ca, client).map(Some),
            None if client.is_some() => Err(misuse(format!(
                "{CERT_ENV} and {KEY_ENV} need {CA_ENV} (the CA of etcd's certificates)"
            ))),
            None => Ok(None),
        }
    }

    #[cfg(feature = "tls")]
    fn options(&self) -> etcd_client::TlsOptions {
        let mut o = etcd_client::TlsOptions::new()
            .ca_certificate(etcd_client::Certificate::from_pem(&self.ca));
        if let Some((cert, key)) = &self.identity {
            o = o.identity(etcd_client::Identity::from_pem(cert, key));
        }
        o
    }
}

/// Who this process is to etcd, and how it reaches it: a user (for an etcd with
/// authentication on) and TLS, each optional.
#[derive(Debug, Clone, Default)]
pub struct Access {
    /// The user and password.
    pub user: Option<Credentials>,
    /// TLS settings; `None`: plain TCP.
    pub tls: Option<Tls>,
}

impl Access {
    /// Both from the environment ([`Credentials::from_env`], [`Tls::from_env`]).
    pub fn from_env() -> Result<Access> {
        Ok(Access {
            user: Credentials::from_env()?,
            tls: Tls::from_env()?,
        })
    }
}

/// The members' clients, each connected at its first use: with credentials, connecting
/// authenticates (a round trip that a member down fails), so a member down at start must
/// not fail the whole connection, and one that comes back later is connected then.
pub(crate) struct Members {
    urls: Vec<String>,
    opts: ConnectOptions,
    clients: Vec<tokio::sync::OnceCell<etcd_client::Client>>,
}

impl Members {
    pub(crate) fn len(&self) -> usize {
        self.urls.len()
    }

    /// Member `i`'s client if it is connected.
    fn connected(&self, i: usize) -> Option<etcd_client::Client> {
        self.clients[i].get().cloned()
    }

    /// Member `i`'s client, connected now if it was not.
    pub(crate) async fn client(
        &self,
        i: usize,
    ) -> std::result::Result<etcd_client::Client, etcd_client::Error> {
        self.clients[i]
            .get_or_try_init(|| {
                etcd_client::Client::connect([self.urls[i].clone()], Some(self.opts.clone()))
            })
            .await
            .cloned()
    }
}

/// A connection to an etcd cluster (cheap to clone: one runtime, one client per member).
#[derive(Clone)]
pub struct Etcd {
    rt: Arc<tokio::runtime::Runtime>,
    members: Arc<Members>,
    /// The member that answered last.
    current: Arc<AtomicUsize>,
    endpoints: Arc<[String]>,
}

/// Longest a call waits for one member before it tries the next (a stopped member
/// accepts connections and never answers).
const PER_MEMBER: Duration = Duration::from_millis(700);

impl std::fmt::Debug for Etcd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Etcd")
            .field("endpoints", &self.endpoints)
            .finish()
    }
}

impl Etcd {
    /// Connects to the members of `url` (`etcd://h:p;h:p`) with the user and TLS the
    /// environment names ([`Access::from_env`]). Nothing waits for `_deadline` any
    /// more: see [`Etcd::connect_as`].
    pub fn connect(url: &str, _deadline: Instant) -> Result<Etcd> {
        Etcd::connect_as(url, Access::from_env()?)
    }

    /// Connects to the members of `url` with `access`. No I/O: a member is connected at
    /// its first call, within that call's deadline; with a user, that call authenticates
    /// first. A wrong user or password, or a user without the permissions a call needs,
    /// fails with [`HaError::Denied`]. TLS settings in a build without the `tls`
    /// feature are a misuse (never a silent fall back to plain TCP).
    pub fn connect_as(url: &str, access: Access) -> Result<Etcd> {
        let endpoints = parse_endpoints(url)?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("pagewire-etcd")
            .enable_all()
            .build()
            .map_err(|e| HaError::Io {
                what: "start the etcd client's runtime",
                source: Arc::new(e),
            })?;
        let rt = Arc::new(rt);
        // A member that lost its raft leader refuses instead of answering from a stale
        // view; gRPC keep-alives notice a dead member between calls.
        let mut opts = ConnectOptions::new()
            .with_require_leader(true)
            .with_connect_timeout(Duration::from_secs(2))
            .with_keep_alive(Duration::from_secs(1), Duration::from_secs(2))
            .with_keep_alive_while_idle(true);
        if let Some(c) = access.user {
            // etcd's tokens expire (simple tokens after --auth-token-ttl, 300 s by
            // default): a call refused for that authenticates again and is retried.
            opts = opts
                .with_user(c.user, c.password)
                .with_auto_token_refresh(true);
        }
        let scheme = match &access.tls {
            None => "http",
            #[cfg(feature = "tls")]
            Some(t) => {
                opts = opts.with_tls(t.options());
                "https"
            }
            #[cfg(not(feature = "tls"))]
            Some(_) => {
                return Err(HaError::Misuse {
                    reason: format!(
                        "TLS to etcd ({CA_ENV}) asked for, but pagewire-ha was built \
                         without its `tls` feature"
                    ),
                });
            }
        };
        let members = Members {
            urls: endpoints
                .iter()
                .map(|h| format!("{scheme}://{h}"))
                .collect(),
            opts,
            clients: endpoints
                .iter()
                .map(|_| tokio::sync::OnceCell::new())
                .collect(),
        };
        Ok(Etcd {
            rt,
            members: Arc::new(members),
            current: Arc::new(AtomicUsize::new(0)),
            endpoints: endpoints.into(),
        })
    }

    /// Runs `f` on the current member's client, and on the next members in turn while it
    /// fails with time left.
    fn call<T, F, Fut>(&self, what: &'static str, deadline: Instant, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: Fn(etcd_client::Client) -> Fut,
        Fut: std::future::Future<Output = std::result::Result<T, etcd_client::Error>>
            + Send
            + 'static,
    {
        let n = self.members.len();
        let first = self.current.load(Ordering::Relaxed) % n;
        let mut last = None;
        for k in 0..n {
            let i = (first + k) % n;
            // Each member left gets an equal share of the time left (at most
            // PER_MEMBER), so that a silent one cannot take the whole deadline.
            let left = deadline.saturating_duration_since(Instant::now());
            let share = (left / (n - k) as u32).min(PER_MEMBER);
            let by = if k + 1 == n {
                deadline
            } else {
                Instant::now() + share
            };
            let client = match self.members.connected(i) {
                Some(c) => Ok(c),
                None => {
                    let members = self.members.clone();
                    block(&self.rt, by, what, async move { members.client(i).await })
                }
            };
            match client.and_then(|c| block(&self.rt, by, what, f(c))) {
                Ok(v) => {
                    self.current.store(i, Ordering::Relaxed);
                    return Ok(v);
                }
                // The same settings and credentials go to every member.
                Err(e @ (HaError::Misuse { .. } | HaError::Denied { .. })) => return Err(e),
                Err(e) => {
                    // The next call starts with the next member.
                    self.current.store((i + 1) % n, Ordering::Relaxed);
                    last = Some(e);
                }
            }
            if Instant::now() >= deadline {
                break;
            }
        }
        Err(last.unwrap_or(HaError::Timeout {
            what,
            after: Duration::ZERO,
        }))
    }

    /// The members' `host:port`s.
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// The runtime, the members' clients and the member that answered last (for
    /// [`crate::watch`], whose streams live on the same runtime and connections).
    pub(crate) fn parts(&self) -> (&tokio::runtime::Runtime, Arc<Members>, usize) {
        let n = self.members.len();
        (
            &self.rt,
            self.members.clone(),
            self.current.load(Ordering::Relaxed) % n,
        )
    }

    /// The key's entry, if it exists (a linearizable read).
    pub fn get(&self, key: &str, deadline: Instant) -> Result<Option<Entry>> {
        self.get_read(key, Read::Linearizable, deadline)
    }

    /// [`Etcd::get`] as fresh as `read` says.
    pub fn get_read(&self, key: &str, read: Read, deadline: Instant) -> Result<Option<Entry>> {
        Ok(self.get_with(key, read, deadline)?.0)
    }

    /// [`Etcd::get`], and the store's revision the answer is as of (a watch from the
    /// next revision misses nothing after it).
    pub fn get_at(&self, key: &str, deadline: Instant) -> Result<(Option<Entry>, i64)> {
        self.get_with(key, Read::Linearizable, deadline)
    }

    /// The key's entry, read as `read` says, and the revision of the answer.
    fn get_with(&self, key: &str, read: Read, deadline: Instant) -> Result<(Option<Entry>, i64)> {
        let r = self.call("etcd get", deadline, |mut c| {
            let key = key.to_string();
            async move { c.get(key, Some(read.options())).await }
        })?;
        let entry = r.kvs().first().map(|kv| Entry {
            value: kv.value().to_vec(),
            create_revision: kv.create_revision(),
        });
        Ok((entry, r.header().map_or(0, |h| h.revision())))
    }

    /// Deletes `key`; whether it existed.
    pub fn delete(&self, key: &str, deadline: Instant) -> Result<bool> {
        let r = self.call("etcd delete", deadline, |mut c| {
            let key = key.to_string();
            async move { c.delete(key, None).await }
        })?;
        Ok(r.deleted() > 0)
    }

    /// Grants a lease of `ttl` (whole seconds, at least 1): its id and the TTL etcd gave
    /// it (etcd may raise it to its floor).
    pub fn grant(&self, ttl: Duration, deadline: Instant) -> Result<(i64, Duration)> {
        let secs = ttl.as_secs().max(1) as i64;
        let r = self.call("etcd lease grant", deadline, |mut c| async move {
            c.lease_grant(secs, None).await
        })?;
        Ok((r.id(), Duration::from_secs(r.ttl().max(0) as u64)))
    }

    /// Renews lease `id` once, to its full TTL from when etcd receives this; `false`
    /// when the lease is gone.
    pub fn keep_alive(&self, id: i64, deadline: Instant) -> Result<bool> {
        self.call("etcd lease keep-alive", deadline, |mut c| async move {
            // Opening the stream sends one renewal and reads its answer; one stream per
            // renewal goes to the member in use now, not to the one of the last renewal.
            match c.lease_keep_alive(id).await {
                Ok(_) => Ok(true),
                Err(etcd_client::Error::LeaseKeepAliveError(m)) if m == "lease not found" => {
                    Ok(false)
                }
                Err(e) => Err(e),
            }
        })
    }

    /// Revokes lease `id` (the keys attached to it go with it).
    pub fn revoke(&self, id: i64, deadline: Instant) -> Result<()> {
        self.call("etcd lease revoke", deadline, |mut c| async move {
            c.lease_revoke(id).await
        })?;
        Ok(())
    }

    /// Creates `key = value` attached to lease `lease` if the key does not exist, in one
    /// transaction; otherwise returns what it holds.
    pub fn create_with_lease(
        &self,
        key: &str,
        value: &[u8],
        lease: i64,
        deadline: Instant,
    ) -> Result<Created> {
        let txn = Txn::new()
            .when([Compare::create_revision(key, CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                key,
                value,
                Some(PutOptions::new().with_lease(lease)),
            )])
            .or_else([TxnOp::get(key, None)]);
        let r = self.call("etcd txn", deadline, |mut c| {
            let txn = txn.clone();
            async move { c.txn(txn).await }
        })?;
        if r.succeeded() {
            let rev = r.header().map_or(0, |h| h.revision());
            return Ok(Created::Won(rev));
        }
        let held = r.op_responses().into_iter().find_map(|op| match op {
            etcd_client::TxnOpResponse::Get(g) => g.kvs().first().map(|kv| Entry {
                value: kv.value().to_vec(),
                create_revision: kv.create_revision(),
            }),
            _ => None,
        });
        // The key vanished between the compare and the get of the same transaction cannot
        // happen (one revision); an empty answer is etcd misbehaving.
        held.map(Created::Held).ok_or(HaError::Unavailable {
            what: "etcd txn",
            reason: "a failed create-if-absent returned no entry".into(),
            source: None,
        })
    }
}

/// What a guarded write found (see [`Etcd::put_guarded`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Guarded {
    /// Written, at this revision.
    Done(i64),
    /// The guard key's create revision is not the one given (another leader's term, or
    /// none).
    NotOwner,
    /// The key exists already (with `absent` asked).
    Exists,
}

impl Etcd {
    /// Puts `key = value` in one transaction only if `guard`'s create revision is still
    /// `guard_rev` (a leader's term) and, with `absent`, `key` does not exist.
    pub fn put_guarded(
        &self,
        guard: &str,
        guard_rev: i64,
        key: &str,
        value: Vec<u8>,
        absent: bool,
        deadline: Instant,
    ) -> Result<Guarded> {
        let mut when = vec![Compare::create_revision(guard, CompareOp::Equal, guard_rev)];
        if absent {
            when.push(Compare::create_revision(key, CompareOp::Equal, 0));
        }
        // On failure, the guard's entry tells which condition failed.
        let txn = Txn::new()
            .when(when)
            .and_then([TxnOp::put(key, value, None)])
            .or_else([TxnOp::get(guard, None)]);
        let r = self.call("etcd guarded put", deadline, |mut c| {
            let txn = txn.clone();
            async move { c.txn(txn).await }
        })?;
        if r.succeeded() {
            return Ok(Guarded::Done(r.header().map_or(0, |h| h.revision())));
        }
        let owner = r.op_responses().into_iter().any(|op| match op {
            etcd_client::TxnOpResponse::Get(g) => g
                .kvs()
                .first()
                .is_some_and(|kv| kv.create_revision() == guard_rev),
            _ => false,
        });
        Ok(if owner {
            Guarded::Exists
        } else {
            Guarded::NotOwner
        })
    }

    /// Keys and values in `[from, end)`, in key order, at most `limit`, as fresh as
    /// `read` says.
    pub fn range(
        &self,
        from: &str,
        end: &str,
        limit: i64,
        read: Read,
        deadline: Instant,
    ) -> Result<Vec<(String, Vec<u8>)>> {
        let r = self.call("etcd range", deadline, |mut c| {
            let (from, end) = (from.to_string(), end.to_string());
            async move {
                c.get(from, Some(read.options().with_range(end).with_limit(limit)))
                    .await
            }
        })?;
        Ok(r.kvs()
            .iter()
            .map(|kv| {
                (
                    String::from_utf8_lossy(kv.key()).into_owned(),
                    kv.value().to_vec(),
                )
            })
            .collect())
    }

    /// Deletes the keys in `[from, end)`; how many there were.
    pub fn delete_range(&self, from: &str, end: &str, deadline: Instant) -> Result<i64> {
        let r = self.call("etcd delete range", deadline, |mut c| {
            let (from, end) = (from.to_string(), end.to_string());
            async move {
                c.delete(
                    from,
                    Some(etcd_client::DeleteOptions::new().with_range(end)),
                )
                .await
            }
        })?;
        Ok(r.deleted())
    }

    /// Compacts etcd's history up to `revision` (older versions of every key go).
    pub fn compact(&self, revision: i64, deadline: Instant) -> Result<()> {
        self.call("etcd compact", deadline, |mut c| async move {
            c.compact(revision, None).await
        })?;
        Ok(())
    }
}

/// Runs `fut` on `rt` and waits for it until `deadline`.
fn block<T>(
    rt: &tokio::runtime::Runtime,
    deadline: Instant,
    what: &'static str,
    fut: impl std::future::Future<Output = std::result::Result<T, etcd_client::Error>> + Send + 'static,
) -> Result<T>
where
    T: Send + 'static,
{
    let start = Instant::now();
    let left = deadline.saturating_duration_since(start);
    if left.is_zero() {
        return Err(HaError::Timeout {
            what,
            after: Duration::ZERO,
        });
    }
    // Spawned rather than driven by this thread, so that the caller may be any thread,
    // the runtime's own excepted, and a call abandoned at its deadline is dropped there.
    let task = rt.spawn(async move { tokio::time::timeout(left, fut).await });
    match rt.block_on(task) {
        Ok(Ok(Ok(v))) => Ok(v),
        Ok(Ok(Err(e))) => Err(HaError::from_etcd(what, e)),
        Ok(Err(_elapsed)) => Err(HaError::Timeout {
            what,
            after: start.elapsed(),
        }),
        Err(join) => Err(HaError::Unavailable {
            what,
            reason: format!("the etcd client's task failed: {join}"),
            source: None,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_files_must_be_pem() {
        let dir = std::env::temp_dir().join(format!("pagewire-tls-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (pem, junk) = (dir.join("ca.pem"), dir.join("junk"));
        std::fs::write(
            &pem,
            "-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        std::fs::write(&junk, [0u8, 1, 2, 3]).unwrap();
        let (p, j) = (pem.to_str().unwrap(), junk.to_str().unwrap());
        let t = Tls::from_pem_files(p, Some((p, p))).unwrap();
        assert!(
            format!("{t:?}").contains("client_certificate: true"),
            "{t:?}"
        );
        for (ca, client) in [(j, None), (p, Some((j, p))), (p, Some((p, "/nonexistent")))] {
            let e = Tls::from_pem_files(ca, client).unwrap_err();
            assert!(matches!(e, HaError::Misuse { .. }), "{e:?}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn credentials_from_the_environment() {
        let s = |v: &str| Some(v.to_string());
        assert_eq!(Credentials::from_vars(None, None, None).unwrap(), None);
        let c = Credentials::from_vars(s("kv"), s("pw"), None)
            .unwrap()
            .unwrap();
        assert_eq!((c.user(), c.password.as_str()), ("kv", "pw"));
        assert!(!format!("{c:?}").contains("pw\""), "{c:?}");
        let file = std::env::temp_dir().join(format!("pagewire-etcd-pw-{}", std::process::id()));
        std::fs::write(&file, "from-file\nignored\n").unwrap();
        let path = file.to_str().map(str::to_string);
        let c = Credentials::from_vars(s("kv"), None, path.clone())
            .unwrap()
            .unwrap();
        assert_eq!(c.password, "from-file");
        std::fs::remove_file(&file).unwrap();
        for (user, password, file) in [
            (None, s("secret"), None),
            (None, None, path.clone()),
            (s("kv"), None, None),
            (s("kv"), s("secret"), path.clone()),
            (s("kv"), None, path),
        ] {
            let e = Credentials::from_vars(user, password, file).unwrap_err();
            assert!(matches!(e, HaError::Misuse { .. }), "{e:?}");
            assert!(!e.to_string().contains("secret"), "{e}");
        }
    }

    #[test]
    fn endpoints_parse_and_refuse() {
        assert_eq!(
            parse_endpoints("etcd://10.0.0.1:2379;h2:2380, h3:1").unwrap(),
            ["10.0.0.1:2379", "h2:2380", "h3:1"]
        );
        for bad in [
            "10.0.0.1:2379",
            "etcd://",
            "etcd://;",
            "etcd://h",
            "etcd://h:port",
            "etcd://:2379",
            "etcd://h:70000",
        ] {
            assert!(
                matches!(parse_endpoints(bad), Err(HaError::Misuse { .. })),
                "{bad}"
            );
        }
    }

    #[test]
    fn a_call_past_its_deadline_is_a_timeout_without_io() {
        // No member listens on port 9 of 127.0.0.1; the deadline has passed already.
        let e = Etcd::connect(
            "etcd://127.0.0.1:9",
            Instant::now() + Duration::from_secs(2),
        )
        .expect("connecting is lazy");
        let r = e.get("k", Instant::now());
        assert!(matches!(r, Err(HaError::Timeout { .. })), "{r:?}");
        let r = e.get("k", Instant::now() + Duration::from_secs(2));
        assert!(matches!(r, Err(HaError::Unavailable { .. })), "{r:?}");
    }
}
