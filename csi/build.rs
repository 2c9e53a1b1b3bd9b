//! Generates the `csi.v1` protobuf and gRPC code from proto/csi.proto, and a `Debug`
//! for every message with a field marked `csi_secret` that prints such fields as
//! `<redacted>` (CSI spec.md "Secrets Requirements": secrets must not be logged).

use std::fmt::Write as _;

fn main() {
    // A protoc shipped as a crate, so a fresh machine needs no system package.
    let protoc = protoc_bin_vendored::protoc_bin_path().expect("vendored protoc");
    let include = protoc_bin_vendored::include_path().expect("vendored protoc's include directory");
    // SAFETY: build scripts are single-threaded, so no other thread reads the
    // environment while it changes.
    #[allow(unsafe_code)]
    unsafe {
        std::env::set_var("PROTOC", protoc)
    };
    println!("cargo:rerun-if-changed=proto/csi.proto");
    let proto = std::fs::read_to_string("proto/csi.proto").expect("read proto/csi.proto");
    let secret_messages = messages_with_secrets(&proto);
    assert!(!secret_messages.is_empty(), "csi.proto marks no field csi_secret: the parser below is broken");
    let mut config = tonic_prost_build::configure();
    let mut debug_impls = String::new();
    for m in &secret_messages {
        config = config.skip_debug([format!("csi.v1.{}", m.name)]);
        let _ = writeln!(debug_impls, "impl ::core::fmt::Debug for {} {{", m.name);
        let _ =
            writeln!(debug_impls, "    fn fmt(&self, f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {{");
        let _ = writeln!(debug_impls, "        f.debug_struct(\"{}\")", m.name);
        for (field, secret) in &m.fields {
            if *secret {
                let _ = writeln!(
                    debug_impls,
                    "            .field(\"{field}\", &format_args!(\"<redacted: {{}} entries>\", self.{field}.len()))"
                );
            } else {
                let _ = writeln!(debug_impls, "            .field(\"{field}\", &self.{})", rust_field(field));
            }
        }
        let _ = writeln!(debug_impls, "            .finish()\n    }}\n}}");
    }
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    std::fs::write(out.join("csi_redacted_debug.rs"), debug_impls).expect("write the redacted Debug impls");
    config
        .compile_protos(&[std::path::PathBuf::from("proto/csi.proto")], &[std::path::PathBuf::from("proto"), include])
        .expect("compile csi.proto");
}

/// A top-level message that holds at least one `csi_secret` field.
struct Message {
    name: String,
    /// Every direct field (oneofs by their name) and whether it is a secret.
    fields: Vec<(String, bool)>,
}

/// The field's name as prost spells it (a Rust keyword gets `r#`).
fn rust_field(name: &str) -> String {
    match name {
        "type" | "ref" | "mod" | "match" | "move" | "fn" | "struct" | "self" => format!("r#{name}"),
        _ => name.to_string(),
    }
}

/// Finds the top-level messages with `csi_secret` fields. Statements are read up to
/// their `;` or `{`, so a field whose options wrap onto the next line counts; nested
/// messages and enums are skipped, a oneof counts as one field.
fn messages_with_secrets(proto: &str) -> Vec<Message> {
    let text: String = proto.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join(" ");
    let mut out = Vec::new();
    let mut depth = 0usize;
    let mut current: Option<Message> = None;
    let mut stmt = String::new();
    for ch in text.chars() {
        match ch {
            '{' => {
                let s = stmt.trim().to_string();
                stmt.clear();
                if depth == 0 {
                    if let Some(name) = s.strip_prefix("message ") {
                        current = Some(Message { name: name.trim().to_string(), fields: Vec::new() });
                    }
                } else if depth == 1 {
                    if let (Some(m), Some(name)) = (current.as_mut(), s.strip_prefix("oneof ")) {
                        m.fields.push((name.trim().to_string(), false));
                    }
                }
                depth += 1;
            }
            '}' => {
                stmt.clear();
                depth -= 1;
                if depth == 0 {
                    if let Some(m) = current.take() {
                        if m.fields.iter().any(|(_, s)| *s) {
                            out.push(m);
                        }
                    }
                }
            }
            ';' => {
                let s = stmt.trim().to_string();
                stmt.clear();
                if depth == 1 {
                    if let Some(m) = current.as_mut() {
                        if let Some((lhs, _)) = s.split_once('=') {
                            let lhs = lhs.trim();
                            if !lhs.starts_with("reserved") && !lhs.starts_with("option") {
                                let name = lhs.rsplit(char::is_whitespace).next().unwrap_or("").to_string();
                                m.fields.push((name, s.contains("(csi_secret) = true")));
                            }
                        }
                    }
                }
            }
            c => stmt.push(c),
        }
    }
    out
}
