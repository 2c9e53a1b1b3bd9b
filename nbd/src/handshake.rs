//! The fixed newstyle handshake and option haggling (proto.md, "Handshake", "Fixed
//! newstyle negotiation", "Option types", "Metadata querying").
//!
//! Lives here: the server greeting, the client-flags check, the option loop answering
//! `NBD_OPT_EXPORT_NAME`, `NBD_OPT_GO`, `NBD_OPT_INFO`, `NBD_OPT_LIST`, `NBD_OPT_ABORT`,
//! `NBD_OPT_STRUCTURED_REPLY`, `NBD_OPT_LIST_META_CONTEXT`, `NBD_OPT_SET_META_CONTEXT`
//! and `NBD_OPT_STARTTLS` with the rules of the server's TLS mode (proto.md, "TLS
//! support": NOTLS without [`ServerConfig::tls`], else SELECTIVETLS or FORCEDTLS);
//! everything else gets `NBD_REP_ERR_UNSUP`. Also the choice of transmission flags and
//! block-size limits that the transmission phase then enforces.
//! Not here: the handshake timeout (applied by `server::serve_connection`) and anything
//! after option haggling (see `transmission`).

use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::config::ServerConfig;
use crate::error::Error;
use crate::export::{BlockSizes, Client, Export, ExportFlags, ExportRegistry, Refusal};
use crate::proto::*;
use crate::slots::{ExportSlot, Live};
use crate::stream::{read_full_or_eof, Tracked};
use crate::tls::{MaybeTls, TlsMode};

/// The metadata context id given to `base:allocation` by `NBD_OPT_SET_META_CONTEXT`.
pub(crate) const BASE_ALLOCATION_ID: u32 = 1;

/// The hard upper bound on the advertised maximum block size, in bytes, whatever the
/// configuration says: keeps one READ reply within a single `NBD_REPLY_TYPE_OFFSET_DATA`
/// chunk and bounds per-request buffers.
pub(crate) const HARD_MAX_PAYLOAD: u32 = 1 << 30;

/// Block-size constraints as advertised in `NBD_INFO_BLOCK_SIZE` and enforced during
/// transmission, in bytes (proto.md, "Block size constraints").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    /// Power of two, 1 ..= 65536.
    pub minimum: u32,
    /// Power of two, at least `max(minimum, 512)`, at most `maximum`.
    pub preferred: u32,
    /// Multiple of `minimum`; at most the configured payload cap.
    pub maximum: u32,
}

impl Limits {
    /// Turns the export's wishes into constraints that satisfy the spec's rules: a
    /// nonsensical value is replaced by the nearest stricter valid one, and the maximum
    /// is capped at `max_payload` (itself capped at [`HARD_MAX_PAYLOAD`]).
    pub(crate) fn new(sizes: BlockSizes, max_payload: u32) -> Self {
        let minimum = sizes.minimum.clamp(1, 1 << 16).next_power_of_two();
        let floor = minimum.max(512);
        let cap = sizes.maximum.min(max_payload).min(HARD_MAX_PAYLOAD);
        let maximum = (cap / minimum * minimum).max(floor);
        let mut preferred = sizes.preferred.clamp(floor, 1 << 30).next_power_of_two();
        if preferred > maximum {
            // Largest power of two not above `maximum` (which is >= floor >= 512).
            preferred = (1u32 << (31 - maximum.leading_zeros())).max(floor);
        }
        Self { minimum, preferred, maximum }
    }
}

/// Everything the transmission phase needs to know about what was negotiated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Params {
    /// `NBD_OPT_STRUCTURED_REPLY` was acknowledged.
    pub structured: bool,
    /// The context id of `base:allocation`, when it was selected for this export.
    pub base_allocation: Option<u32>,
    /// The transmission flags sent to the client.
    pub transmission_flags: u16,
    /// Block-size constraints.
    pub limits: Limits,
}

/// The outcome of a successful handshake.
pub(crate) struct Negotiated<E> {
    pub export: Arc<E>,
    pub name: String,
    pub params: Params,
    /// Counts this connection against the export's cap until dropped.
    pub _slot: ExportSlot,
}

/// Transmission flags for an export (proto.md, "Transmission flags"). Flush, FUA and
/// cache are always offered (the export contract covers them); DF only with structured
/// replies, as the spec requires.
pub(crate) fn transmission_flags(flags: ExportFlags, structured: bool) -> u16 {
    let mut t = NBD_FLAG_HAS_FLAGS | NBD_FLAG_SEND_FLUSH | NBD_FLAG_SEND_FUA | NBD_FLAG_SEND_CACHE;
    if flags.read_only {
        t |= NBD_FLAG_READ_ONLY;
    }
    if flags.can_trim {
        t |= NBD_FLAG_SEND_TRIM;
    }
    if flags.can_write_zeroes {
        t |= NBD_FLAG_SEND_WRITE_ZEROES;
        if flags.can_fast_zero {
            t |= NBD_FLAG_SEND_FAST_ZERO;
        }
    }
    if flags.can_multi_conn {
        t |= NBD_FLAG_CAN_MULTI_CONN;
    }
    if structured {
        t |= NBD_FLAG_SEND_DF;
    }
    t
}

/// Answers an option naming an export the registry refused: `NBD_REP_ERR_UNKNOWN`, or
/// `NBD_REP_ERR_POLICY` with the reason.
async fn refuse<S: AsyncWrite + Unpin>(stream: &mut S, option: u32, refusal: Refusal) -> std::io::Result<()> {
    match refusal {
        Refusal::Unknown => send_final(stream, option, NBD_REP_ERR_UNKNOWN, b"no export of that name").await,
        Refusal::Denied(why) => send_final(stream, option, NBD_REP_ERR_POLICY, why.as_bytes()).await,
    }
}

/// State that options change during haggling.
#[derive(Default)]
struct Haggle {
    structured: bool,
    /// Export name given to the last successful `NBD_OPT_SET_META_CONTEXT` that selected
    /// `base:allocation`.
    meta_export: Option<String>,
}

impl Haggle {
    fn params<E: Export>(&self, export: &E, name: &str, config: &ServerConfig) -> Params {
        let base_allocation = match &self.meta_export {
            Some(n) if self.structured && n == name => Some(BASE_ALLOCATION_ID),
            _ => None,
        };
        Params {
            structured: self.structured,
            base_allocation,
            transmission_flags: transmission_flags(export.flags(), self.structured),
            limits: Limits::new(export.block_sizes(), config.max_payload),
        }
    }
}

async fn send_reply<S: AsyncWrite + Unpin>(
    stream: &mut S,
    option: u32,
    reply_type: u32,
    data: &[u8],
) -> std::io::Result<()> {
    stream.write_all(&encode_option_reply(option, reply_type, data)).await
}

async fn send_final<S: AsyncWrite + Unpin>(
    stream: &mut S,
    option: u32,
    reply_type: u32,
    data: &[u8],
) -> std::io::Result<()> {
    send_reply(stream, option, reply_type, data).await?;
    stream.flush().await
}

/// The most option data a client may send beyond `max_option_length` and still be
/// answered (`NBD_REP_ERR_TOO_BIG` or `NBD_REP_ERR_UNSUP`) rather than disconnected, in
/// bytes: the data is read and thrown away, never held.
const MAX_OPTION_DRAIN: u32 = 16 << 20;

/// The options this server implements (an oversized one of these is too big; another
/// is unsupported).
const KNOWN_OPTIONS: [u32; 9] = [
    NBD_OPT_EXPORT_NAME,
    NBD_OPT_ABORT,
    NBD_OPT_LIST,
    NBD_OPT_STARTTLS,
    NBD_OPT_INFO,
    NBD_OPT_GO,
    NBD_OPT_STRUCTURED_REPLY,
    NBD_OPT_LIST_META_CONTEXT,
    NBD_OPT_SET_META_CONTEXT,
];

/// Runs the handshake up to the transmission phase.
///
/// Returns `Ok(None)` when the client ended option haggling itself (`NBD_OPT_ABORT`, or
/// closing the connection between options), `Ok(Some(_))` after `NBD_OPT_GO` or
/// `NBD_OPT_EXPORT_NAME` succeeded, and an [`Error`] for a hard disconnect.
pub(crate) async fn handshake<R, S>(
    stream: &mut Tracked<'_, MaybeTls<S>>,
    registry: &R,
    client: &Client,
    config: &ServerConfig,
    live: &Arc<Live>,
    shutting_down: &tokio::sync::watch::Receiver<bool>,
) -> Result<Option<Negotiated<R::Export>>, Error>
where
    R: ExportRegistry,
    S: AsyncRead + AsyncWrite + Unpin,
{
    stream.write_all(&encode_greeting(NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES)).await?;
    stream.flush().await?;

    let client_flags = stream.read_u32().await?;
    // proto.md "Client flags": a flag the server does not know or did not offer ends
    // the session.
    if client_flags & !(NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES) != 0 {
        return Err(Error::protocol(format!("unknown client flags {client_flags:#x}")));
    }
    // A client without NBD_FLAG_C_FIXED_NEWSTYLE speaks the plain newstyle
    // negotiation: it sends NBD_OPT_EXPORT_NAME only, and any other option can only be
    // answered by closing (proto.md "Newstyle negotiation"; a server "MAY choose to
    // honour" fixed newstyle for it, and this one serves its NBD_OPT_EXPORT_NAME).
    let fixed = client_flags & NBD_FLAG_C_FIXED_NEWSTYLE != 0;
    let no_zeroes = client_flags & NBD_FLAG_C_NO_ZEROES != 0;

    let mut state = Haggle::default();
    // Who the client is can change once: at the start of TLS, by its certificate.
    let mut client = client.clone();
    let client = &mut client;
    loop {
        let mut header = [0u8; OPTION_HEADER_LEN];
        if !read_full_or_eof(stream, &mut header).await? {
            return Ok(None);
        }
        let header = OptionHeader::parse(&header).map_err(|e| Error::protocol(format!("option header: {e}")))?;
        let option = header.option;
        if !fixed && option != NBD_OPT_EXPORT_NAME {
            return Err(Error::protocol(format!(
                "option {option} from a client without fixed newstyle negotiation, which cannot be answered"
            )));
        }
        // Data beyond `max_option_length` is skipped, not buffered, and the option is
        // answered (proto.md "Option haggling": the server skips an option's data by
        // its length and replies) once the rules below had their say, up to
        // MAX_OPTION_DRAIN; more than that, or NBD_OPT_EXPORT_NAME, which takes no
        // error reply, is a hard disconnect.
        let too_big = header.length > config.max_option_length;
        let data = if too_big {
            if option == NBD_OPT_EXPORT_NAME || header.length > MAX_OPTION_DRAIN {
                return Err(Error::protocol(format!(
                    "option {option} carries {} bytes of data, more than the {} allowed",
                    header.length, config.max_option_length
                )));
            }
            let skipped =
                tokio::io::copy(&mut (&mut *stream).take(u64::from(header.length)), &mut tokio::io::sink()).await?;
            if skipped < u64::from(header.length) {
                return Err(Error::Io(std::io::ErrorKind::UnexpectedEof.into()));
            }
            Vec::new()
        } else {
            let mut data = vec![0u8; header.length as usize];
            stream.read_exact(&mut data).await?;
            data
        };
        tracing::trace!(option, length = header.length, "option received");

        // proto.md "Termination": a server shutting down SHOULD answer options with
        // NBD_REP_ERR_SHUTDOWN (NBD_OPT_EXPORT_NAME, which takes no error reply, ends
        // the session; NBD_OPT_ABORT is served).
        if *shutting_down.borrow() && option != NBD_OPT_ABORT {
            if option == NBD_OPT_EXPORT_NAME {
                return Err(Error::protocol("NBD_OPT_EXPORT_NAME while the server shuts down"));
            }
            send_final(stream, option, NBD_REP_ERR_SHUTDOWN, b"the server is shutting down").await?;
            continue;
        }

        // A unix-socket client is local: it is not made to use TLS (the spec lets the
        // mode depend on the connection, consistently for each).
        let tls_required =
            config.tls.as_ref().is_some_and(|t| t.mode == TlsMode::Required) && !matches!(*client, Client::Unix);
        if tls_required && !stream.inner().is_tls() && option != NBD_OPT_STARTTLS && option != NBD_OPT_ABORT {
            if option == NBD_OPT_EXPORT_NAME {
                // It cannot be answered with an error (proto.md, "FORCEDTLS mode").
                return Err(Error::protocol("NBD_OPT_EXPORT_NAME before NBD_OPT_STARTTLS, which this server requires"));
            }
            send_final(stream, option, NBD_REP_ERR_TLS_REQD, b"this server requires TLS: send NBD_OPT_STARTTLS first")
                .await?;
            continue;
        }
        if too_big && option != NBD_OPT_ABORT {
            let (reply, why): (u32, &[u8]) = if KNOWN_OPTIONS.contains(&option) {
                (NBD_REP_ERR_TOO_BIG, b"the option's data is larger than this server takes")
            } else {
                (NBD_REP_ERR_UNSUP, b"unsupported option")
            };
            send_final(stream, option, reply, why).await?;
            continue;
        }

        match option {
            NBD_OPT_EXPORT_NAME => {
                let name =
                    parse_export_name(&data).map_err(|e| Error::protocol(format!("NBD_OPT_EXPORT_NAME: {e}")))?;
                let export = match registry.lookup(&name, client) {
                    Ok(e) => e,
                    Err(Refusal::Unknown) => return Err(Error::UnknownExport(registry.shown_name(&name))),
                    Err(Refusal::Denied(why)) => return Err(Error::Denied(registry.shown_name(&name), why)),
                };
                let Some(slot) = live.enter_export(&registry.counted_as(&name), config.max_connections_per_export)
                else {
                    return Err(Error::TooManyConnections(registry.shown_name(&name)));
                };
                let params = state.params(&*export, &name, config);
                let reply = encode_export_name_reply(export.size(), params.transmission_flags, no_zeroes);
                stream.write_all(&reply).await?;
                stream.flush().await?;
                return Ok(Some(Negotiated { export, name, params, _slot: slot }));
            }
            NBD_OPT_ABORT => {
                // The client may already have closed; a failed ACK changes nothing.
                let _ = send_final(stream, option, NBD_REP_ACK, &[]).await;
                return Ok(None);
            }
            NBD_OPT_LIST => {
                if !data.is_empty() {
                    send_final(stream, option, NBD_REP_ERR_INVALID, b"NBD_OPT_LIST takes no data").await?;
                    continue;
                }
                for (name, description) in registry.list(client) {
                    send_reply(stream, option, NBD_REP_SERVER, &encode_rep_server(&name, &description)).await?;
                }
                send_final(stream, option, NBD_REP_ACK, &[]).await?;
            }
            NBD_OPT_INFO | NBD_OPT_GO => {
                if let Some(n) = info_or_go(stream, registry, client, config, live, &state, option, &data).await? {
                    return Ok(Some(n));
                }
            }
            NBD_OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    send_final(stream, option, NBD_REP_ERR_INVALID, b"NBD_OPT_STRUCTURED_REPLY takes no data").await?;
                    continue;
                }
                state.structured = true;
                send_final(stream, option, NBD_REP_ACK, &[]).await?;
            }
            NBD_OPT_LIST_META_CONTEXT | NBD_OPT_SET_META_CONTEXT => {
                meta_context(stream, registry, client, &mut state, option, &data).await?;
            }
            NBD_OPT_STARTTLS => {
                let Some(tls) = &config.tls else {
                    send_final(stream, option, NBD_REP_ERR_UNSUP, b"this server does not offer TLS").await?;
                    continue;
                };
                if stream.inner().is_tls() {
                    send_final(stream, option, NBD_REP_ERR_INVALID, b"TLS is already in use").await?;
                    continue;
                }
                if !data.is_empty() {
                    send_final(stream, option, NBD_REP_ERR_INVALID, b"NBD_OPT_STARTTLS takes no data").await?;
                    continue;
                }
                send_final(stream, option, NBD_REP_ACK, &[]).await?;
                stream.inner().start_tls(tls.source.server_config()).await.map_err(Error::Tls)?;
                if let Client::Tcp { peer, local } = *client {
                    *client = Client::Tls { peer, local, certificate: stream.inner().peer_certificate() };
                }
                // Nothing agreed in plain text, where anyone on the path could have
                // changed it, carries over into the TLS session.
                state = Haggle::default();
                tracing::debug!("TLS started");
            }
            _ => {
                send_final(stream, option, NBD_REP_ERR_UNSUP, b"unsupported option").await?;
            }
        }
    }
}

/// `NBD_OPT_INFO` and `NBD_OPT_GO`: `NBD_REP_INFO` replies (`NBD_INFO_EXPORT` and
/// `NBD_INFO_BLOCK_SIZE` always, `NBD_INFO_NAME` and `NBD_INFO_DESCRIPTION` when asked),
/// then `NBD_REP_ACK`; or one error reply. Returns the negotiated state after a
/// successful `NBD_OPT_GO`.
#[allow(clippy::too_many_arguments)]
async fn info_or_go<R, S>(
    stream: &mut S,
    registry: &R,
    client: &Client,
    config: &ServerConfig,
    live: &Arc<Live>,
    state: &Haggle,
    option: u32,
    data: &[u8],
) -> Result<Option<Negotiated<R::Export>>, Error>
where
    R: ExportRegistry,
    S: AsyncWrite + Unpin,
{
    let request = match InfoRequest::parse(data) {
        Ok(r) => r,
        Err(e) => {
            send_final(stream, option, NBD_REP_ERR_INVALID, e.to_string().as_bytes()).await?;
            return Ok(None);
        }
    };
    let export = match registry.lookup(&request.name, client) {
        Ok(e) => e,
        Err(refusal) => {
            refuse(stream, option, refusal).await?;
            return Ok(None);
        }
    };
    let params = state.params(&*export, &request.name, config);
    let slot = if option == NBD_OPT_GO {
        let Some(slot) = live.enter_export(&registry.counted_as(&request.name), config.max_connections_per_export)
        else {
            send_final(stream, option, NBD_REP_ERR_POLICY, b"too many connections to this export; try again later")
                .await?;
            return Ok(None);
        };
        Some(slot)
    } else {
        None
    };

    send_reply(stream, option, NBD_REP_INFO, &encode_info_export(export.size(), params.transmission_flags)).await?;
    if request.requests.contains(&NBD_INFO_NAME) {
        send_reply(stream, option, NBD_REP_INFO, &encode_info_string(NBD_INFO_NAME, &request.name)).await?;
    }
    if request.requests.contains(&NBD_INFO_DESCRIPTION) {
        let description = export.description();
        send_reply(stream, option, NBD_REP_INFO, &encode_info_string(NBD_INFO_DESCRIPTION, &description)).await?;
    }
    let l = params.limits;
    send_reply(stream, option, NBD_REP_INFO, &encode_info_block_size(l.minimum, l.preferred, l.maximum)).await?;
    send_final(stream, option, NBD_REP_ACK, &[]).await?;

    Ok(slot.map(|slot| Negotiated { export, name: request.name, params, _slot: slot }))
}

/// `NBD_OPT_LIST_META_CONTEXT` and `NBD_OPT_SET_META_CONTEXT` for the `base:` namespace
/// (proto.md, "The `base:` metadata namespace"): `base:allocation` is listed for no
/// queries, `base:` or `base:allocation`, and selected only by `base:allocation`; queries
/// for other namespaces or leaf names are ignored.
async fn meta_context<R, S>(
    stream: &mut S,
    registry: &R,
    client: &Client,
    state: &mut Haggle,
    option: u32,
    data: &[u8],
) -> Result<(), Error>
where
    R: ExportRegistry,
    S: AsyncWrite + Unpin,
{
    let set = option == NBD_OPT_SET_META_CONTEXT;
    if set {
        // SET replaces the previous selection, even when it fails.
        state.meta_export = None;
    }
    if !state.structured {
        send_final(stream, option, NBD_REP_ERR_INVALID, b"negotiate NBD_OPT_STRUCTURED_REPLY first").await?;
        return Ok(());
    }
    let request = match MetaContextRequest::parse(data) {
        Ok(r) => r,
        Err(e) => {
            send_final(stream, option, NBD_REP_ERR_INVALID, e.to_string().as_bytes()).await?;
            return Ok(());
        }
    };
    if let Err(refusal) = registry.lookup(&request.export_name, client) {
        refuse(stream, option, refusal).await?;
        return Ok(());
    }
    let selected = if set {
        request.queries.iter().any(|q| q == BASE_ALLOCATION)
    } else {
        request.queries.is_empty() || request.queries.iter().any(|q| q == BASE_ALLOCATION || q == "base:")
    };
    if selected {
        // LIST replies carry the reserved id 0.
        let id = if set { BASE_ALLOCATION_ID } else { 0 };
        send_reply(stream, option, NBD_REP_META_CONTEXT, &encode_meta_context(id, BASE_ALLOCATION)).await?;
        if set {
            state.meta_export = Some(request.export_name);
        }
    }
    send_final(stream, option, NBD_REP_ACK, &[]).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizes(minimum: u32, preferred: u32, maximum: u32) -> BlockSizes {
        BlockSizes { minimum, preferred, maximum }
    }

    #[test]
    fn limits_pass_valid_values_through() {
        let l = Limits::new(sizes(512, 4096, 1 << 20), 1 << 25);
        assert_eq!(l, Limits { minimum: 512, preferred: 4096, maximum: 1 << 20 });
    }

    #[test]
    fn limits_cap_the_maximum() {
        let l = Limits::new(sizes(1, 4096, u32::MAX), 1 << 25);
        assert_eq!(l, Limits { minimum: 1, preferred: 4096, maximum: 1 << 25 });
        let l = Limits::new(sizes(1, 4096, u32::MAX), u32::MAX);
        assert_eq!(l.maximum, HARD_MAX_PAYLOAD);
    }

    #[test]
    fn limits_repair_nonsense() {
        // minimum not a power of two, too large; preferred too small; maximum unaligned
        let l = Limits::new(sizes(3000, 100, 10_000), 1 << 25);
        assert_eq!(l.minimum, 4096);
        assert_eq!(l.maximum, 8192);
        assert_eq!(l.preferred, 4096);
        // preferred above the maximum comes down to it
        let l = Limits::new(sizes(512, 1 << 20, 3 * 4096), 1 << 25);
        assert_eq!(l, Limits { minimum: 512, preferred: 8192, maximum: 3 * 4096 });
        let l = Limits::new(sizes(0, 0, 0), 1 << 25);
        assert_eq!(l, Limits { minimum: 1, preferred: 512, maximum: 512 });
        let l = Limits::new(sizes(1 << 20, 1 << 20, 1 << 20), 1 << 25);
        assert_eq!(l.minimum, 1 << 16);
    }

    #[test]
    fn flags_follow_the_export() {
        let none = ExportFlags {
            read_only: false,
            can_trim: false,
            can_write_zeroes: false,
            can_fast_zero: true,
            can_multi_conn: false,
        };
        let t = transmission_flags(none, false);
        assert_eq!(t, NBD_FLAG_HAS_FLAGS | NBD_FLAG_SEND_FLUSH | NBD_FLAG_SEND_FUA | NBD_FLAG_SEND_CACHE);
        let all = ExportFlags {
            read_only: true,
            can_trim: true,
            can_write_zeroes: true,
            can_fast_zero: true,
            can_multi_conn: true,
        };
        let t = transmission_flags(all, true);
        for f in [
            NBD_FLAG_READ_ONLY,
            NBD_FLAG_SEND_TRIM,
            NBD_FLAG_SEND_WRITE_ZEROES,
            NBD_FLAG_SEND_FAST_ZERO,
            NBD_FLAG_CAN_MULTI_CONN,
            NBD_FLAG_SEND_DF,
        ] {
            assert_ne!(t & f, 0, "flag {f:#x}");
        }
    }
}
