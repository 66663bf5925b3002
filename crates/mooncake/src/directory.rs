//! Segment names through a metadata directory (Mooncake's metadata server, e.g.
//! `etcd://h:p`), instead of the P2P handshake's `host:port` names.
//!
//! With a directory an engine's segment name is the `local_hostname` it was given
//! (`prefill-0`, `10.0.0.1:12345`: any string), and [`SegmentDescriptor`] is what it
//! publishes under that name: where its handshake listener is and which engine answers
//! there. A peer that opens the name looks it up, connects to that address, and checks
//! that the engine it reached is the one published (a stale entry whose port another
//! engine took since is refused, not used). The registered buffers are not in the
//! directory: the handshake describes them, as in P2P mode.
//!
//! This crate only defines the contract ([`MetadataDirectory`]); the etcd implementation
//! lives in `pagewire-ha` (so this crate stays free of an async runtime), and
//! `pagewire_ha::mooncake::new_engine` picks it for an `etcd://` address.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::sid;

/// Longest encoded descriptor accepted from a directory (a real one is under 200 bytes).
pub const MAX_DESCRIPTOR_BYTES: usize = 4096;
/// Longest segment name (bytes) an engine may publish or look up.
pub const MAX_SEGMENT_NAME_BYTES: usize = 512;
/// First line of an encoded descriptor: the format and its version.
const MAGIC: &str = "pagewire-te-segment 1";

/// What a peer needs to reach the engine that published a segment name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentDescriptor {
    /// The segment name (the engine's `local_hostname`).
    pub name: String,
    /// The handshake listener, `host:port` (`[v6]:port`).
    pub rpc: String,
    /// The transport engine's random id, which the handshake reports: a connection
    /// that reaches another engine at that address is not this segment.
    pub engine_id: u64,
    /// The backend the engine runs (`tcp`, `verbs`, ...), for people reading etcd.
    pub backend: String,
}

impl SegmentDescriptor {
    /// The bytes stored in the directory: `key=value` lines after a magic line.
    pub fn encode(&self) -> Vec<u8> {
        format!(
            "{MAGIC}\nname={}\nrpc={}\nengine_id={:016x}\nbackend={}\n",
            self.name, self.rpc, self.engine_id, self.backend
        )
        .into_bytes()
    }

    /// Parses what [`Self::encode`] wrote. The bytes come from a shared service and are
    /// checked as hostile: size, UTF-8, every field present once, the address a valid
    /// `host:port`, the name the one looked up (by the caller).
    pub fn decode(bytes: &[u8]) -> Result<SegmentDescriptor, String> {
        if bytes.len() > MAX_DESCRIPTOR_BYTES {
            return Err(format!(
                "{} bytes, more than {MAX_DESCRIPTOR_BYTES}",
                bytes.len()
            ));
        }
        let text = std::str::from_utf8(bytes).map_err(|_| "not UTF-8".to_string())?;
        let mut lines = text.lines();
        if lines.next() != Some(MAGIC) {
            return Err(format!("does not start with {MAGIC:?}"));
        }
        let (mut name, mut rpc, mut id, mut backend) = (None, None, None, None);
        for line in lines {
            let (k, v) = line
                .split_once('=')
                .ok_or_else(|| format!("line {line:?} is not key=value"))?;
            let slot = match k {
                "name" => &mut name,
                "rpc" => &mut rpc,
                "engine_id" => &mut id,
                "backend" => &mut backend,
                // Later versions may add fields.
                _ => continue,
            };
            if slot.replace(v.to_owned()).is_some() {
                return Err(format!("field {k} appears twice"));
            }
        }
        let need = |v: Option<String>, k: &str| v.ok_or_else(|| format!("field {k} missing"));
        let (name, rpc) = (need(name, "name")?, need(rpc, "rpc")?);
        let id = need(id, "engine_id")?;
        let engine_id =
            u64::from_str_radix(&id, 16).map_err(|_| format!("engine_id {id:?} is not hex"))?;
        sid::parse(&rpc).map_err(|why| format!("rpc {rpc:?}: {why}"))?;
        Ok(SegmentDescriptor {
            name,
            rpc,
            engine_id,
            backend: need(backend, "backend")?,
        })
    }
}

/// Checks a segment name for a directory: not empty, at most
/// [`MAX_SEGMENT_NAME_BYTES`], no control characters.
pub fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("the segment name is empty".into());
    }
    if name.len() > MAX_SEGMENT_NAME_BYTES {
        return Err(format!(
            "the segment name is {} bytes, more than {MAX_SEGMENT_NAME_BYTES}",
            name.len()
        ));
    }
    if name.chars().any(char::is_control) {
        return Err(format!("the segment name {name:?} has control characters"));
    }
    Ok(())
}

/// Why a directory call failed, grouped by who is at fault.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum DirectoryError {
    /// The caller's fault: a malformed address or name.
    #[error("{reason}")]
    Misuse {
        /// What is wrong.
        reason: String,
    },
    /// Another live engine holds the name (its entry goes with its lease).
    #[error("segment name {name:?} is held by another live engine ({holder})")]
    Taken {
        /// The name.
        name: String,
        /// The holder's handshake address, as published.
        holder: String,
    },
    /// The directory holds bytes under the name that are not a descriptor.
    #[error("segment name {name:?}: the directory's entry is malformed: {reason}")]
    Malformed {
        /// The name.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The call's deadline passed before the directory answered.
    #[error("{what}: no answer from the metadata directory within {after:?}")]
    Timeout {
        /// The call.
        what: &'static str,
        /// How long it waited.
        after: Duration,
    },
    /// The directory (or the path to it) failed the call.
    #[error("{what}: metadata directory unavailable: {reason}")]
    Unavailable {
        /// The call.
        what: &'static str,
        /// Why, in words.
        reason: String,
        /// The client's error, when there is one.
        #[source]
        source: Option<Arc<dyn std::error::Error + Send + Sync>>,
    },
}

/// Where engines publish their segment names and find each other's: Mooncake's
/// metadata server. Every call finishes by its `deadline`.
pub trait MetadataDirectory: Send + Sync + std::fmt::Debug {
    /// Publishes `desc` under `desc.name` for as long as this engine lives: the entry
    /// stays while the implementation keeps it alive and disappears by itself (within
    /// a bounded time) if this process dies. [`DirectoryError::Taken`] when another
    /// live engine holds the name.
    fn publish(&self, desc: &SegmentDescriptor, deadline: Instant) -> Result<(), DirectoryError>;

    /// The descriptor published under `name`; `None` when nobody holds it.
    fn resolve(
        &self,
        name: &str,
        deadline: Instant,
    ) -> Result<Option<SegmentDescriptor>, DirectoryError>;

    /// Withdraws what this directory published under `name` (nothing if it published
    /// nothing there).
    fn remove(&self, name: &str, deadline: Instant) -> Result<(), DirectoryError>;

    /// A short description for logs, e.g. `etcd://127.0.0.1:2379 key pagewire/te/...`.
    fn describe(&self) -> String;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc() -> SegmentDescriptor {
        SegmentDescriptor {
            name: "prefill-0".into(),
            rpc: "10.0.0.1:15123".into(),
            engine_id: 0xdead_beef_0123_4567,
            backend: "tcp".into(),
        }
    }

    #[test]
    fn descriptor_round_trip() {
        let d = desc();
        assert_eq!(SegmentDescriptor::decode(&d.encode()).unwrap(), d);
        let mut v6 = desc();
        v6.rpc = "[::1]:7".into();
        v6.name = "a/b c:9".into();
        assert_eq!(SegmentDescriptor::decode(&v6.encode()).unwrap(), v6);
        // Fields of a later version are ignored.
        let mut more = d.encode();
        more.extend_from_slice(b"future=1\n");
        assert_eq!(SegmentDescriptor::decode(&more).unwrap(), d);
    }

    #[test]
    fn hostile_descriptors_are_refused() {
        let good = String::from_utf8(desc().encode()).unwrap();
        let cases = [
            String::new(),
            "garbage".into(),
            good.replace(MAGIC, "pagewire-te-segment 0"),
            good.replace("rpc=10.0.0.1:15123", "rpc=10.0.0.1"),
            good.replace("rpc=10.0.0.1:15123", "rpc=h:0"),
            good.replace("engine_id=deadbeef01234567", "engine_id=zz"),
            good.replace("backend=tcp\n", ""),
            good.clone() + "name=other\n",
            good.replace("name=prefill-0\n", "noequals\n"),
            format!("{good}pad={}\n", "x".repeat(MAX_DESCRIPTOR_BYTES)),
        ];
        for c in cases {
            assert!(SegmentDescriptor::decode(c.as_bytes()).is_err(), "{c:?}");
        }
        assert!(SegmentDescriptor::decode(&[0xff, 0xfe]).is_err());
    }

    #[test]
    fn names() {
        assert!(check_name("prefill-0").is_ok());
        assert!(check_name("10.0.0.1:12345").is_ok());
        assert!(check_name("").is_err());
        assert!(check_name("a\nb").is_err());
        assert!(check_name(&"x".repeat(MAX_SEGMENT_NAME_BYTES + 1)).is_err());
    }
}
