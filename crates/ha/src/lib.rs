//! Coordination on etcd for the pagewire store: masters elect a leader through an etcd
//! lease and key, and clients and storage nodes given an `etcd://h:p;h:p` address follow
//! that leader.
//!
//! * [`HaMaster`]: a store master that campaigns; one leads and answers, the others
//!   stand by. A leader that cannot renew its lease stops answering before etcd could
//!   elect another one ([`leader`] says how).
//! * [`EtcdLocator`]: the store client's [`pagewire_store::MasterLocator`] on etcd.
//!   [`client_config`] builds client settings for either kind of address.
//! * [`oplog`]: the leader's op-log on etcd ([`oplog::EtcdJournal`]) and the standbys'
//!   reader ([`oplog::Follower`]), so that a new leader keeps the old one's objects.
//! * [`EtcdDirectory`]: the Mooncake transfer engine's metadata server on etcd
//!   (`etcd://` in `TransferEngine.initialize`); [`new_engine`] picks it by address.
//! * [`shard`]: a cluster's key space split over several leader groups
//!   ([`HaMaster::start_shard`]; clients route by key).
//! * [`Etcd`]: the small synchronous etcd client all of them use (one private runtime thread),
//!   with [`Watch`]es that follow keys without polling.
//!
//! The store itself stays free of tokio: only this crate depends on the async etcd
//! client. `docs/store.md` ("Masters on etcd") describes the design and its limits.
#![warn(missing_docs)]

pub mod error;
pub mod etcd;
pub mod leader;
pub mod locate;
pub mod mooncake;
pub mod oplog;
pub mod shard;
#[doc(hidden)]
pub mod testkit;
pub mod watch;

pub use error::{HaError, Result};
pub use etcd::{Access, Credentials, Etcd, Read, Tls, parse_endpoints};
pub use leader::{DEFAULT_SNAPSHOT_EVERY, HaConfig, HaMaster, Role, leader_key};
pub use locate::{EtcdLocator, client_config, client_config_as};
pub use mooncake::{EtcdDirectory, new_engine};
pub use shard::{shard_cluster_id, shards_key};
pub use watch::{Watch, WatchSpec, Watched};
