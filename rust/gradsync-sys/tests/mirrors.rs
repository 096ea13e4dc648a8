// SPDX-License-Identifier: Apache-2.0
//! What this crate copies by hand from the C headers must match them, as a C compiler reads them.
//! The test writes a C program that includes every <gradsync/*.h> and prints the value of every
//! constant this crate mirrors and the size, alignment and field offsets of every struct it
//! mirrors; it compiles it with the system's C compiler (`CC`, else `cc`), runs it, and compares.
//! It also reads the headers and this crate's source so that nothing escapes the comparison: every
//! integer constant of src/lib.rs is compared, every enum of which one value is mirrored is mirrored
//! whole (so every status code of errors.h is), and every mirrored struct has the header's fields
//! in the header's order.
use gradsync_sys::*;
use std::collections::BTreeMap;
use std::mem::{align_of, size_of, MaybeUninit};
use std::path::{Path, PathBuf};
use std::process::Command;

/// (name, value) of each constant listed.
macro_rules! constants {
    ($($name:ident),* $(,)?) => { vec![$((stringify!($name), $name as i128)),*] };
}

struct Layout {
    name: &'static str,
    size: usize,
    align: usize,
    fields: Vec<(&'static str, usize)>,
}

/// The Rust layout of each struct listed, with its fields in the order given.
macro_rules! layouts {
    ($($ty:ident { $($field:ident),* $(,)? })*) => {
        vec![$({
            let value = MaybeUninit::<$ty>::uninit();
            let base = value.as_ptr() as usize;
            Layout {
                name: stringify!($ty),
                size: size_of::<$ty>(),
                align: align_of::<$ty>(),
                // SAFETY: addr_of! on a field of an uninitialised value only computes an address.
                fields: vec![$((stringify!($field),
                                unsafe { std::ptr::addr_of!((*value.as_ptr()).$field) } as usize - base)),*],
            }
        }),*]
    };
}

fn mirrored_constants() -> Vec<(&'static str, i128)> {
    constants![
        GRADSYNC_OK, GRADSYNC_E_INVALID_ARG, GRADSYNC_E_MISUSE, GRADSYNC_E_NOMEM, GRADSYNC_E_IO,
        GRADSYNC_E_CORRUPT, GRADSYNC_E_VERSION_MISMATCH, GRADSYNC_E_MISMATCH, GRADSYNC_E_TIMEOUT,
        GRADSYNC_E_REMOTE, GRADSYNC_E_IN_PROGRESS, GRADSYNC_E_ABORTED, GRADSYNC_E_UNSUPPORTED, GRADSYNC_E_BUFS,
        GRADSYNC_E_OUT_OF_RANGE, GRADSYNC_E_ZERO_WEIGHT, GRADSYNC_E_NO_SPACE, GRADSYNC_E_NOT_OWNER,
        GRADSYNC_E_PERMISSION, GRADSYNC_E_LOST, GRADSYNC_E_INTERNAL,
        GRADSYNC_ABI_VERSION, GRADSYNC_UNSET_I32, GRADSYNC_UNSET_I64,
        GRADSYNC_F32, GRADSYNC_F64, GRADSYNC_I32, GRADSYNC_I64, GRADSYNC_BF16, GRADSYNC_F16,
        GRADSYNC_SUM, GRADSYNC_MEAN, GRADSYNC_MIN, GRADSYNC_MAX,
        GRADSYNC_OPTIM_SGD, GRADSYNC_OPTIM_ROW_ADAGRAD, GRADSYNC_OPTIM_ADAM, GRADSYNC_OPTIM_ADAMW,
        GRADSYNC_OPTIM_MOMENTUM,
        GRADSYNC_FEATURE_THREAD_TRANSPORT, GRADSYNC_FEATURE_SHM_TRANSPORT, GRADSYNC_FEATURE_MPI_TRANSPORT,
        GRADSYNC_FEATURE_F16C,
        GRADSYNC_LOG_TRACE, GRADSYNC_LOG_DEBUG, GRADSYNC_LOG_INFO, GRADSYNC_LOG_WARN, GRADSYNC_LOG_ERROR,
        GRADSYNC_LOG_CRITICAL, GRADSYNC_LOG_OFF,
        GRADSYNC_CODEC_NONE, GRADSYNC_CODEC_BIGDL_FP16, GRADSYNC_CODEC_BF16, GRADSYNC_CODEC_FP16,
        GRADSYNC_TABLE_CREATE, GRADSYNC_TABLE_OPEN, GRADSYNC_TABLE_CREATE_OR_OPEN, GRADSYNC_TABLE_ANONYMOUS,
        GRADSYNC_TABLE_INIT_ZEROS, GRADSYNC_TABLE_INIT_UNIFORM, GRADSYNC_TABLE_OPTIONS_VERSION,
        GRADSYNC_ACCUM_STRIPED, GRADSYNC_ACCUM_LOCK_FREE, GRADSYNC_ACCUM_NONE, GRADSYNC_ACCUM_OWNER,
        GRADSYNC_ACCUM_OPTIONS_VERSION, GRADSYNC_OPTIMIZER_VERSION,
        GRADSYNC_TRANSPORT_THREAD, GRADSYNC_TRANSPORT_SHM, GRADSYNC_TRANSPORT_MPI, GRADSYNC_TRANSPORT_HIER,
        GRADSYNC_COMM_OPTIONS_VERSION, GRADSYNC_SPLIT_NONE, GRADSYNC_COMM_NAME_MAX, GRADSYNC_NO_TIMEOUT,
        GRADSYNC_GROW_RESULT_VERSION,
        GRADSYNC_MAX_FUSED_BUFFERS,
        GRADSYNC_SHARD_SGD, GRADSYNC_SHARD_MOMENTUM, GRADSYNC_SHARD_ADAM, GRADSYNC_SHARD_ADAMW,
        GRADSYNC_SHARD_WEIGHTS, GRADSYNC_SHARD_GRADIENT, GRADSYNC_SHARD_STATE1, GRADSYNC_SHARD_STATE2,
        GRADSYNC_SHARD_OPTIONS_VERSION,
        GRADSYNC_EMBEDDING_CONTIGUOUS, GRADSYNC_EMBEDDING_HASH, GRADSYNC_EMBEDDING_KEEP_SHARDING,
        GRADSYNC_EMBEDDING_OPTIONS_VERSION,
    ]
}

fn mirrored_layouts() -> Vec<Layout> {
    layouts! {
        gradsync_comm_options {
            struct_size, version, transport, rank, size, deterministic, check_mismatch, reserved0, timeout_ms,
            mpi_fcomm, name, host, topology_independent, reserved1, threads, thread,
        }
        gradsync_grow_result { struct_size, version, old_size, new_size, first_member_id, agree_ns, form_ns }
        gradsync_table_options {
            struct_size, version, mode, read_only, rows, dim, dtype, init, seed, lo, hi, file_mode,
            allow_other_owner,
        }
        gradsync_accum_options {
            struct_size, version, mode, concurrency, rows, dim, rows_per_lock, threads, file_mode,
            allow_other_owner,
        }
        gradsync_optimizer { struct_size, version, kind, reserved0, lr, eps, beta1, beta2 }
        gradsync_shard_options {
            struct_size, version, optimizer, compress, error_feedback, clamp, lr, momentum, beta1, beta2, eps,
            weight_decay, clamp_min, clamp_max, clip_norm, replicas, reserved0,
        }
        gradsync_embedding_options {
            struct_size, version, rows, dim, sharding, optimizer, lr, eps, init, threads, seed, lo, hi, beta1,
            beta2, replicas, reserved0,
        }
    }
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("..")
}

/// The public headers, include/gradsync/*.h.
fn header_paths() -> Vec<PathBuf> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(root().join("include").join("gradsync"))
        .expect("include/gradsync")
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().map_or(false, |e| e == "h"))
        .collect();
    paths.sort();
    paths
}

/// Every header's text with its comments removed.
fn headers() -> String {
    let mut text = String::new();
    for path in header_paths() {
        text.push_str(&without_comments(&std::fs::read_to_string(&path).unwrap()));
        text.push('\n');
    }
    text
}

fn without_comments(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    loop {
        let block = rest.find("/*");
        let line = rest.find("//");
        match (block, line) {
            (Some(b), l) if l.map_or(true, |l| b < l) => {
                out.push_str(&rest[..b]);
                rest = rest[b..].find("*/").map_or("", |end| &rest[b + end + 2..]);
            }
            (_, Some(l)) => {
                out.push_str(&rest[..l]);
                rest = rest[l..].find('\n').map_or("", |end| &rest[l + end..]);
            }
            _ => {
                out.push_str(rest);
                return out;
            }
        }
    }
}

/// The body between `typedef <kind> <name> {` and `} <name>;`.
fn typedef_body<'a>(headers: &'a str, kind: &str, name: &str) -> Option<&'a str> {
    let start = headers.find(&format!("typedef {} {} {{", kind, name))?;
    let body = &headers[start..];
    let open = body.find('{')? + 1;
    let close = body.find(&format!("}} {};", name))?;
    Some(&body[open..close])
}

/// The field names of a struct of the headers, in order (`type name;` or `char name[N];`).
fn c_fields(headers: &str, name: &str) -> Vec<String> {
    let body = typedef_body(headers, "struct", name).unwrap_or_else(|| panic!("no typedef struct {} in the headers", name));
    body.split(';')
        .map(str::trim)
        .filter(|decl| !decl.is_empty())
        .map(|decl| {
            let declarator = decl.split_whitespace().last().unwrap();
            declarator.split('[').next().unwrap().to_string()
        })
        .collect()
}

/// Each `typedef enum` of the headers: its name and its enumerators' names.
fn c_enums(headers: &str) -> Vec<(String, Vec<String>)> {
    let mut enums = Vec::new();
    let mut rest = headers;
    while let Some(at) = rest.find("typedef enum ") {
        let after = &rest[at + "typedef enum ".len()..];
        let name = after.split_whitespace().next().unwrap().to_string();
        let body = typedef_body(rest, "enum", &name).unwrap_or_else(|| panic!("enum {}: no body", name));
        let names = body
            .split(',')
            .map(|item| item.split('=').next().unwrap().trim().to_string())
            .filter(|item| !item.is_empty())
            .collect();
        enums.push((name, names));
        rest = after;
    }
    enums
}

/// What the C compiler makes of the headers: "const NAME value", "size T n", "align T n" and
/// "offset T.field n" lines, parsed into one map.
fn c_view(constants: &[(&str, i128)], layouts: &[Layout]) -> BTreeMap<String, i128> {
    let mut program = String::from("#include <stddef.h>\n#include <stdio.h>\n");
    for path in header_paths() {
        program.push_str(&format!("#include <gradsync/{}>\n", path.file_name().unwrap().to_str().unwrap()));
    }
    program.push_str("int main(void) {\n");
    for (name, _) in constants {
        program.push_str(&format!("  printf(\"const {0} %lld\\n\", (long long)({0}));\n", name));
    }
    for layout in layouts {
        let t = layout.name;
        program.push_str(&format!("  printf(\"size {0} %zu\\n\", sizeof({0}));\n", t));
        // C99 has no _Alignof: the offset of a member placed after one char is its alignment.
        program.push_str(&format!("  printf(\"align {0} %zu\\n\", offsetof(struct {{ char c; {0} t; }}, t));\n", t));
        for (field, _) in &layout.fields {
            program.push_str(&format!("  printf(\"offset {0}.{1} %zu\\n\", offsetof({0}, {1}));\n", t, field));
        }
    }
    program.push_str("  return 0;\n}\n");

    let dir = std::env::temp_dir().join(format!("gradsync-sys-mirrors-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let source = dir.join("mirrors.c");
    let binary = dir.join("mirrors");
    std::fs::write(&source, program).unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let compiled = Command::new(&cc)
        .args(["-std=c99", "-Wall", "-Werror", "-I"])
        .arg(root().join("include"))
        .arg("-I")
        .arg(env!("GRADSYNC_BUILD_INCLUDE_DIR"))
        .arg(&source)
        .arg("-o")
        .arg(&binary)
        .output()
        .unwrap_or_else(|e| panic!("{}: {}", cc, e));
    assert!(
        compiled.status.success(),
        "the C program that reads the headers does not compile (a name this crate mirrors is not in them?):\n{}",
        String::from_utf8_lossy(&compiled.stderr)
    );
    let ran = Command::new(&binary).output().unwrap();
    std::fs::remove_dir_all(&dir).ok();
    assert!(ran.status.success());
    String::from_utf8(ran.stdout)
        .unwrap()
        .lines()
        .map(|line| {
            let mut words = line.split(' ');
            let key = format!("{} {}", words.next().unwrap(), words.next().unwrap());
            (key, words.next().unwrap().parse::<i128>().unwrap())
        })
        .collect()
}

#[test]
fn constants_and_layouts_match_the_c_headers() {
    let constants = mirrored_constants();
    let layouts = mirrored_layouts();
    let c = c_view(&constants, &layouts);
    let mut differ = Vec::new();
    for (name, value) in &constants {
        let key = format!("const {}", name);
        if c[&key] != *value {
            differ.push(format!("{} is {} in C, {} here", name, c[&key], value));
        }
    }
    for layout in &layouts {
        for (what, value) in [("size", layout.size), ("align", layout.align)] {
            let key = format!("{} {}", what, layout.name);
            if c[&key] != value as i128 {
                differ.push(format!("{} of {} is {} in C, {} here", what, layout.name, c[&key], value));
            }
        }
        for (field, offset) in &layout.fields {
            let key = format!("offset {}.{}", layout.name, field);
            if c[&key] != *offset as i128 {
                differ.push(format!("{}.{} is at offset {} in C, {} here", layout.name, field, c[&key], offset));
            }
        }
    }
    assert!(differ.is_empty(), "the Rust mirrors differ from the C headers:\n  {}", differ.join("\n  "));
}

#[test]
fn every_mirror_is_compared() {
    let headers = headers();
    let constants = mirrored_constants();
    let compared: Vec<&str> = constants.iter().map(|(name, _)| *name).collect();
    let mut missing = Vec::new();

    // Every integer constant of src/lib.rs is in mirrored_constants().
    let lib = without_comments(include_str!("../src/lib.rs"));
    for line in lib.lines() {
        let line = line.trim();
        if let Some(rest) = line.strip_prefix("pub const ") {
            let (name, ty) = rest.split_once(':').unwrap();
            let ty = ty.trim().split(|c: char| c == ' ' || c == '=').next().unwrap();
            let integer = ["c_int", "i32", "i64", "u32", "u64", "usize"].contains(&ty);
            if integer && !compared.contains(&name) {
                missing.push(format!("src/lib.rs's {} is not compared with C (add it to mirrored_constants)", name));
            }
        }
    }
    // An enum of the headers is mirrored whole or not at all; the status codes are mirrored.
    let enums = c_enums(&headers);
    assert!(enums.iter().any(|(name, _)| name == "gradsync_status"), "no enum gradsync_status in errors.h");
    for (name, values) in &enums {
        let mirrored = values.iter().filter(|v| compared.contains(&v.as_str())).count();
        if mirrored > 0 || name == "gradsync_status" {
            for value in values.iter().filter(|v| !compared.contains(&v.as_str())) {
                missing.push(format!("{}'s {} has no mirror", name, value));
            }
        }
    }
    // Every mirrored struct has the header's fields, in order; every struct of src/lib.rs is mirrored.
    let layouts = mirrored_layouts();
    for layout in &layouts {
        let ours: Vec<&str> = layout.fields.iter().map(|(f, _)| *f).collect();
        let theirs = c_fields(&headers, layout.name);
        if ours != theirs {
            missing.push(format!("{}: fields {:?} here, {:?} in the header", layout.name, ours, theirs));
        }
    }
    for line in lib.lines() {
        if let Some(rest) = line.trim().strip_prefix("pub struct gradsync_") {
            let name = format!("gradsync_{}", rest.split(|c: char| !c.is_alphanumeric() && c != '_').next().unwrap());
            if !layouts.iter().any(|l| l.name == name) {
                missing.push(format!("src/lib.rs's struct {} is not compared with C (add it to mirrored_layouts)", name));
            }
        }
    }
    assert!(missing.is_empty(), "mirrors the comparison does not cover:\n  {}", missing.join("\n  "));
}
