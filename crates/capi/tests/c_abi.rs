//! The C ABI from C: programs compiled with the system C compiler (`cc`, or `$CC`)
//! against the two headers and linked with `-ltransfer_engine`, run as separate processes.
//!
//! * `header_layouts_match_rust`: `sizeof`/`offsetof` of every struct and field of both
//!   headers, printed by a C program, equal the Rust `#[repr(C)]` types'.
//! * `mooncake_two_processes_tcp`: `tests/c/te_two_process.c` over TCP on 127.0.0.1.
//! * `mooncake_two_processes_verbs`: the same program over verbs on `RDMA_DEVICE` (the
//!   soft-RoCE VM); SKIP without a device, a failure with `RDMA_REQUIRED=1`.
//! * `mooncake_two_processes_etcd`: `tests/c/te_etcd.c`, segments by name through etcd.
//! * `native_api`: `tests/c/pw_native.c`, pagewire.h end to end in one process.
//! * `docs_example`: the C example of `docs/c-api.md`, extracted, compiled and run.
//!
//! Compiled programs are cached in `target/capi-ctest/` and rebuilt when the source,
//! a header or the library is newer, so the soft-RoCE guest (which sees the host's files)
//! reuses what the host suite built instead of compiling under emulation.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, bail, ensure};

/// `target/<profile>/`: the test binary is `target/<profile>/deps/c_abi-<hash>`.
fn profile_dir() -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let deps = exe.parent().context("exe dir")?;
    Ok(deps.parent().context("profile dir")?.to_path_buf())
}

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The cdylib built with this test: `cargo test` leaves it in `deps/` (only `cargo build`
/// copies it up to `target/<profile>/`, and that copy may be stale).
fn library() -> Result<PathBuf> {
    let lib = profile_dir()?.join("deps/libtransfer_engine.so");
    ensure!(
        lib.exists(),
        "{} not built (cargo builds the cdylib with the package's tests)",
        lib.display()
    );
    Ok(lib)
}

fn mtime(p: &Path) -> SystemTime {
    std::fs::metadata(p)
        .and_then(|m| m.modified())
        .unwrap_or(SystemTime::UNIX_EPOCH)
}

/// Compiles `source` into `target/capi-ctest/<name>` unless an up-to-date build exists.
fn compile(source: &Path, name: &str) -> Result<PathBuf> {
    compile_with(source, name, None)
}

/// [`compile`], searching `include_first` for headers before the crate's `include/`.
fn compile_with(source: &Path, name: &str, include_first: Option<&Path>) -> Result<PathBuf> {
    let lib = library()?;
    let libdir = lib.parent().context("lib dir")?;
    let include = crate_dir().join("include");
    let out_dir = profile_dir()?.join("../capi-ctest");
    std::fs::create_dir_all(&out_dir)?;
    let out = out_dir.join(name);
    let mut inputs = vec![
        source.to_path_buf(),
        lib.clone(),
        include.join("transfer_engine_c.h"),
        include.join("pagewire.h"),
    ];
    if let Some(dir) = include_first {
        inputs.push(dir.join("transfer_engine_c.h"));
    }
    let newest = inputs.iter().map(|p| mtime(p)).max().expect("inputs");
    if out.exists() && mtime(&out) > newest {
        return Ok(out);
    }
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    // Tests compile in parallel threads of one process: a unique temporary per call.
    static SEQ: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = out_dir.join(format!("{name}.tmp{}.{seq}", std::process::id()));
    let mut cmd = Command::new(&cc);
    cmd.args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1", "-g"]);
    if let Some(dir) = include_first {
        cmd.arg("-I").arg(dir);
    }
    let status = cmd
        .arg("-I")
        .arg(&include)
        .arg(source)
        .arg("-L")
        .arg(libdir)
        .arg("-ltransfer_engine")
        .arg(format!("-Wl,-rpath,{}", libdir.display()))
        .arg("-o")
        .arg(&tmp)
        .status()
        .with_context(|| format!("running {cc}"))?;
    ensure!(status.success(), "{cc} failed on {}", source.display());
    std::fs::rename(&tmp, &out)?;
    Ok(out)
}

/// Runs a program with `env`, killing it after `limit`; returns its stdout (stderr goes
/// to the test's output).
fn run(prog: &Path, env: &[(&str, String)], limit: Duration) -> Result<String> {
    let mut cmd = Command::new(prog);
    cmd.stdout(Stdio::piped()).stderr(Stdio::inherit());
    // `cargo test` puts `target/<profile>` on LD_LIBRARY_PATH, which the loader searches
    // before the program's rpath: a stale `libtransfer_engine.so` left there by an older
    // `cargo build` would be the one tested. The library built with this test goes first.
    let libdir = library()?.parent().context("lib dir")?.to_path_buf();
    let mut path = libdir.into_os_string();
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
        path.push(":");
        path.push(old);
    }
    cmd.env("LD_LIBRARY_PATH", path);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd
        .spawn()
        .with_context(|| format!("spawn {}", prog.display()))?;
    let t0 = Instant::now();
    loop {
        if let Some(status) = child.try_wait()? {
            let mut out = String::new();
            if let Some(mut o) = child.stdout.take() {
                use std::io::Read;
                o.read_to_string(&mut out)?;
            }
            ensure!(
                status.success(),
                "{} exited with {status}; stdout:\n{out}",
                prog.display()
            );
            return Ok(out);
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            bail!("{} still running after {limit:?}: killed", prog.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

// ------------------------------------------------------------------------- layouts

/// `(C expression, Rust value)` rows for transfer_engine_c.h.
fn mooncake_rows() -> Vec<(String, usize)> {
    use std::mem::{offset_of, size_of};
    use transfer_engine::mooncake::*;
    let rows: Vec<(&str, usize)> = vec![
        (
            "sizeof(struct transfer_request)",
            size_of::<transfer_request>(),
        ),
        (
            "offsetof(struct transfer_request, opcode)",
            offset_of!(transfer_request, opcode),
        ),
        (
            "offsetof(struct transfer_request, source)",
            offset_of!(transfer_request, source),
        ),
        (
            "offsetof(struct transfer_request, target_id)",
            offset_of!(transfer_request, target_id),
        ),
        (
            "offsetof(struct transfer_request, target_offset)",
            offset_of!(transfer_request, target_offset),
        ),
        (
            "offsetof(struct transfer_request, length)",
            offset_of!(transfer_request, length),
        ),
        (
            "sizeof(transfer_request_t)",
            size_of::<transfer_request_t>(),
        ),
        ("sizeof(struct notify_msg)", size_of::<notify_msg>()),
        (
            "offsetof(struct notify_msg, name)",
            offset_of!(notify_msg, name),
        ),
        (
            "offsetof(struct notify_msg, msg)",
            offset_of!(notify_msg, msg),
        ),
        (
            "sizeof(struct transfer_status)",
            size_of::<transfer_status>(),
        ),
        (
            "offsetof(struct transfer_status, status)",
            offset_of!(transfer_status, status),
        ),
        (
            "offsetof(struct transfer_status, transferred_bytes)",
            offset_of!(transfer_status, transferred_bytes),
        ),
        ("sizeof(struct segment_desc)", size_of::<segment_desc>()),
        (
            "offsetof(struct segment_desc, type)",
            offset_of!(segment_desc, type_),
        ),
        (
            "offsetof(struct segment_desc, desc_)",
            offset_of!(segment_desc, desc_),
        ),
        (
            "offsetof(struct segment_desc, desc_.rdma.addr)",
            offset_of!(segment_desc, desc_) + offset_of!(segment_desc_rdma, addr),
        ),
        (
            "offsetof(struct segment_desc, desc_.rdma.size)",
            offset_of!(segment_desc, desc_) + offset_of!(segment_desc_rdma, size),
        ),
        (
            "offsetof(struct segment_desc, desc_.rdma.location)",
            offset_of!(segment_desc, desc_) + offset_of!(segment_desc_rdma, location),
        ),
        (
            "offsetof(struct segment_desc, desc_.nvmeof.file_path)",
            offset_of!(segment_desc, desc_) + offset_of!(segment_desc_nvmeof, file_path),
        ),
        (
            "offsetof(struct segment_desc, desc_.nvmeof.subsystem_name)",
            offset_of!(segment_desc, desc_) + offset_of!(segment_desc_nvmeof, subsystem_name),
        ),
        (
            "offsetof(struct segment_desc, desc_.nvmeof.proto)",
            offset_of!(segment_desc, desc_) + offset_of!(segment_desc_nvmeof, proto),
        ),
        (
            "offsetof(struct segment_desc, desc_.nvmeof.ip)",
            offset_of!(segment_desc, desc_) + offset_of!(segment_desc_nvmeof, ip),
        ),
        (
            "offsetof(struct segment_desc, desc_.nvmeof.port)",
            offset_of!(segment_desc, desc_) + offset_of!(segment_desc_nvmeof, port),
        ),
        ("sizeof(segment_desc_t)", size_of::<segment_desc_t>()),
        ("sizeof(struct buffer_entry)", size_of::<buffer_entry>()),
        (
            "offsetof(struct buffer_entry, addr)",
            offset_of!(buffer_entry, addr),
        ),
        (
            "offsetof(struct buffer_entry, length)",
            offset_of!(buffer_entry, length),
        ),
        ("sizeof(struct nic_load_stat)", size_of::<nic_load_stat>()),
        (
            "offsetof(struct nic_load_stat, device_name)",
            offset_of!(nic_load_stat, device_name),
        ),
        (
            "offsetof(struct nic_load_stat, inflight_bytes)",
            offset_of!(nic_load_stat, inflight_bytes),
        ),
        (
            "offsetof(struct nic_load_stat, ewma_bandwidth_bps)",
            offset_of!(nic_load_stat, ewma_bandwidth_bps),
        ),
        ("sizeof(segment_id_t)", size_of::<segment_id_t>()),
        ("sizeof(segment_handle_t)", size_of::<segment_id_t>()),
        ("sizeof(batch_id_t)", size_of::<batch_id_t>()),
        ("sizeof(transfer_engine_t)", size_of::<transfer_engine_t>()),
        ("sizeof(transport_t)", size_of::<transport_t>()),
        ("(size_t)(segment_id_t)-1 == (size_t)-1", 1), // signed, as Rust's i32
        ("(size_t)(INVALID_BATCH == UINT64_MAX)", 1),
        ("(size_t)LOCAL_SEGMENT", LOCAL_SEGMENT as usize),
        ("(size_t)OPCODE_WRITE", OPCODE_WRITE as usize),
        ("(size_t)STATUS_COMPLETED", STATUS_COMPLETED as usize),
        ("(size_t)STATUS_FAILED", STATUS_FAILED as usize),
    ];
    rows.into_iter().map(|(e, v)| (e.to_string(), v)).collect()
}

/// `(C expression, Rust value)` rows for pagewire.h.
fn pagewire_rows() -> Vec<(String, usize)> {
    use std::mem::{offset_of, size_of};
    use transfer_engine::pagewire::*;
    let rows: Vec<(&str, usize)> = vec![
        ("sizeof(pw_status)", size_of::<PwStatus>()),
        ("(size_t)PW_ERR_INTERNAL", PwStatus::Internal as usize),
        (
            "(size_t)PW_ERR_REMOTE_OUT_OF_BOUNDS",
            PwStatus::RemoteOutOfBounds as usize,
        ),
        ("sizeof(pw_pool_desc)", size_of::<pw_pool_desc>()),
        (
            "offsetof(pw_pool_desc, kind)",
            offset_of!(pw_pool_desc, kind),
        ),
        (
            "offsetof(pw_pool_desc, layout)",
            offset_of!(pw_pool_desc, layout),
        ),
        (
            "offsetof(pw_pool_desc, layers)",
            offset_of!(pw_pool_desc, layers),
        ),
        (
            "offsetof(pw_pool_desc, page_size)",
            offset_of!(pw_pool_desc, page_size),
        ),
        (
            "offsetof(pw_pool_desc, heads)",
            offset_of!(pw_pool_desc, heads),
        ),
        (
            "offsetof(pw_pool_desc, head_dim)",
            offset_of!(pw_pool_desc, head_dim),
        ),
        (
            "offsetof(pw_pool_desc, v_head_dim)",
            offset_of!(pw_pool_desc, v_head_dim),
        ),
        (
            "offsetof(pw_pool_desc, kv_dim)",
            offset_of!(pw_pool_desc, kv_dim),
        ),
        (
            "offsetof(pw_pool_desc, dtype_bytes)",
            offset_of!(pw_pool_desc, dtype_bytes),
        ),
        (
            "offsetof(pw_pool_desc, capacity)",
            offset_of!(pw_pool_desc, capacity),
        ),
        (
            "offsetof(pw_pool_desc, base)",
            offset_of!(pw_pool_desc, base),
        ),
        (
            "offsetof(pw_pool_desc, v_base)",
            offset_of!(pw_pool_desc, v_base),
        ),
        (
            "offsetof(pw_pool_desc, has_v_base)",
            offset_of!(pw_pool_desc, has_v_base),
        ),
        (
            "offsetof(pw_pool_desc, checks)",
            offset_of!(pw_pool_desc, checks),
        ),
    ];
    let mut rows: Vec<(String, usize)> =
        rows.into_iter().map(|(e, v)| (e.to_string(), v)).collect();
    // Every status value of the header is the Rust enum's.
    let names = [
        "PW_OK",
        "PW_PENDING",
        "PW_ERR_INVALID_ARGUMENT",
        "PW_ERR_BAD_HANDLE",
        "PW_ERR_BUFFER_TOO_SMALL",
        "PW_ERR_CONFIG",
        "PW_ERR_BACKEND_UNAVAILABLE",
        "PW_ERR_UNSUPPORTED",
        "PW_ERR_INVALID_RANGE",
        "PW_ERR_UNREGISTERED",
        "PW_ERR_PERMISSION",
        "PW_ERR_REGION_OVERLAP",
        "PW_ERR_REGISTRATION",
        "PW_ERR_REGION_BUSY",
        "PW_ERR_REMOTE_OUT_OF_BOUNDS",
        "PW_ERR_REMOTE_PERMISSION",
        "PW_ERR_EMPTY_BATCH",
        "PW_ERR_HANDSHAKE",
        "PW_ERR_CONNECT",
        "PW_ERR_PEER_GONE",
        "PW_ERR_REMOTE_REFUSED",
        "PW_ERR_TIMEOUT",
        "PW_ERR_CANCELLED",
        "PW_ERR_DEVICE",
        "PW_ERR_IO",
        "PW_ERR_SHUTDOWN",
        "PW_ERR_LAYOUT",
        "PW_ERR_INTERNAL",
        "PW_ERR_TOO_MANY_PEERS",
    ];
    assert_eq!(names.len(), PwStatus::ALL.len());
    for (n, s) in names.iter().zip(PwStatus::ALL) {
        rows.push((format!("(size_t){n}"), s as usize));
    }
    rows
}

/// Compiles a program printing each row's C expression (with `headers` included and
/// `include_first` searched first) and compares the values with the Rust ones.
fn check_rows(
    rows: &[(String, usize)],
    headers: &[&str],
    name: &str,
    include_first: Option<&Path>,
) -> Result<()> {
    let mut c = String::from("#include <stddef.h>\n#include <stdio.h>\n");
    for h in headers {
        c += &format!("#include \"{h}\"\n");
    }
    c += "int main(void) {\n";
    for (expr, _) in rows {
        c += &format!("    printf(\"%zu\\n\", (size_t)({expr}));\n");
    }
    c += "    return 0;\n}\n";
    let dir = profile_dir()?.join("../capi-ctest");
    std::fs::create_dir_all(&dir)?;
    let src = dir.join(format!("{name}.c"));
    if std::fs::read_to_string(&src).ok().as_deref() != Some(c.as_str()) {
        std::fs::write(&src, &c)?;
    }
    let prog = compile_with(&src, name, include_first)?;
    let out = run(&prog, &[], Duration::from_secs(30))?;
    let values: Vec<usize> = out
        .lines()
        .map(|l| l.trim().parse())
        .collect::<Result<_, _>>()?;
    assert_eq!(values.len(), rows.len());
    let mut bad = Vec::new();
    for ((expr, rust), c) in rows.iter().zip(values) {
        if *rust != c {
            bad.push(format!("{expr}: C {c}, Rust {rust}"));
        }
    }
    ensure!(bad.is_empty(), "layout mismatches:\n{}", bad.join("\n"));
    Ok(())
}

#[test]
fn header_layouts_match_rust() -> Result<()> {
    let mut rows = mooncake_rows();
    rows.extend(pagewire_rows());
    check_rows(
        &rows,
        &["transfer_engine_c.h", "pagewire.h"],
        "layouts",
        None,
    )
}

// ------------------------------------------------------------------------- programs

fn two_process_env(backend: &str) -> Vec<(&'static str, String)> {
    let mut env = vec![("PAGEWIRE_TRANSPORT", backend.to_string())];
    if let Ok(d) = std::env::var("RDMA_DEVICE") {
        env.push(("PAGEWIRE_RDMA_DEVICE", d));
    }
    env
}

#[test]
fn mooncake_two_processes_tcp() -> Result<()> {
    let prog = compile(
        &crate_dir().join("tests/c/te_two_process.c"),
        "te_two_process",
    )?;
    let out = run(&prog, &two_process_env("tcp"), Duration::from_secs(120))?;
    print!("{out}");
    ensure!(out.contains("te_two_process: ok"), "{out}");
    ensure!(out.contains("backend tcp"), "{out}");
    Ok(())
}

#[test]
#[ignore = "needs an RDMA device: runs in scripts/rdma-vm.sh"]
fn mooncake_two_processes_verbs() -> Result<()> {
    // Run without a device (e.g. `--include-ignored` on a host), it fails: it never
    // passes without having run.
    ensure!(
        std::env::var("RDMA_DEVICE").is_ok_and(|d| !d.is_empty()),
        "mooncake_two_processes_verbs needs an RDMA device: set RDMA_DEVICE, or run it in \
         the soft-RoCE VM (scripts/rdma-vm.sh test -p pagewire-capi)"
    );
    let prog = compile(
        &crate_dir().join("tests/c/te_two_process.c"),
        "te_two_process",
    )?;
    let out = run(&prog, &two_process_env("verbs"), Duration::from_secs(300))?;
    print!("{out}");
    ensure!(out.contains("te_two_process: ok"), "{out}");
    ensure!(out.contains("backend verbs"), "{out}");
    Ok(())
}

/// `tests/c/te_etcd.c`: two processes with `etcd://` metadata on a real etcd (the
/// `etcd` binary, scripts/setup.sh), segments opened by registered name.
#[cfg(feature = "etcd")]
#[test]
fn mooncake_two_processes_etcd() -> Result<()> {
    let etcd = pagewire_ha::testkit::EtcdCluster::start(1);
    let prog = compile(&crate_dir().join("tests/c/te_etcd.c"), "te_etcd")?;
    let mut env = two_process_env("tcp");
    env.push(("TE_ETCD_URL", etcd.url()));
    // The address published for peers: stay on 127.0.0.1.
    env.push(("MC_TCP_BIND_ADDRESS", "127.0.0.1".into()));
    let out = run(&prog, &env, Duration::from_secs(120))?;
    print!("{out}");
    ensure!(out.contains("te_etcd: ok"), "{out}");
    Ok(())
}

#[test]
fn native_api() -> Result<()> {
    let prog = compile(&crate_dir().join("tests/c/pw_native.c"), "pw_native")?;
    let out = run(
        &prog,
        &[("PAGEWIRE_TRANSPORT", "tcp".into())],
        Duration::from_secs(60),
    )?;
    print!("{out}");
    ensure!(out.contains("pw_native: ok"), "{out}");
    Ok(())
}

/// Mooncake's own header, where one is at hand (`MOONCAKE_TE_HEADER=/path/to/
/// transfer_engine_c.h`): its 27 prototypes, redeclared after pagewire's header in one
/// translation unit, must be compatible (C refuses a redeclaration with another type),
/// and its structs must have the layouts pagewire's have. Ignored unless asked for, since
/// the header is not part of this repository; run without the variable, it fails.
#[test]
#[ignore = "needs Mooncake's transfer_engine_c.h: set MOONCAKE_TE_HEADER and pass --include-ignored"]
fn mooncake_header_agrees() -> Result<()> {
    let Ok(theirs) = std::env::var("MOONCAKE_TE_HEADER") else {
        anyhow::bail!(
            "mooncake_header_agrees needs MOONCAKE_TE_HEADER=/path/to/transfer_engine_c.h"
        );
    };
    let text = std::fs::read_to_string(&theirs)?;
    // Every function declaration of their header, as written there.
    let start = text
        .find("transfer_engine_t createTransferEngine")
        .context("createTransferEngine not found")?;
    let mut protos = String::new();
    for decl in text[start..].split(';') {
        let d = decl.trim();
        if d.contains('(') && !d.contains('{') && !d.starts_with('#') && !d.contains("}") {
            let d = d
                .lines()
                .filter(|l| !l.trim_start().starts_with("//"))
                .collect::<Vec<_>>()
                .join("\n");
            protos += &d;
            protos += ";\n";
        }
    }
    ensure!(
        protos.matches(';').count() == 27,
        "expected 27 declarations:\n{protos}"
    );
    let dir = profile_dir()?.join("../capi-ctest");
    std::fs::create_dir_all(&dir)?;
    let src = dir.join("redeclare.c");
    std::fs::write(
        &src,
        format!("#include \"transfer_engine_c.h\"\n{protos}int main(void) {{ return 0; }}\n"),
    )?;
    compile(&src, "redeclare")?;
    // Their structs, through their header, against pagewire's Rust types.
    let dir = Path::new(&theirs).parent().context("header dir")?;
    check_rows(
        &mooncake_rows(),
        &["transfer_engine_c.h"],
        "layouts_mooncake",
        Some(dir),
    )
}

/// The first ```c block of docs/c-api.md after the line "<!-- c-example -->".
#[test]
fn docs_example() -> Result<()> {
    let doc = std::fs::read_to_string(crate_dir().join("../../docs/c-api.md"))?;
    let start = doc
        .find("<!-- c-example -->")
        .context("docs/c-api.md has no <!-- c-example --> marker")?;
    let rest = &doc[start..];
    let code_start = rest
        .find("```c\n")
        .context("no ```c block after the marker")?
        + 5;
    let code_len = rest[code_start..]
        .find("\n```")
        .context("unterminated block")?;
    let code = &rest[code_start..code_start + code_len + 1];
    let dir = profile_dir()?.join("../capi-ctest");
    std::fs::create_dir_all(&dir)?;
    let src = dir.join("docs_example.c");
    if std::fs::read_to_string(&src).ok().as_deref() != Some(code) {
        std::fs::write(&src, code)?;
    }
    let prog = compile(&src, "docs_example")?;
    let out = run(
        &prog,
        &[("PAGEWIRE_TRANSPORT", "tcp".into())],
        Duration::from_secs(60),
    )?;
    print!("{out}");
    ensure!(out.contains("example: ok"), "{out}");
    Ok(())
}
