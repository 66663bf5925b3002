//! The master's rules with a fake clock: unit tests per rule, and a property test that
//! runs random operation sequences against a model of what must stay visible.

use super::*;
use crate::proto::PutFinish;
use proptest::prelude::*;
use std::collections::HashSet;

const MIB: u64 = 1 << 20;
/// The remote key nodes mount with in these tests.
const RKEY: u32 = 0x5eed;

fn cfg() -> CoreConfig {
    CoreConfig {
        lease_ttl_ms: 1_000,
        client_ttl_ms: 2_000,
        heartbeat_ms: 100,
        put_discard_ms: 3_000,
        put_release_ms: 10_000,
        revoke_grace_ms: 500,
        ..CoreConfig::default()
    }
}

struct World {
    core: MasterCore,
    now: Millis,
}

impl World {
    fn new(cfg: CoreConfig) -> Self {
        cfg.validate().unwrap();
        World {
            core: MasterCore::new(cfg, 7),
            now: 1_000,
        }
    }
    fn client(&mut self, ep: &str) -> u64 {
        self.core.hello(self.now, 0, ep).unwrap().0
    }
    fn node(&mut self, ep: &str, base: u64, size: u64) -> (u64, u64) {
        let c = self.client(ep);
        let s = self.core.mount(self.now, c, base, size, RKEY).unwrap();
        (c, s)
    }
    fn start(&mut self, c: u64, items: &[(&str, u64)], replicas: u8) -> Placement {
        let req = proto::PutStart {
            replicas,
            pin: Pin::None,
            preferred: String::new(),
            items: items
                .iter()
                .map(|(k, s)| (k.as_bytes().to_vec(), *s))
                .collect(),
        };
        let p = self.core.put_start(self.now, c, &req).unwrap();
        self.core.check();
        p
    }
    fn finish(&mut self, c: u64, done: &[&str], revoked: &[&str]) -> Vec<Code> {
        let f = PutFinish {
            done: done.iter().map(|k| k.as_bytes().to_vec()).collect(),
            revoked: revoked.iter().map(|k| k.as_bytes().to_vec()).collect(),
            suspects: vec![],
        };
        let r = self.core.put_finish(self.now, c, &f).unwrap();
        self.core.check();
        r
    }
    fn put(&mut self, c: u64, key: &str, size: u64) -> Result<Vec<Replica>, Code> {
        let p = self.start(c, &[(key, size)], 1);
        let r = p.items.into_iter().next().unwrap()?;
        assert_eq!(self.finish(c, &[key], &[]), [Code::Ok]);
        Ok(r)
    }
    fn get(&mut self, keys: &[&str], lease: bool) -> Found {
        let keys: Vec<Vec<u8>> = keys.iter().map(|k| k.as_bytes().to_vec()).collect();
        self.core.get(self.now, 0, &keys, lease)
    }
    /// Whether the key is visible, without leasing it (the model's view).
    fn exists(&self, key: &str) -> bool {
        self.core
            .objects
            .get(key.as_bytes())
            .is_some_and(|o| o.state == State::Complete)
    }
    fn remove(&mut self, key: &str, force: bool) -> Code {
        let r = self
            .core
            .remove(self.now, &[key.as_bytes().to_vec()], force)[0];
        self.core.check();
        r
    }
    fn advance(&mut self, ms: u64) -> TickReport {
        self.now += ms;
        let r = self.core.tick(self.now);
        self.core.check();
        r
    }
}

#[test]
fn put_publishes_only_at_finish_and_first_write_wins() {
    let mut w = World::new(cfg());
    let (_, seg) = w.node("n1:1", 0x10_0000, 8 * MIB);
    let c = w.client("c:1");
    let p = w.start(c, &[("a", 4096), ("a", 10), ("b", 1)], 1);
    let reps = p.items[0].clone().unwrap();
    assert_eq!(reps.len(), 1);
    assert_eq!(reps[0].segment, seg);
    assert!(reps[0].addr >= 0x10_0000 && reps[0].addr + 4096 <= 0x10_0000 + 8 * MIB);
    assert_eq!(
        p.items[1],
        Err(Code::AlreadyExists),
        "same key twice in one request"
    );
    assert_eq!(
        p.segments,
        [SegmentRef {
            id: seg,
            endpoint: "n1:1".into(),
            base: 0x10_0000,
            rkey: RKEY,
        }]
    );
    // Invisible while pending.
    assert!(!w.exists("a"));
    assert_eq!(w.get(&["a"], true).items[0], Err(Code::NotReady));
    assert_eq!(w.remove("a", true), Code::NotReady);
    // Another client cannot finish or revoke it.
    let other = w.client("c:2");
    assert_eq!(
        w.finish(other, &["a"], &["b"]),
        [Code::NotFound, Code::NotFound]
    );
    assert_eq!(w.finish(c, &["a"], &["b"]), [Code::Ok, Code::Ok]);
    assert!(w.exists("a") && !w.exists("b"));
    let f = w.get(&["a"], false);
    assert_eq!(f.items[0].as_ref().unwrap().size, 4096);
    assert_eq!(f.items[0].as_ref().unwrap().replicas, reps);
    assert_eq!(f.lease_ttl_ms, 0);
    // First write wins.
    let p = w.start(other, &[("a", 99)], 1);
    assert_eq!(p.items[0], Err(Code::AlreadyExists));
    assert_eq!(w.get(&["a"], false).items[0].as_ref().unwrap().size, 4096);
    // Unknown clients are refused as a whole.
    let req = proto::PutStart {
        replicas: 1,
        pin: Pin::None,
        preferred: String::new(),
        items: vec![],
    };
    assert_eq!(
        w.core.put_start(w.now, 12345, &req),
        Err(Code::UnknownClient)
    );
}

#[test]
fn replicas_go_to_distinct_segments_on_distinct_endpoints_first() {
    let mut w = World::new(cfg());
    let c = w.client("n1:1");
    let s1 = w.core.mount(w.now, c, 0, 4 * MIB, RKEY).unwrap();
    let s2 = w.core.mount(w.now, c, 8 * MIB, 4 * MIB, RKEY).unwrap();
    assert_eq!(
        w.core.mount(w.now, c, 2 * MIB, 4 * MIB, RKEY),
        Err(Code::InvalidParams),
        "overlaps a segment of the same endpoint"
    );
    let (_, s3) = w.node("n2:1", 0, 4 * MIB);
    for i in 0..20 {
        let p = w.start(c, &[(&format!("k{i}"), 1000)], 2);
        let reps = p.items[0].clone().unwrap();
        assert_eq!(reps.len(), 2);
        let segs: HashSet<u64> = reps.iter().map(|r| r.segment).collect();
        assert_eq!(segs.len(), 2);
        assert!(
            segs.contains(&s3),
            "the second endpoint is used before a second segment of the first"
        );
    }
    // Three replicas: all three segments (two share an endpoint).
    let p = w.start(c, &[("three", 1000)], 3);
    let segs: HashSet<u64> = p.items[0]
        .as_ref()
        .unwrap()
        .iter()
        .map(|r| r.segment)
        .collect();
    assert_eq!(segs, HashSet::from([s1, s2, s3]));
    // More replicas than segments: best effort.
    let p = w.start(c, &[("five", 1000)], 5);
    assert_eq!(p.items[0].as_ref().unwrap().len(), 3);
    // Preferred endpoint first.
    let req = proto::PutStart {
        replicas: 1,
        pin: Pin::None,
        preferred: "n2:1".into(),
        items: (0..5).map(|i| (format!("p{i}").into_bytes(), 64)).collect(),
    };
    let p = w.core.put_start(w.now, c, &req).unwrap();
    for it in p.items {
        assert_eq!(it.unwrap()[0].segment, s3);
    }
}

#[test]
fn remove_matching_takes_matching_complete_unleased_keys_only() {
    let mut w = World::new(CoreConfig {
        client_ttl_ms: 60_000,
        ..cfg()
    });
    w.node("n1:1", 0, 8 * MIB);
    let c = w.client("c:1");
    for k in ["rx1", "rx2", "rxz", "other"] {
        w.put(c, k, 64).unwrap();
    }
    w.get(&["rx2"], true);
    let digit_tail = |k: &[u8]| k.starts_with(b"rx") && k.last().is_some_and(u8::is_ascii_digit);
    assert_eq!(
        w.core.remove_matching(w.now, false, digit_tail),
        1,
        "rx2 is leased"
    );
    assert_eq!(w.remove("rx1", false), Code::NotFound);
    assert_eq!(
        w.core.remove_matching(w.now, true, digit_tail),
        1,
        "force takes rx2"
    );
    assert_eq!(w.remove("rxz", false), Code::Ok);
    assert_eq!(w.remove("other", false), Code::Ok);
}

#[test]
fn leases_block_removal_and_eviction_until_they_end() {
    let mut w = World::new(CoreConfig {
        client_ttl_ms: 60_000,
        ..cfg()
    });
    w.node("n1:1", 0, 8 * MIB);
    let c = w.client("c:1");
    w.put(c, "a", 4096).unwrap();
    let f = w.get(&["a"], true);
    assert_eq!(f.lease_ttl_ms, 1_000);
    assert_eq!(w.remove("a", false), Code::HasLease);
    assert_eq!(w.core.remove_all(w.now, false), 0);
    w.advance(999);
    assert_eq!(w.remove("a", false), Code::HasLease);
    w.advance(2);
    assert_eq!(w.remove("a", false), Code::Ok);
    assert_eq!(w.remove("a", false), Code::NotFound);
    // An existence check leases too (Mooncake's ExistKey does).
    w.put(c, "e", 64).unwrap();
    assert_eq!(
        w.core.exist(w.now, &[b"e".to_vec(), b"none".to_vec()]),
        [Code::Ok, Code::NotFound]
    );
    assert_eq!(w.remove("e", false), Code::HasLease);
    w.advance(1_001);
    assert_eq!(w.remove("e", false), Code::Ok);
    // A forced removal frees the space only when the lease ends.
    w.put(c, "b", 4096).unwrap();
    w.get(&["b"], true);
    let used = w.core.stats().used;
    assert_eq!(w.remove("b", true), Code::Ok);
    assert!(!w.exists("b"));
    w.advance(500);
    assert_eq!(w.core.stats().used, used, "held while the lease runs");
    w.advance(501);
    assert_eq!(w.core.stats().used, 0);
}

#[test]
fn eviction_at_the_watermark_is_lru_and_skips_leased_pending_and_pinned() {
    let mut w = World::new(cfg());
    w.node("n1:1", 0, 100 * 64 * 1024);
    let c = w.client("c:1");
    let obj = 64 * 1024;
    // Objects 0..89 fill 90 %: the 90th put reaches the watermark.
    for i in 0..89 {
        w.put(c, &format!("o{i}"), obj).unwrap();
        w.now += 1;
    }
    assert_eq!(w.core.stats().evicted, 0);
    // Lease o0, pin o1 hard, leave o2 pending (a fresh put) and touch o3 (recently used).
    w.get(&["o0"], true);
    w.get(&["o3"], false);
    let req = proto::PutStart {
        replicas: 1,
        pin: Pin::Hard,
        preferred: String::new(),
        items: vec![(b"hard".to_vec(), obj)],
    };
    w.core.put_start(w.now, c, &req).unwrap();
    w.finish(c, &["hard"], &[]);
    w.start(c, &[("pending", obj)], 1);
    w.core.check();
    let st = w.core.stats();
    assert!(st.evicted >= 5, "about 5 % evicted: {st:?}");
    assert!(st.used as f64 <= 0.9 * st.capacity as f64);
    assert!(w.exists("o0"), "leased");
    assert!(w.exists("hard"), "hard-pinned");
    assert!(w.exists("o3"), "recently used");
    assert_eq!(
        w.finish(c, &["pending"], &[]),
        [Code::Ok],
        "pending survives"
    );
    // LRU: exactly the oldest unprotected objects went.
    let order: Vec<String> = (0..89)
        .filter(|&i| i != 0 && i != 3)
        .map(|i| format!("o{i}"))
        .collect();
    let n = st.evicted as usize;
    for (j, k) in order.iter().enumerate() {
        assert_eq!(w.exists(k), j >= n, "{k} (LRU position {j}, {n} evicted)");
    }
}

#[test]
fn a_put_that_finds_no_room_evicts_synchronously_then_gives_up() {
    let mut c = cfg();
    c.high_watermark = 1.0; // no background eviction: only the synchronous kind
    let mut w = World::new(c);
    w.node("n1:1", 0, 10 * 4096 + 64);
    let cl = w.client("c:1");
    for i in 0..10 {
        w.put(cl, &format!("o{i}"), 4096).unwrap();
        w.now += 1;
    }
    assert_eq!(w.core.stats().evicted, 0);
    w.put(cl, "new", 4096).expect("evicts the oldest");
    assert!(!w.exists("o0") && w.exists("o9") && w.exists("new"));
    // Lease everything: nothing can go, so the put fails with NoSpace.
    let all: Vec<String> = (1..10)
        .map(|i| format!("o{i}"))
        .chain(["new".into()])
        .collect();
    let refs: Vec<&str> = all.iter().map(|s| s.as_str()).collect();
    w.get(&refs, true);
    let p = w.start(cl, &[("x", 4096)], 1);
    assert_eq!(p.items[0], Err(Code::NoSpace));
    // Larger than any segment: NoSpace.
    let p = w.start(cl, &[("huge", 12 * 4096)], 1);
    assert_eq!(p.items[0], Err(Code::NoSpace));
}

#[test]
fn silent_clients_lose_their_segments_and_puts() {
    let mut w = World::new(cfg());
    let (n1, s1) = w.node("n1:1", 0, 8 * MIB);
    let (n2, s2) = w.node("n2:1", 0, 8 * MIB);
    let c = w.client("c:1");
    // Two replicas of "both", one of "solo" on n1 (preferred).
    let p = w.start(c, &[("both", 4096)], 2);
    assert_eq!(p.items[0].as_ref().unwrap().len(), 2);
    w.finish(c, &["both"], &[]);
    let req = proto::PutStart {
        replicas: 1,
        pin: Pin::None,
        preferred: "n1:1".into(),
        items: vec![(b"solo".to_vec(), 4096), (b"pending".to_vec(), 4096)],
    };
    w.core.put_start(w.now, c, &req).unwrap();
    w.finish(c, &["solo"], &[]);
    // n1 goes silent; the others keep talking.
    for _ in 0..25 {
        w.core.touch(w.now, n2).unwrap();
        w.core.touch(w.now, c).unwrap();
        w.advance(100);
    }
    assert_eq!(w.core.touch(w.now, n1), Err(Code::UnknownClient));
    let st = w.core.stats();
    assert_eq!(st.segments, 1);
    assert!(!w.exists("solo"), "its only replica was on n1");
    let f = w.get(&["both"], false);
    assert_eq!(f.items[0].as_ref().unwrap().replicas.len(), 1);
    assert_eq!(f.items[0].as_ref().unwrap().replicas[0].segment, s2);
    assert_eq!(
        w.finish(c, &["pending"], &[]),
        [Code::NotFound],
        "its replica went with n1"
    );
    let _ = s1;
    // A writer that dies: its puts are taken away, the key is free at once.
    let dead = w.client("dead:1");
    w.start(dead, &[("zombie", 4096)], 1);
    for _ in 0..25 {
        w.core.touch(w.now, n2).unwrap();
        w.advance(100);
    }
    assert!(w.core.stats().reclaimed >= 1);
    let c2 = w.client("c:2");
    w.put(c2, "zombie", 10).expect("key free again");
}

#[test]
fn unfinished_puts_are_reclaimed_and_their_space_held_until_release() {
    let mut w = World::new(cfg());
    let (n, _) = w.node("n1:1", 0, 8 * MIB);
    let c = w.client("c:1");
    w.start(c, &[("slow", MIB)], 1);
    let keep = |w: &mut World| {
        w.core.touch(w.now, n).unwrap();
        w.core.touch(w.now, c).unwrap();
    };
    keep(&mut w);
    w.advance(1_000);
    keep(&mut w);
    w.advance(1_000);
    keep(&mut w);
    let r = w.advance(1_500);
    assert_eq!(r.puts_reclaimed, 1);
    assert_eq!(w.finish(c, &["slow"], &[]), [Code::NotFound]);
    assert_eq!(
        w.core.stats().used,
        MIB,
        "held: the writer may still be writing"
    );
    for _ in 0..7 {
        keep(&mut w);
        w.advance(1_000);
    }
    assert_eq!(
        w.core.stats().used,
        0,
        "released put_release_ms after the start"
    );
    // A revoked put's space waits revoke_grace_ms.
    keep(&mut w);
    w.start(c, &[("r", MIB)], 1);
    assert_eq!(w.finish(c, &[], &["r"]), [Code::Ok]);
    assert_eq!(w.core.stats().used, MIB);
    w.advance(400);
    assert_eq!(w.core.stats().used, MIB);
    w.advance(200);
    assert_eq!(w.core.stats().used, 0);
}

#[test]
fn segments_of_a_closed_owner_take_nothing_until_it_speaks() {
    let mut w = World::new(cfg());
    let (n1, s1) = w.node("n1:1", 0, 8 * MIB);
    let (_n2, s2) = w.node("n2:1", 0, 8 * MIB);
    let c = w.client("c:1");
    w.core.disconnected(n1);
    for i in 0..10 {
        let p = w.start(c, &[(&format!("a{i}"), 64)], 1);
        assert_eq!(p.items[0].as_ref().unwrap()[0].segment, s2);
    }
    w.core.touch(w.now, n1).unwrap();
    let segs: HashSet<u64> = (0..10)
        .map(|i| {
            w.start(c, &[(&format!("b{i}"), 64)], 1).items[0]
                .as_ref()
                .unwrap()[0]
                .segment
        })
        .collect();
    assert_eq!(segs, HashSet::from([s1, s2]));
}

/// Where `key` (one replica) was placed.
fn placed(w: &mut World, c: u64, key: &str) -> Result<u64, Code> {
    w.start(c, &[(key, 64)], 1).items[0]
        .as_ref()
        .map(|r| r[0].segment)
        .map_err(|e| *e)
}

/// The segments four one-replica puts of `c` land on (keys `tag0`..`tag3`).
fn spread(w: &mut World, c: u64, tag: &str) -> HashSet<u64> {
    (0..4)
        .map(|i| placed(w, c, &format!("{tag}{i}")).unwrap())
        .collect()
}

/// Places keys until both segments were named to `c`.
fn name_both(w: &mut World, c: u64, tag: &str) {
    let got = spread(w, c, tag);
    assert_eq!(got.len(), 2, "{got:?}");
}

#[test]
fn one_clients_reports_do_not_stop_placement_on_a_live_node() {
    // The attack of issue 29 item 4: a client reports every segment, over and over.
    let mut w = World::new(cfg());
    let (n1, s1) = w.node("n1:1", 0, 8 * MIB);
    let (n2, s2) = w.node("n2:1", 0, 8 * MIB);
    let bad = w.client("bad:1");
    let good = w.client("good:1");
    name_both(&mut w, bad, "x");
    for i in 0..50 {
        w.now += 100;
        w.core.touch(w.now, n1).unwrap();
        w.core.touch(w.now, n2).unwrap();
        w.core.report(w.now, bad, &[s1, s2]).unwrap();
        assert!(
            placed(&mut w, good, &format!("g{i}")).is_ok(),
            "report {i} stopped another client's put"
        );
    }
    // Both segments still take replicas, in turn.
    let segs = spread(&mut w, good, "h");
    assert_eq!(segs, HashSet::from([s1, s2]));
    // The reporter is the one held back: its puts are refused.
    assert_eq!(placed(&mut w, bad, "b"), Err(Code::TransferFailed));
}

#[test]
fn reports_count_only_for_segments_named_to_the_reporter() {
    let mut w = World::new(cfg());
    let (_n1, s1) = w.node("n1:1", 0, 8 * MIB);
    let (_n2, s2) = w.node("n2:1", 0, 8 * MIB);
    let a = w.client("a:1");
    let b = w.client("b:1");
    // Neither was told of any segment: their reports are noise, even together and with
    // the owners silent.
    w.core.report(w.now, a, &[s1]).unwrap();
    w.core.report(w.now, b, &[s1]).unwrap();
    w.now += 10 * cfg().heartbeat_ms;
    w.core.touch(w.now, a).unwrap();
    let segs = spread(&mut w, b, "k");
    assert_eq!(segs, HashSet::from([s1, s2]));
}

#[test]
fn reports_are_confirmed_by_a_second_client_or_the_owners_silence() {
    let mut w = World::new(cfg());
    let hb = cfg().heartbeat_ms;
    let (n1, s1) = w.node("n1:1", 0, 8 * MIB);
    let (n2, s2) = w.node("n2:1", 0, 8 * MIB);
    let a = w.client("a:1");
    let b = w.client("b:1");
    name_both(&mut w, a, "a");
    name_both(&mut w, b, "b");
    // Two clients agree: s1 takes nothing, though its owner keeps talking.
    w.core.report(w.now, a, &[s1]).unwrap();
    w.core.report(w.now, b, &[s1]).unwrap();
    w.core.touch(w.now, n1).unwrap();
    for i in 0..4 {
        assert_eq!(placed(&mut w, a, &format!("c{i}")), Ok(s2));
    }
    // Until the reports age out (client_ttl_ms).
    w.now += cfg().client_ttl_ms + 1;
    w.core.touch(w.now, n1).unwrap();
    w.core.touch(w.now, n2).unwrap();
    w.core.touch(w.now, b).unwrap();
    name_both(&mut w, a, "d");
    name_both(&mut w, b, "e");
    // One report, then the owner goes silent for two heartbeats: confirmed by the
    // master's own view.
    w.core.report(w.now, a, &[s2]).unwrap();
    w.now += hb;
    w.core.touch(w.now, n1).unwrap();
    assert!(
        (0..4)
            .map(|i| placed(&mut w, b, &format!("f{i}")).unwrap())
            .any(|s| s == s2),
        "one heartbeat late is not yet silence"
    );
    w.now += hb;
    w.core.touch(w.now, n1).unwrap();
    for i in 0..4 {
        assert_eq!(placed(&mut w, b, &format!("g{i}")), Ok(s1));
    }
    // The owner speaks again: its word outweighs one report.
    w.core.touch(w.now, n2).unwrap();
    let segs = spread(&mut w, b, "h");
    assert_eq!(segs, HashSet::from([s1, s2]));
    // Both confirmed failing: no room anywhere.
    w.core.report(w.now, a, &[s1, s2]).unwrap();
    w.core.report(w.now, b, &[s1, s2]).unwrap();
    assert_eq!(placed(&mut w, a, "i"), Err(Code::NoSpace));
}

#[test]
fn a_client_whose_reports_nobody_confirms_is_held_back_longer_each_time() {
    let mut w = World::new(cfg());
    let (n1, s1) = w.node("n1:1", 0, 8 * MIB);
    let (n2, s2) = w.node("n2:1", 0, 8 * MIB);
    let bad = w.client("bad:1");
    let good = w.client("good:1");
    name_both(&mut w, bad, "x");
    name_both(&mut w, good, "g");
    let strike = |w: &mut World| {
        w.core.touch(w.now, n1).unwrap();
        w.core.report(w.now, bad, &[s1]).unwrap();
    };
    for _ in 0..STRIKES - 1 {
        strike(&mut w);
    }
    assert!(placed(&mut w, bad, "a").is_ok(), "not yet held back");
    strike(&mut w);
    assert_eq!(placed(&mut w, bad, "b"), Err(Code::TransferFailed));
    // What it reports while held back counts for nothing: with another client's report,
    // it would confirm s2.
    w.core.report(w.now, bad, &[s2]).unwrap();
    w.core.report(w.now, good, &[s2]).unwrap();
    w.core.touch(w.now, n1).unwrap();
    w.core.touch(w.now, n2).unwrap();
    let segs = spread(&mut w, good, "h");
    assert_eq!(
        segs,
        HashSet::from([s1, s2]),
        "a held-back client confirmed a report"
    );
    w.now += PENALTY_FIRST_MS;
    // Each unconfirmed report past the threshold doubles the period.
    let held_for = |w: &mut World, tag: &str| {
        let from = w.now;
        let mut i = 0;
        while placed(w, bad, &format!("{tag}{i}")) == Err(Code::TransferFailed) {
            w.now += 10;
            i += 1;
        }
        w.now - from
    };
    strike(&mut w);
    let first = held_for(&mut w, "c");
    strike(&mut w);
    let second = held_for(&mut w, "d");
    assert!(second >= 2 * first - 10, "{first} ms, then {second} ms");
    // A put that goes through clean clears its record.
    let p = w.start(bad, &[("e", 64)], 1);
    assert!(p.items[0].is_ok());
    assert_eq!(w.finish(bad, &["e"], &[]), [Code::Ok]);
    strike(&mut w);
    assert!(placed(&mut w, bad, "f").is_ok());
}

#[test]
fn a_remount_takes_replicas_at_once_under_its_new_key() {
    // The data path fences the old session (new registration, new key), so the master
    // need not wait: the node remounted after it was dropped is usable now, and every
    // reply names the new key.
    let mut w = World::new(cfg());
    let (n, s1) = w.node("n1:1", 0, MIB);
    let cl = w.client("c:1");
    let p = w.start(cl, &[("a", 64)], 1);
    assert_eq!(p.segments[0].rkey, RKEY);
    let old = p.items[0].clone().unwrap()[0];
    w.now += cfg().client_ttl_ms + 1;
    w.core.touch(w.now, cl).unwrap();
    w.advance(0);
    assert_eq!(w.core.stats().segments, 0, "silent node dropped");
    let n2 = w.core.hello(w.now, n, "n1:1").unwrap().0;
    assert_ne!(n2, n);
    let s2 = w.core.mount(w.now, n2, 0, MIB, RKEY + 2).unwrap();
    assert_ne!(s2, s1);
    let p = w.start(cl, &[("b", 64)], 1);
    let rep = p.items[0].clone().unwrap()[0];
    assert_eq!(rep.segment, s2);
    assert_eq!(
        rep.addr, old.addr,
        "the same bytes, handed out again at once"
    );
    assert_eq!(p.segments[0].rkey, RKEY + 2);
    assert_eq!(w.get(&["b"], false).items.len(), 1);
}

/// What a standby must agree on with its leader: segments `(id, endpoint, base, size,
/// rkey, owner)` and complete objects `(key, size, pin, replicas)`, sorted.
type Meta = (
    Vec<(u64, String, u64, u64, u32, u64)>,
    Vec<(Vec<u8>, u64, Pin, Vec<(u64, u64)>)>,
);

fn metadata(c: &MasterCore) -> Meta {
    let mut segs = Vec::new();
    let mut objs = Vec::new();
    for r in c.snapshot() {
        match r {
            Record::Mount {
                segment,
                endpoint,
                base,
                size,
                rkey,
                owner,
            } => segs.push((segment, endpoint, base, size, rkey, owner)),
            Record::Publish {
                key,
                size,
                pin,
                replicas,
            } => objs.push((key, size, pin, replicas)),
            other => panic!("{other:?} in a snapshot"),
        }
    }
    segs.sort();
    objs.sort_by(|a, b| a.0.cmp(&b.0));
    (segs, objs)
}

/// The op-log end to end in the core: a leader's records, encoded and decoded, rebuild
/// its metadata on a standby (as does its snapshot); once promoted, the standby serves
/// nothing from a segment until its owner remounts it (the same client id, endpoint,
/// base and size: same id, new rkey), and drops objects whose segments are not back
/// within the client TTL.
#[test]
fn a_promoted_standby_serves_the_leaders_objects_once_their_nodes_remount() {
    let mut w = World::new(cfg());
    w.core.set_logging(true);
    let (n1_id, s1) = w.node("n1:1", 0, MIB);
    let (_, s2) = w.node("n2:1", 1 << 30, MIB);
    let cl = w.client("c:1");
    let p = w.start(cl, &[("a", 100), ("b", 4096), ("c", 64), ("d", 64)], 2);
    assert_eq!(w.finish(cl, &["a", "b", "c"], &["d"]), [Code::Ok; 4]);
    assert_eq!(w.remove("c", false), Code::Ok);
    w.start(cl, &[("pending", 64)], 1);
    let log = w.core.take_log();
    let kinds: Vec<&str> = log
        .iter()
        .map(|r| match r {
            Record::Mount { .. } => "mount",
            Record::Publish { .. } => "publish",
            Record::Remove { .. } => "remove",
            _ => "other",
        })
        .collect();
    assert_eq!(
        kinds,
        ["mount", "mount", "publish", "publish", "publish", "remove"]
    );
    let wire = crate::oplog::encode(&log);
    let mut standby = World::new(cfg());
    assert_eq!(
        standby
            .core
            .apply(w.now, &crate::oplog::decode(&wire).unwrap()),
        0
    );
    standby.core.check();
    assert_eq!(metadata(&standby.core), metadata(&w.core));
    let mut from_snapshot = MasterCore::new(cfg(), 11);
    assert_eq!(from_snapshot.apply(0, &w.core.snapshot()), 0);
    assert_eq!(metadata(&from_snapshot), metadata(&w.core));
    assert_eq!(standby.core.stats().objects, 2);

    // Promotion: nothing is served until a node remounts.
    standby.core.promote(standby.now);
    assert_eq!(
        standby.get(&["a", "b"], false).items,
        [Err(Code::NotReady), Err(Code::NotReady)]
    );
    let c2 = standby.client("c:1");
    let none = standby.start(c2, &[("e", 64)], 1);
    assert_eq!(
        none.items,
        [Err(Code::NoSpace)],
        "no placement on awaiting segments"
    );
    // The node asks for its id again: registered under it, not resumed (it mounts).
    assert_eq!(
        standby.core.hello(standby.now, n1_id, "n1:1"),
        Ok((n1_id, false))
    );
    let n1 = n1_id;
    assert_eq!(
        standby.core.mount(standby.now, n1, 0, MIB, RKEY + 1),
        Ok(s1)
    );
    assert_eq!(
        standby.core.take_log(),
        [Record::Remount {
            segment: s1,
            rkey: RKEY + 1
        }]
    );
    let f = standby.get(&["a"], false);
    let a = f.items[0].clone().unwrap();
    assert_eq!(a.replicas.len(), 1, "only the remounted replica");
    assert_eq!(a.replicas[0].segment, s1);
    let before = &p.items[0].as_ref().unwrap();
    assert!(before.contains(&a.replicas[0]), "same address as before");
    assert_eq!(f.segments[0].rkey, RKEY + 1);
    // New space never overlaps the published objects' blocks.
    let e = standby.start(c2, &[("e", 64)], 1);
    let e = e.items[0].clone().unwrap()[0];
    for r in p.items.iter().take(2).flat_map(|i| i.as_ref().unwrap()) {
        assert!(r.segment != e.segment || r.addr.abs_diff(e.addr) >= 128);
    }
    // n2 never comes back: after the client TTL its segment goes, with its replicas.
    standby.now += cfg().client_ttl_ms + 1;
    standby.core.touch(standby.now, n1).unwrap();
    standby.core.touch(standby.now, c2).unwrap();
    standby.advance(0);
    assert_eq!(standby.core.stats().segments, 1);
    assert!(
        standby
            .core
            .take_log()
            .contains(&Record::Unmount { segment: s2 })
    );
    assert_eq!(standby.get(&["a", "b"], false).items.len(), 2);
    assert!(
        standby
            .get(&["a", "b"], false)
            .items
            .iter()
            .all(|i| i.is_ok())
    );
}

/// A leader with objects on one node (`n1:1`, id returned) and the standby promoted from
/// its op-log (encoded and decoded), the segment awaiting its owner.
fn promoted_with_object(key: &str) -> (World, u64, u64, Replica) {
    let mut w = World::new(cfg());
    w.core.set_logging(true);
    let (n, s) = w.node("n1:1", 0, MIB);
    let cl = w.client("c:1");
    let rep = w.put(cl, key, 4096).unwrap()[0];
    let wire = crate::oplog::encode(&w.core.take_log());
    // The same seed as the leader: the standby draws the ids the leader drew.
    let mut standby = World::new(cfg());
    assert_eq!(
        standby
            .core
            .apply(w.now, &crate::oplog::decode(&wire).unwrap()),
        0
    );
    standby.core.promote(standby.now);
    (standby, n, s, rep)
}

/// After a failover, bounds alone do not give a segment back: a process restarted on the
/// same endpoint (a new client id) mounting the same base and size gets a fresh segment,
/// and the old objects are gone rather than served from its memory; a client asking for
/// an id the log names from another endpoint is not given it.
#[test]
fn only_the_logged_owner_takes_an_awaiting_segment_back() {
    let (mut w, n, s, _) = promoted_with_object("a");
    // Someone asking for the owner's id from elsewhere gets a new one.
    let (elsewhere, resumed) = w.core.hello(w.now, n, "n9:1").unwrap();
    assert!(!resumed && elsewhere != n);
    // The restarted process asks for no id.
    let restarted = w.client("n1:1");
    assert_ne!(restarted, n);
    let fresh = w.core.mount(w.now, restarted, 0, MIB, RKEY + 7).unwrap();
    assert_ne!(fresh, s, "not the old segment");
    w.core.check();
    assert_eq!(w.core.stats().segments, 1, "the awaiting one went");
    assert_eq!(w.get(&["a"], false).items, [Err(Code::NotFound)]);
    let log = w.core.take_log();
    assert!(log.contains(&Record::Unmount { segment: s }), "{log:?}");
    assert!(
        log.iter().all(|r| !matches!(r, Record::Remount { .. })),
        "{log:?}"
    );
    // The owner, coming back late, has no claim left: a new id, and its old bounds are
    // the restarted process's now.
    let late = w.core.hello(w.now, n, "n1:1").unwrap().0;
    assert_ne!(late, n);
    assert_eq!(
        w.core.mount(w.now, late, 0, MIB, RKEY + 8),
        Err(Code::InvalidParams),
        "overlaps the restarted process's segment"
    );
}

/// A client that asked for a fresh id on the same endpoint (say, it forgot its id) and
/// mounts other bounds does not touch the awaiting segment; its owner takes it back with
/// its object.
#[test]
fn the_owner_takes_its_segment_back_beside_another_client() {
    let (mut w, n, s, before) = promoted_with_object("a");
    let other = w.client("n1:1");
    let o = w.core.mount(w.now, other, 2 * MIB, MIB, RKEY + 3).unwrap();
    assert_ne!(o, s);
    assert_eq!(w.get(&["a"], false).items, [Err(Code::NotReady)]);
    assert_eq!(w.core.hello(w.now, n, "n1:1"), Ok((n, false)));
    assert_eq!(w.core.mount(w.now, n, 0, MIB, RKEY + 4), Ok(s));
    let f = w.get(&["a"], false);
    let a = f.items[0].clone().unwrap();
    assert_eq!(a.replicas, [before]);
    assert_eq!(f.segments[0].rkey, RKEY + 4);
    // Resumed as usual from now on.
    assert_eq!(w.core.hello(w.now, n, "n1:1"), Ok((n, true)));
    w.core.check();
}

/// A snapshot names each segment's owner, and a standby rebuilt from it lets that owner
/// (and only it) take the segment back.
#[test]
fn a_snapshot_keeps_the_segment_owner() {
    let mut w = World::new(cfg());
    let (n, s) = w.node("n1:1", 0, MIB);
    let snap = w.core.snapshot();
    assert!(snap.contains(&Record::Mount {
        segment: s,
        endpoint: "n1:1".into(),
        base: 0,
        size: MIB,
        rkey: RKEY,
        owner: n,
    }));
    let mut standby = MasterCore::new(cfg(), 21);
    assert_eq!(
        standby.apply(
            0,
            &crate::oplog::decode(&crate::oplog::encode(&snap)).unwrap()
        ),
        0
    );
    assert_eq!(metadata(&standby), metadata(&w.core));
    standby.promote(w.now);
    let intruder = standby.hello(w.now, 0, "n1:1").unwrap().0;
    assert_ne!(intruder, n);
    assert_eq!(standby.hello(w.now, n, "n1:1"), Ok((n, false)));
    assert_eq!(standby.mount(w.now, n, 0, MIB, RKEY + 1), Ok(s));
}

#[test]
fn hello_resumes_only_the_same_endpoint_and_bye_unmounts() {
    let mut w = World::new(cfg());
    let (n, _) = w.node("n1:1", 0, MIB);
    assert_eq!(w.core.hello(w.now, n, "n1:1"), Ok((n, true)));
    let (other, resumed) = w.core.hello(w.now, n, "elsewhere:1").unwrap();
    assert!(!resumed && other != n);
    assert_eq!(w.core.stats().segments, 1);
    w.core.bye(w.now, n);
    assert_eq!(w.core.stats().segments, 0);
    assert_eq!(w.core.stats().capacity, 0);
}

#[test]
fn config_validation_names_the_knob() {
    assert!(CoreConfig::default().validate().is_ok());
    let bad = CoreConfig {
        high_watermark: 1.5,
        ..CoreConfig::default()
    };
    assert!(bad.validate().unwrap_err().contains("high_watermark"));
    let bad = CoreConfig {
        heartbeat_ms: 6_000,
        ..CoreConfig::default()
    };
    assert!(bad.validate().unwrap_err().contains("heartbeat_ms"));
}

// ---------------------------------------------------------------- property test

#[derive(Debug, Clone)]
enum Op {
    Start {
        client: usize,
        key: u8,
        size: u64,
        replicas: u8,
    },
    Finish {
        client: usize,
        key: u8,
        ok: bool,
    },
    Get {
        key: u8,
        lease: bool,
    },
    Remove {
        key: u8,
        force: bool,
    },
    Advance(u64),
    Silence(usize),
    /// `(client, node)`: the client reports the node's segment.
    Report(usize, usize),
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    let op = prop_oneof![
        4 => (0usize..3, 0u8..24, 1u64..300_000, 1u8..4)
            .prop_map(|(client, key, size, replicas)| Op::Start { client, key, size, replicas }),
        4 => (0usize..3, 0u8..24, any::<bool>()).prop_map(|(client, key, ok)| Op::Finish { client, key, ok }),
        2 => (0u8..24, any::<bool>()).prop_map(|(key, lease)| Op::Get { key, lease }),
        1 => (0u8..24, any::<bool>()).prop_map(|(key, force)| Op::Remove { key, force }),
        2 => (1u64..1_500).prop_map(Op::Advance),
        1 => (0usize..5).prop_map(Op::Silence),
        1 => (0usize..3, 0usize..3).prop_map(|(c, n)| Op::Report(c, n)),
    ];
    proptest::collection::vec(op, 1..120)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Random traffic from three writers over three storage nodes (one of which may go
    /// silent). After every step the bookkeeping adds up, and:
    /// * an object is visible only after its writer finished it;
    /// * a visible object disappears only by removal, eviction or losing its segments, and
    ///   never while a lease it was given is running (unless removed with force);
    /// * a key's size never changes while it stays visible (first write wins).
    /// A standby applying the leader's op-log (drained after every step) holds the same
    /// segments and complete objects, with every record fitting its state.
    #[test]
    fn random_traffic_keeps_the_rules(ops in ops()) {
        let mut w = World::new(cfg());
        w.core.set_logging(true);
        let mut standby = MasterCore::new(cfg(), 9);
        let (nodes, segs): (Vec<u64>, Vec<u64>) = (0..3)
            .map(|i| w.node(&format!("n{i}:1"), 0, 1 << 20))
            .unzip();
        let clients: Vec<u64> = (0..3).map(|i| w.client(&format!("c{i}:1"))).collect();
        let mut silent: HashSet<usize> = HashSet::new();
        // Model: key -> (size, lease_until) of complete objects we saw finish.
        let mut visible: HashMap<u8, (u64, Millis)> = HashMap::new();
        let mut started: HashMap<u8, (usize, u64)> = HashMap::new();
        let mut lost_segments = false;
        let mut reports = [0u32; 3];
        for op in ops {
            match op {
                Op::Start { client, key, size, replicas } => {
                    let req = proto::PutStart {
                        replicas,
                        pin: Pin::None,
                        preferred: String::new(),
                        items: vec![(format!("k{key}").into_bytes(), size)],
                    };
                    let p = match w.core.put_start(w.now, clients[client], &req) {
                        Ok(p) => p,
                        Err(c) => {
                            prop_assert_eq!(c, Code::UnknownClient);
                            continue;
                        }
                    };
                    w.core.check();
                    match &p.items[0] {
                        Ok(reps) => {
                            prop_assert!(!visible.contains_key(&key) || lost_segments);
                            prop_assert!(!reps.is_empty() && reps.len() <= replicas as usize);
                            started.insert(key, (client, size));
                        }
                        Err(Code::AlreadyExists) => {
                            prop_assert!(visible.contains_key(&key) || started.contains_key(&key) || lost_segments || w.core.stats().reclaimed > 0);
                        }
                        Err(Code::NoSpace) => {}
                        // A client held back for reports nobody confirmed.
                        Err(Code::TransferFailed) if reports[client] >= STRIKES => {}
                        Err(c) => prop_assert!(false, "unexpected {c:?}"),
                    }
                }
                Op::Finish { client, key, ok } => {
                    let k = format!("k{key}").into_bytes();
                    let f = if ok {
                        PutFinish { done: vec![k], ..PutFinish::default() }
                    } else {
                        PutFinish { revoked: vec![k], ..PutFinish::default() }
                    };
                    let r = match w.core.put_finish(w.now, clients[client], &f) {
                        Ok(codes) => codes[0],
                        Err(c) => c,
                    };
                    w.core.check();
                    match started.get(&key) {
                        Some(&(c, size)) if c == client && r == Code::Ok => {
                            started.remove(&key);
                            if ok {
                                visible.insert(key, (size, 0));
                            }
                        }
                        _ => prop_assert!(r == Code::NotFound || r == Code::UnknownClient),
                    }
                }
                Op::Get { key, lease } => {
                    let k = format!("k{key}");
                    let f = w.get(&[&k], lease);
                    match (&f.items[0], visible.get_mut(&key)) {
                        (Ok(o), Some((size, until))) => {
                            prop_assert_eq!(o.size, *size);
                            if lease {
                                *until = w.now + w.core.config().lease_ttl_ms;
                            }
                        }
                        (Ok(_), None) => prop_assert!(false, "k{key} visible but never finished"),
                        (Err(_), Some(_)) => { visible.remove(&key); }
                        (Err(_), None) => {}
                    }
                }
                Op::Remove { key, force } => {
                    let k = format!("k{key}");
                    let r = w.remove(&k, force);
                    if r == Code::Ok {
                        let (_, until) = visible.remove(&key).unwrap_or((0, 0));
                        prop_assert!(force || until <= w.now, "removed under a lease");
                    }
                    if r == Code::HasLease {
                        prop_assert!(!force);
                    }
                }
                Op::Advance(ms) => {
                    for (i, &c) in nodes.iter().enumerate() {
                        if !silent.contains(&i) {
                            let _ = w.core.touch(w.now, c);
                        }
                    }
                    for (i, &c) in clients.iter().enumerate() {
                        if !silent.contains(&(i + 3)) {
                            let _ = w.core.touch(w.now, c);
                        }
                    }
                    let r = w.advance(ms);
                    if r.clients_expired > 0 {
                        lost_segments = true;
                    }
                }
                Op::Silence(i) => { silent.insert(i); }
                Op::Report(c, n) => {
                    reports[c] += 1;
                    let _ = w.core.report(w.now, clients[c], &[segs[n]]);
                }
            }
            let recs = w.core.take_log();
            prop_assert_eq!(standby.apply(w.now, &recs), 0, "records that do not fit: {:?}", recs);
            standby.check();
            prop_assert_eq!(metadata(&standby), metadata(&w.core));
            // Every object the model holds under a running lease is still there.
            for (key, (_, until)) in &visible {
                if *until > w.now && !lost_segments {
                    prop_assert!(w.exists(&format!("k{key}")), "leased k{key} vanished");
                }
            }
            // Evicted (or lost) objects leave the model.
            visible.retain(|key, _| w.exists(&format!("k{key}")));
            // Nothing is visible that the model does not know.
            for key in 0..24u8 {
                if w.exists(&format!("k{key}")) {
                    prop_assert!(visible.contains_key(&key), "k{key} visible unexpectedly");
                }
            }
        }
    }
}
