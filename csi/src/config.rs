//! The controller's configuration file (TOML): the storage hosts it places volumes on,
//! how to reach each one's management API, and their topology. Parsed and checked
//! whole at start: a bad file is refused with its line and the reason.
//!
//! ```toml
//! # Client certificate and CA for hosts reached over TCP (mutual TLS); a host may
//! # give its own [host.tls].
//! [tls]
//! ca = "/etc/ferrovol/ca.pem"
//! cert = "/etc/ferrovol/controller.pem"
//! key = "/etc/ferrovol/controller.key"
//!
//! [[host]]
//! name = "host-a"                          # its name in logs and messages
//! api = "10.0.0.5:7401"                    # HOST:PORT (mutual TLS) or unix:///PATH
//! zone = "zone-a"                          # topology.ferrovol.io/zone (optional)
//!
//! [[host]]
//! name = "host-b"
//! api = "unix:///var/lib/ferrovol/ferrovol.sock"
//! ```
//!
//! Not here: connecting to the hosts ([`crate::hosts`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// A checked configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// The storage hosts, in the file's order (at least one; names are unique).
    pub hosts: Vec<HostConfig>,
    /// How far thin volumes may promise more than a host has: a volume of `size` bytes
    /// is placed only on a host whose room (free minus reserved bytes) times this is at
    /// least `size`. 1.0 (the default) promises no more than there is; at least 1.0.
    pub overcommit: f64,
}

/// One storage host of the configuration.
#[derive(Debug, Clone)]
pub struct HostConfig {
    /// Its name: 1 to 63 bytes of lowercase letters, digits and `-` (the value of
    /// [`crate::HOST_KEY`] in its topology).
    pub name: String,
    /// Where its management API answers.
    pub api: Api,
    /// Its zone ([`crate::ZONE_KEY`]), if given.
    pub zone: Option<String>,
    /// The line of its `[[host]]` entry in the file, for messages.
    pub line: usize,
}

impl HostConfig {
    /// Its topology segments: the zone (if any) and the host.
    pub fn segments(&self) -> BTreeMap<String, String> {
        let mut s = BTreeMap::new();
        if let Some(z) = &self.zone {
            s.insert(crate::ZONE_KEY.to_string(), z.clone());
        }
        s.insert(crate::HOST_KEY.to_string(), self.name.clone());
        s
    }
}

/// How to reach a management API.
#[derive(Debug, Clone)]
pub enum Api {
    /// The management socket of a host on this machine.
    Unix(PathBuf),
    /// `HOST:PORT` over mutual TLS with these files.
    Tls {
        /// `HOST:PORT`.
        addr: String,
        /// The client's certificate, key, and the CA of the host's certificate.
        tls: mgmt_api::ClientTls,
    },
}

impl std::fmt::Display for Api {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Api::Unix(p) => write!(f, "unix://{}", p.display()),
            Api::Tls { addr, .. } => f.write_str(addr),
        }
    }
}

/// A configuration that cannot be used: where and why.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {message}")]
pub struct ConfigError {
    /// The file (or `<text>` when parsed from a string).
    pub path: String,
    /// `line N: ...` and the reason.
    pub message: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    tls: Option<RawTls>,
    overcommit: Option<toml::Spanned<f64>>,
    #[serde(default)]
    host: Vec<toml::Spanned<RawHost>>,
}

#[derive(Deserialize, Clone)]
#[serde(deny_unknown_fields)]
struct RawTls {
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHost {
    name: String,
    api: String,
    zone: Option<String>,
    tls: Option<RawTls>,
}

impl Config {
    /// Reads and checks the file at `path`.
    ///
    /// Errors: the file cannot be read, is not TOML of the shape above (unknown keys
    /// too), or a value is wrong (see [`Config::parse`]).
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError { path: shown.clone(), message: format!("cannot read it: {e}") })?;
        Config::parse(&text, &shown)
    }

    /// Parses and checks `text`, read from `path` (for messages).
    ///
    /// Errors: no host; a host name that is not 1 to 63 bytes of `a-z`, `0-9` and `-`,
    /// or given twice; an `api` that is neither `unix:///ABSOLUTE/PATH` nor `HOST:PORT`;
    /// an `api` given twice; a TCP host without TLS files (its own `[host.tls]` or the
    /// top `[tls]`), or with files that are not absolute paths or do not load as PEM;
    /// `[host.tls]` on a unix socket; an empty zone; `overcommit` below 1.
    pub fn parse(text: &str, path: &str) -> Result<Config, ConfigError> {
        let err = |message: String| ConfigError { path: path.to_string(), message };
        let line_of = |offset: usize| text[..offset.min(text.len())].matches('\n').count() + 1;
        let raw: RawFile = toml::from_str(text).map_err(|e| {
            let at = e.span().map(|s| format!("line {}: ", line_of(s.start))).unwrap_or_default();
            err(format!("{at}{}", e.message()))
        })?;
        let overcommit = match raw.overcommit {
            None => 1.0,
            Some(o) if o.get_ref().is_finite() && *o.get_ref() >= 1.0 => *o.get_ref(),
            Some(o) => {
                return Err(err(format!(
                    "line {}: overcommit must be 1 or more, not {}",
                    line_of(o.span().start),
                    o.get_ref()
                )))
            }
        };
        if raw.host.is_empty() {
            return Err(err("no storage host: add a [[host]] entry with a name and an api address".into()));
        }
        let mut hosts: Vec<HostConfig> = Vec::new();
        for h in raw.host {
            let line = line_of(h.span().start);
            let h = h.into_inner();
            let bad = |m: String| err(format!("line {line}: host {:?}: {m}", h.name));
            let name_ok = !h.name.is_empty()
                && h.name.len() <= 63
                && h.name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !h.name.starts_with('-')
                && !h.name.ends_with('-');
            if !name_ok {
                return Err(bad(
                    "a name is 1 to 63 bytes of lowercase letters, digits and '-' (a topology value)".into()
                ));
            }
            if let Some(first) = hosts.iter().find(|o| o.name == h.name) {
                return Err(bad(format!("the name is taken by the host of line {}", first.line)));
            }
            if h.zone.as_deref() == Some("") {
                return Err(bad("zone is empty: leave it out or name the zone".into()));
            }
            if let Some(first) = hosts.iter().find(|o| o.api.to_string() == h.api) {
                return Err(bad(format!("api {} is the host {:?}'s too (line {})", h.api, first.name, first.line)));
            }
            let api = if let Some(p) = h.api.strip_prefix("unix://") {
                if !p.starts_with('/') {
                    return Err(bad(format!("api {:?}: a unix socket is unix:///ABSOLUTE/PATH", h.api)));
                }
                if h.tls.is_some() {
                    return Err(bad("[host.tls] is for hosts reached over TCP; a unix socket takes none".into()));
                }
                Api::Unix(PathBuf::from(p))
            } else {
                let port_ok = h
                    .api
                    .rsplit_once(':')
                    .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p != 0));
                if !port_ok || h.api.contains('/') {
                    return Err(bad(format!("api {:?} is neither HOST:PORT nor unix:///PATH", h.api)));
                }
                let Some(t) = h.tls.clone().or_else(|| raw.tls.clone()) else {
                    return Err(bad(format!(
                        "api {} is reached over TCP, which takes mutual TLS: give ca, cert and key in [tls] or \
                         [host.tls]",
                        h.api
                    )));
                };
                for (what, p) in [("ca", &t.ca), ("cert", &t.cert), ("key", &t.key)] {
                    if !p.is_absolute() {
                        return Err(bad(format!("tls {what} {} is not an absolute path", p.display())));
                    }
                    if !p.is_file() {
                        return Err(bad(format!("tls {what} {} is not a file", p.display())));
                    }
                }
                let tls = mgmt_api::ClientTls { ca: t.ca, cert: t.cert, key: t.key };
                tls.check().map_err(|e| bad(format!("tls files: {}", e.message())))?;
                Api::Tls { addr: h.api.clone(), tls }
            };
            hosts.push(HostConfig { name: h.name, api, zone: h.zone, line });
        }
        Ok(Config { hosts, overcommit })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_good_file_parses_with_its_lines() {
        let c = Config::parse(
            "overcommit = 2.0\n[[host]]\nname = \"a\"\napi = \"unix:///run/a.sock\"\nzone = \"z1\"\n\n[[host]]\nname = \
             \"b\"\napi = \"unix:///run/b.sock\"\n",
            "t",
        )
        .unwrap();
        assert_eq!(c.overcommit, 2.0);
        assert_eq!(c.hosts.len(), 2);
        assert_eq!(c.hosts[0].line, 2);
        assert_eq!(c.hosts[1].line, 7);
        assert_eq!(c.hosts[0].segments().get(crate::ZONE_KEY).map(String::as_str), Some("z1"));
        assert_eq!(c.hosts[1].segments().len(), 1);
    }

    #[test]
    fn bad_files_are_refused_with_line_and_reason() {
        let cases = [
            ("", "no storage host"),
            ("[[host]]\nname = \"a\"\napi = \"unix:///a\"\ncolour = \"red\"\n", "line 4: unknown field `colour`"),
            ("[[host]]\nname = \"A\"\napi = \"unix:///a\"\n", "line 1: host \"A\": a name is"),
            (
                "[[host]]\nname = \"a\"\napi = \"unix:///a\"\n[[host]]\nname = \"a\"\napi = \"unix:///b\"\n",
                "line 4: host \"a\": the name is taken by the host of line 1",
            ),
            ("[[host]]\nname = \"a\"\napi = \"unix://rel\"\n", "unix:///ABSOLUTE/PATH"),
            ("[[host]]\nname = \"a\"\napi = \"10.0.0.1\"\n", "neither HOST:PORT"),
            ("[[host]]\nname = \"a\"\napi = \"10.0.0.1:7401\"\n", "takes mutual TLS"),
            (
                "[tls]\nca = \"/nonexistent/ca\"\ncert = \"/x\"\nkey = \"/y\"\n[[host]]\nname = \"a\"\napi = \"h:1\"\n",
                "tls ca /nonexistent/ca is not a file",
            ),
            ("overcommit = 0.5\n[[host]]\nname = \"a\"\napi = \"unix:///a\"\n", "line 1: overcommit must be 1 or more"),
            ("[[host]]\nname = \"a\"\napi = \"unix:///a\"\nzone = \"\"\n", "zone is empty"),
            (
                "[[host]]\nname = \"a\"\napi = \"unix:///a\"\n[[host]]\nname = \"b\"\napi = \"unix:///a\"\n",
                "line 4: host \"b\": api unix:///a is the host \"a\"'s too (line 1)",
            ),
            (
                "[[host]]\nname = \"a\"\napi = \"unix:///a\"\n[host.tls]\nca = \"/c\"\ncert = \"/c\"\nkey = \"/k\"\n",
                "[host.tls] is for hosts reached over TCP",
            ),
            (
                "[tls]\nca = \"ca.pem\"\ncert = \"/x\"\nkey = \"/y\"\n[[host]]\nname = \"a\"\napi = \"h:1\"\n",
                "tls ca ca.pem is not an absolute path",
            ),
            (
                "[tls]\nca = \"/etc/hostname\"\ncert = \"/etc/hostname\"\nkey = \"/etc/hostname\"\n[[host]]\nname =                  \"a\"\napi = \"h:1\"\n",
                "tls files: ",
            ),
        ];
        for (text, want) in cases {
            let e = Config::parse(text, "f.toml").unwrap_err().to_string();
            assert!(e.starts_with("f.toml: ") && e.contains(want), "{text:?}: got {e:?}, want {want:?}");
        }
    }
}
