//! The printed report: perftest's header block and column layout, or one JSON record
//! per row with `--json`.
//!
//! Row formats reproduce perftest's printf strings (`REPORT_FMT`, `REPORT_FMT_EXT`,
//! `REPORT_FMT_LAT`), tabs included, so tables can be diffed and parsed by the same
//! scripts as perftest's.
use std::fmt::Write as _;
use std::io::{self, Write};

use super::stats::{BwResult, LatResult, MIB};

/// perftest's `RESULT_LINE`: 87 dashes.
pub const RESULT_LINE: &str =
    "---------------------------------------------------------------------------------------";
pub const BW_COLUMNS_MIB: &str =
    " #bytes     #iterations    BW peak[MiB/sec]    BW average[MiB/sec]   MsgRate[Mpps]";
pub const BW_COLUMNS_GBIT: &str =
    " #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]";
pub const LAT_COLUMNS: &str = " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] ";
pub const NO_PEAK_WARNING: &str = " WARNING: BW peak won't be measured in this run.";

/// One end of the connection as the header prints it.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct EndpointDesc {
    /// verbs: one entry per QP (qpn, psn).
    pub qps: Vec<(u32, u32)>,
    pub lid: Option<u16>,
    pub gid: Option<[u8; 16]>,
    pub rkey: Option<u32>,
    pub vaddr: Option<u64>,
    /// TCP: the socket address of the data connection(s).
    pub socket: Option<String>,
}

/// The header block: what ran, where, and with which parameters.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Header {
    pub title: String,
    pub device: String,
    /// Verbs: every rail (device) the engine stripes over; listed when there are two or more.
    pub rails: Vec<String>,
    /// `verbs`, `tcp` or `loopback`.
    pub transport: String,
    /// perftest's "Link type": Ethernet / IB for verbs, TCP, or In-process.
    pub link_type: String,
    /// `RC` for verbs.
    pub connection: String,
    pub qps: u32,
    pub tx_depth: u32,
    pub cq_mod: u32,
    pub mtu: Option<u32>,
    pub gid_index: Option<u32>,
    /// Verbs: `auto` (completion thread) or `manual` (the bench's waits reap).
    pub progress: Option<String>,
    /// READ tests print outstanding reads instead of max inline data.
    pub outstanding_reads: Option<u32>,
    /// Bytes each end registered for the run (pagewire's own line).
    pub buffer_bytes: Option<u64>,
    pub data_exchange: String,
    pub local: EndpointDesc,
    pub remote: EndpointDesc,
}

fn gid_line(gid: &[u8; 16]) -> String {
    // perftest prints each byte with %02d: decimal, so ::ffff:10.0.0.1 reads ...:255:255:10:00:00:01.
    let parts: Vec<String> = gid.iter().map(|b| format!("{b:02}")).collect();
    format!(" GID: {}", parts.join(":"))
}

/// C's `%#0Nx`: the width counts the `0x` prefix, and zero gets no prefix at all.
fn c_hex(v: u64, width: usize) -> String {
    if v == 0 {
        format!("{:0width$}", 0)
    } else {
        format!("{v:#0width$x}")
    }
}

fn endpoint_lines(out: &mut String, side: &str, e: &EndpointDesc) {
    if let Some(sock) = &e.socket {
        let _ = writeln!(out, " {side} address: {sock}");
    }
    for &(qpn, psn) in &e.qps {
        let _ = write!(
            out,
            " {side} address: LID {} QPN {} PSN {}",
            c_hex(e.lid.unwrap_or(0).into(), 4),
            c_hex(qpn.into(), 6),
            c_hex(psn.into(), 6)
        );
        if let Some(rkey) = e.rkey {
            let _ = write!(out, " RKey {}", c_hex(rkey.into(), 8));
        }
        if let Some(va) = e.vaddr {
            let _ = write!(out, " VAddr {}", c_hex(va, 16));
        }
        out.push('\n');
        if let Some(gid) = &e.gid {
            let _ = writeln!(out, "{}", gid_line(gid));
        }
    }
}

impl Header {
    /// perftest's block for verbs; for TCP and loopback only the fields that mean
    /// something there (no SRQ, inline data, CQ moderation, MTU or GID).
    pub fn render(&self) -> String {
        if self.transport == "verbs" {
            self.render_verbs()
        } else {
            self.render_stream()
        }
    }

    fn render_stream(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "{RESULT_LINE}");
        let _ = writeln!(s, "                    {}", self.title);
        let _ = writeln!(s, " Transport type  : {}", self.transport);
        let lanes = if self.transport == "tcp" {
            "Streams"
        } else {
            "Lanes"
        };
        let _ = writeln!(s, " {lanes:<16}: {}", self.qps);
        let _ = writeln!(s, " TX depth        : {}", self.tx_depth);
        let _ = writeln!(s, " Ops per batch   : {}", self.cq_mod);
        if let Some(b) = self.buffer_bytes {
            let _ = writeln!(s, " Buffer          : {b}[B] per end");
        }
        let _ = writeln!(s, " Data ex. method : {}", self.data_exchange);
        let _ = writeln!(s, "{RESULT_LINE}");
        endpoint_lines(&mut s, "local", &self.local);
        endpoint_lines(&mut s, "remote", &self.remote);
        let _ = writeln!(s, "{RESULT_LINE}");
        s
    }

    fn render_verbs(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "{RESULT_LINE}");
        let _ = writeln!(s, "                    {}", self.title);
        let _ = writeln!(
            s,
            " Dual-port       : OFF\t\tDevice         : {}",
            self.device
        );
        if self.rails.len() > 1 {
            let _ = writeln!(s, " Rails           : {}", self.rails.join(", "));
        }
        let _ = writeln!(
            s,
            " Number of qps   : {}\t\tTransport type : {}",
            self.qps, self.transport
        );
        let _ = writeln!(
            s,
            " Connection type : {}\t\tUsing SRQ      : OFF",
            self.connection
        );
        let _ = writeln!(s, " TX depth        : {}", self.tx_depth);
        let _ = writeln!(s, " CQ Moderation   : {}", self.cq_mod);
        if let Some(mtu) = self.mtu {
            let _ = writeln!(s, " Mtu             : {mtu}[B]");
        }
        let _ = writeln!(s, " Link type       : {}", self.link_type);
        if let Some(g) = self.gid_index {
            let _ = writeln!(s, " GID index       : {g}");
        }
        match self.outstanding_reads {
            Some(o) => {
                let _ = writeln!(s, " Outstand reads  : {o}");
            }
            None => {
                let _ = writeln!(s, " Max inline data : 0[B]");
            }
        }
        let _ = writeln!(s, " Data ex. method : {}", self.data_exchange);
        // pagewire's own line, after perftest's, so their order stays as perftest prints it.
        if let Some(p) = &self.progress {
            let _ = writeln!(s, " Progress        : {p}");
        }
        if let Some(b) = self.buffer_bytes {
            let _ = writeln!(s, " Buffer          : {b}[B] per end");
        }
        let _ = writeln!(s, "{RESULT_LINE}");
        endpoint_lines(&mut s, "local", &self.local);
        endpoint_lines(&mut s, "remote", &self.remote);
        let _ = writeln!(s, "{RESULT_LINE}");
        s
    }
}

/// MiB/s (2^20) or Gb/s (10^9 bit/s) as perftest prints them.
pub fn bps_in_unit(bps: f64, gbits: bool) -> f64 {
    if gbits { bps * 8.0 / 1e9 } else { bps / MIB }
}

/// perftest's `REPORT_FMT` (or `REPORT_FMT_EXT` when a Gb/s average is below 0.1).
pub fn bw_row(r: &BwResult, gbits: bool) -> String {
    let peak = bps_in_unit(r.peak_bps.unwrap_or(0.0), gbits);
    let avg = bps_in_unit(r.avg_bps, gbits);
    if gbits && avg < 0.1 {
        format!(
            " {:<7}    {}           {:<7.6}            {:<7.6}            {:<7.6}",
            r.bytes, r.iterations, peak, avg, r.msg_rate_mpps
        )
    } else {
        format!(
            " {:<7}    {:<10}       {:<7.2}            {:<7.2}\t\t   {:<7.6}",
            r.bytes, r.iterations, peak, avg, r.msg_rate_mpps
        )
    }
}

/// perftest's `REPORT_FMT_LAT`.
pub fn lat_row(r: &LatResult) -> String {
    format!(
        " {:<7} {}          {:<7.2}        {:<7.2}      {:<7.2}  \t       {:<7.2}     \t{:<7.2}\t\t{:<7.2} \t\t{:<7.2}",
        r.bytes,
        r.iterations,
        r.t_min_us,
        r.t_max_us,
        r.t_typical_us,
        r.t_avg_us,
        r.t_stdev_us,
        r.p99_us,
        r.p999_us
    )
}

/// Context every JSON record carries.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RunInfo {
    pub test: &'static str,
    pub transport: String,
    pub device: String,
    pub qps: u32,
    pub tx_depth: u32,
    pub bidirectional: bool,
}

/// One bandwidth record. `verified`: the receiving side's verdict with `--verify`, else
/// null.
pub fn bw_json(info: &RunInfo, r: &BwResult, verified: Option<bool>) -> String {
    serde_json::json!({
        "kind": "bw",
        "test": info.test,
        "transport": info.transport,
        "device": info.device,
        "qps": info.qps,
        "tx_depth": info.tx_depth,
        "bidirectional": info.bidirectional,
        "bytes": r.bytes,
        "iterations": r.iterations,
        "bw_peak_mib_s": r.peak_bps.map(|b| round6(b / MIB)),
        "bw_avg_mib_s": round6(r.avg_bps / MIB),
        "bw_peak_gbit_s": r.peak_bps.map(|b| round6(b * 8.0 / 1e9)),
        "bw_avg_gbit_s": round6(r.avg_bps * 8.0 / 1e9),
        "msg_rate_mpps": round6(r.msg_rate_mpps),
        "verified": verified,
    })
    .to_string()
}

/// One latency record; `verified` as in [`bw_json`].
pub fn lat_json(info: &RunInfo, r: &LatResult, verified: Option<bool>) -> String {
    serde_json::json!({
        "kind": "lat",
        "test": info.test,
        "transport": info.transport,
        "device": info.device,
        "bytes": r.bytes,
        "iterations": r.iterations,
        "t_min_us": round6(r.t_min_us),
        "t_max_us": round6(r.t_max_us),
        "t_typical_us": round6(r.t_typical_us),
        "t_avg_us": round6(r.t_avg_us),
        "t_stdev_us": round6(r.t_stdev_us),
        "p99_us": round6(r.p99_us),
        "p999_us": round6(r.p999_us),
        "verified": verified,
    })
    .to_string()
}

fn round6(x: f64) -> f64 {
    (x * 1e6).round() / 1e6
}

/// Streams a report: header once, column line, rows, closing line.
#[derive(Debug)]
pub struct Printer<W: Write> {
    out: W,
    json: bool,
    gbits: bool,
    info: RunInfo,
    started: bool,
}

impl<W: Write> Printer<W> {
    pub fn new(out: W, json: bool, gbits: bool, info: RunInfo) -> Self {
        Printer {
            out,
            json,
            gbits,
            info,
            started: false,
        }
    }

    /// Header block and column titles; `peak_warning` prints perftest's no-peak line.
    pub fn begin(&mut self, header: &Header, lat: bool, peak_warning: bool) -> io::Result<()> {
        self.started = true;
        if self.json {
            return Ok(());
        }
        self.out.write_all(header.render().as_bytes())?;
        if peak_warning && !lat {
            writeln!(self.out, "{NO_PEAK_WARNING}")?;
        }
        let cols = if lat {
            LAT_COLUMNS
        } else if self.gbits {
            BW_COLUMNS_GBIT
        } else {
            BW_COLUMNS_MIB
        };
        writeln!(self.out, "{cols}")?;
        self.out.flush()
    }

    pub fn bw(&mut self, r: &BwResult, verified: Option<bool>) -> io::Result<()> {
        let line = if self.json {
            bw_json(&self.info, r, verified)
        } else {
            bw_row(r, self.gbits)
        };
        writeln!(self.out, "{line}")?;
        self.out.flush()
    }

    pub fn lat(&mut self, r: &LatResult, verified: Option<bool>) -> io::Result<()> {
        let line = if self.json {
            lat_json(&self.info, r, verified)
        } else {
            lat_row(r)
        };
        writeln!(self.out, "{line}")?;
        self.out.flush()
    }

    /// What each rail of a multi-rail engine carried: a line per rail, or one JSON record.
    pub fn rails(&mut self, rails: &[pagewire_transport::RailStats]) -> io::Result<()> {
        if self.json {
            let v: Vec<_> = rails
                .iter()
                .map(|r| {
                    serde_json::json!({
                        "device": r.device, "port": r.port, "gbps": r.gbps,
                        "bytes": r.bytes, "errors": r.errors, "retries": r.retries,
                    })
                })
                .collect();
            let rec = serde_json::json!({"kind": "rails", "test": self.info.test, "rails": v});
            return writeln!(self.out, "{rec}");
        }
        for r in rails {
            writeln!(
                self.out,
                " rail {}:{}\tbytes {}\terrors {}\tretries {}",
                r.device, r.port, r.bytes, r.errors, r.retries
            )?;
        }
        Ok(())
    }

    pub fn end(&mut self) -> io::Result<()> {
        if !self.json && self.started {
            writeln!(self.out, "{RESULT_LINE}")?;
        }
        self.out.flush()
    }

    #[cfg(test)]
    pub fn into_inner(self) -> W {
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> Header {
        Header {
            title: "RDMA_Write BW Test".into(),
            device: "rxe0".into(),
            rails: vec![],
            transport: "verbs".into(),
            link_type: "Ethernet".into(),
            connection: "RC".into(),
            qps: 1,
            tx_depth: 128,
            cq_mod: 64,
            mtu: Some(4096),
            gid_index: Some(1),
            progress: Some("manual".into()),
            outstanding_reads: None,
            buffer_bytes: Some(131072),
            data_exchange: "Ethernet".into(),
            local: EndpointDesc {
                qps: vec![(0x32, 0x5f2841)],
                lid: Some(0),
                gid: Some([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 255, 255, 10, 0, 2, 15]),
                rkey: Some(0x2440),
                vaddr: Some(0x7f2e_5f64_b000),
                socket: None,
            },
            remote: EndpointDesc {
                qps: vec![(0x3a, 0x12)],
                lid: Some(0),
                gid: Some([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 255, 255, 10, 0, 2, 15]),
                rkey: Some(0x2442),
                vaddr: Some(0x7f44_3b2f_8000),
                socket: None,
            },
        }
    }

    fn info() -> RunInfo {
        RunInfo {
            test: "write",
            transport: "verbs".into(),
            device: "rxe0".into(),
            qps: 1,
            tx_depth: 128,
            bidirectional: false,
        }
    }

    /// A fixed input rendered exactly: header block, columns, two rows, closing line.
    #[test]
    fn golden_bw_report() {
        let mut p = Printer::new(Vec::new(), false, false, info());
        p.begin(&header(), false, false).unwrap();
        // 1000 MiB/s peak, 900 MiB/s average.
        p.bw(
            &BwResult {
                bytes: 65536,
                iterations: 5000,
                peak_bps: Some(1000.0 * MIB),
                avg_bps: 900.0 * MIB,
                msg_rate_mpps: 0.0144,
            },
            None,
        )
        .unwrap();
        p.bw(
            &BwResult {
                bytes: 2,
                iterations: 5000,
                peak_bps: Some(0.04 * MIB),
                avg_bps: 0.03 * MIB,
                msg_rate_mpps: 0.014897,
            },
            None,
        )
        .unwrap();
        p.end().unwrap();
        let got = String::from_utf8(p.into_inner()).unwrap();
        let want = "\
---------------------------------------------------------------------------------------
                    RDMA_Write BW Test
 Dual-port       : OFF\t\tDevice         : rxe0
 Number of qps   : 1\t\tTransport type : verbs
 Connection type : RC\t\tUsing SRQ      : OFF
 TX depth        : 128
 CQ Moderation   : 64
 Mtu             : 4096[B]
 Link type       : Ethernet
 GID index       : 1
 Max inline data : 0[B]
 Data ex. method : Ethernet
 Progress        : manual
 Buffer          : 131072[B] per end
---------------------------------------------------------------------------------------
 local address: LID 0000 QPN 0x0032 PSN 0x5f2841 RKey 0x002440 VAddr 0x007f2e5f64b000
 GID: 00:00:00:00:00:00:00:00:00:00:255:255:10:00:02:15
 remote address: LID 0000 QPN 0x003a PSN 0x0012 RKey 0x002442 VAddr 0x007f443b2f8000
 GID: 00:00:00:00:00:00:00:00:00:00:255:255:10:00:02:15
---------------------------------------------------------------------------------------
 #bytes     #iterations    BW peak[MiB/sec]    BW average[MiB/sec]   MsgRate[Mpps]
 65536      5000             1000.00            900.00 \t\t   0.014400
 2          5000             0.04               0.03   \t\t   0.014897
---------------------------------------------------------------------------------------
";
        assert_eq!(got, want, "\n--- got ---\n{got}");
    }

    /// READ tests print the outstanding reads where WRITE tests print the inline size,
    /// as perftest's `ib_read_bw` does.
    #[test]
    fn read_header_shows_outstanding_reads() {
        let h = Header {
            title: "RDMA_Read BW Test".into(),
            outstanding_reads: Some(16),
            ..header()
        };
        let text = h.render();
        assert!(text.contains("\n Outstand reads  : 16\n"), "{text}");
        assert!(!text.contains("Max inline data"), "{text}");
        let lines: Vec<&str> = text.lines().collect();
        let gid = lines
            .iter()
            .position(|l| l.starts_with(" GID index"))
            .unwrap();
        assert_eq!(lines[gid + 1], " Outstand reads  : 16");
    }

    #[test]
    fn golden_lat_row_and_columns() {
        let r = LatResult {
            bytes: 2,
            iterations: 1000,
            t_min_us: 9.5,
            t_max_us: 31.25,
            t_typical_us: 10.7,
            t_avg_us: 11.4,
            t_stdev_us: 2.0,
            p99_us: 29.0,
            p999_us: 31.0,
        };
        assert_eq!(
            lat_row(&r),
            " 2       1000          9.50           31.25        10.70    \t       11.40       \t2.00   \t\t29.00   \t\t31.00  "
        );
        assert!(LAT_COLUMNS.starts_with(" #bytes #iterations    t_min[usec]"));
    }

    #[test]
    fn gbits_rows_and_small_values_use_the_extended_format() {
        let r = BwResult {
            bytes: 65536,
            iterations: 5000,
            peak_bps: Some(50e9 / 8.0),
            avg_bps: 47.5e9 / 8.0,
            msg_rate_mpps: 0.09,
        };
        assert_eq!(
            bw_row(&r, true),
            " 65536      5000             50.00              47.50  \t\t   0.090000"
        );
        let slow = BwResult {
            bytes: 2,
            iterations: 50,
            peak_bps: None,
            avg_bps: 1e6 / 8.0,
            msg_rate_mpps: 0.0625,
        };
        assert_eq!(
            bw_row(&slow, true),
            " 2          50           0.000000            0.001000            0.062500"
        );
    }

    #[test]
    fn gid_is_printed_in_decimal_like_perftest() {
        let g = [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
        assert_eq!(
            gid_line(&g),
            " GID: 254:128:00:00:00:00:00:00:00:00:00:00:00:00:00:01"
        );
    }

    #[test]
    fn json_is_one_record_per_row() {
        let mut p = Printer::new(Vec::new(), true, false, info());
        p.begin(&header(), false, true).unwrap();
        p.bw(
            &BwResult {
                bytes: 4096,
                iterations: 10,
                peak_bps: None,
                avg_bps: MIB,
                msg_rate_mpps: 0.25,
            },
            Some(true),
        )
        .unwrap();
        p.end().unwrap();
        let out = String::from_utf8(p.into_inner()).unwrap();
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 1);
        let v: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
        assert_eq!(v["bytes"], 4096);
        assert_eq!(v["bw_avg_mib_s"], 1.0);
        assert!(v["bw_peak_mib_s"].is_null());
        assert_eq!(v["transport"], "verbs");
        assert_eq!(v["verified"], true);
    }

    /// The TCP header: only what means something on TCP (no SRQ, inline data, CQ
    /// moderation, MTU or GID), rendered exactly.
    #[test]
    fn golden_tcp_header() {
        let h = Header {
            device: "tcp 0.0.0.0:40000".into(),
            transport: "tcp".into(),
            link_type: "TCP".into(),
            connection: "TCP".into(),
            mtu: None,
            gid_index: None,
            progress: None,
            buffer_bytes: Some(131072),
            data_exchange: "Ethernet (server)".into(),
            local: EndpointDesc {
                socket: Some("0.0.0.0:40000 data port 40001, 1 stream(s)".into()),
                ..EndpointDesc::default()
            },
            remote: EndpointDesc {
                socket: Some("10.0.0.2:40100 data port 40101, 1 stream(s)".into()),
                ..EndpointDesc::default()
            },
            ..header()
        };
        let want = "\
---------------------------------------------------------------------------------------
                    RDMA_Write BW Test
 Transport type  : tcp
 Streams         : 1
 TX depth        : 128
 Ops per batch   : 64
 Buffer          : 131072[B] per end
 Data ex. method : Ethernet (server)
---------------------------------------------------------------------------------------
 local address: 0.0.0.0:40000 data port 40001, 1 stream(s)
 remote address: 10.0.0.2:40100 data port 40101, 1 stream(s)
---------------------------------------------------------------------------------------
";
        let got = h.render();
        assert_eq!(got, want, "\n--- got ---\n{got}");
    }

    /// The JSON records, key for key and value for value (serde_json orders keys).
    #[test]
    fn golden_json_records() {
        let info = RunInfo {
            transport: "tcp".into(),
            device: "tcp 0.0.0.0:40000".into(),
            ..info()
        };
        let bw = BwResult {
            bytes: 65536,
            iterations: 5000,
            peak_bps: Some(1000.0 * MIB),
            avg_bps: 900.0 * MIB,
            msg_rate_mpps: 0.0144,
        };
        assert_eq!(
            bw_json(&info, &bw, Some(true)),
            r#"{"bidirectional":false,"bw_avg_gbit_s":7.549747,"bw_avg_mib_s":900.0,"bw_peak_gbit_s":8.388608,"bw_peak_mib_s":1000.0,"bytes":65536,"device":"tcp 0.0.0.0:40000","iterations":5000,"kind":"bw","msg_rate_mpps":0.0144,"qps":1,"test":"write","transport":"tcp","tx_depth":128,"verified":true}"#
        );
        let lat = LatResult {
            bytes: 2,
            iterations: 1000,
            t_min_us: 9.5,
            t_max_us: 31.25,
            t_typical_us: 10.7,
            t_avg_us: 11.4,
            t_stdev_us: 2.0,
            p99_us: 29.0,
            p999_us: 31.0,
        };
        let info = RunInfo {
            test: "lat",
            ..info
        };
        assert_eq!(
            lat_json(&info, &lat, None),
            r#"{"bytes":2,"device":"tcp 0.0.0.0:40000","iterations":1000,"kind":"lat","p999_us":31.0,"p99_us":29.0,"t_avg_us":11.4,"t_max_us":31.25,"t_min_us":9.5,"t_stdev_us":2.0,"t_typical_us":10.7,"test":"lat","transport":"tcp","verified":null}"#
        );
        assert!(lat_json(&info, &lat, Some(false)).contains(r#""verified":false"#));
    }
}
