//! Kernel TLS (Linux `Documentation/networking/tls.rst`): a TCP socket whose TLS 1.3
//! session was set up in userspace (rustls, [`crate::client`]) is given the session's
//! keys and record sequence numbers, and from then on the kernel encrypts what is
//! written to it and decrypts what is read, for any user of the socket: the kernel's
//! NBD driver speaks TLS through it without knowing.
//!
//! Only ChaCha20-Poly1305. TLS 1.3 asks a sender to change keys (KeyUpdate) before
//! about 2^24.5 AES-GCM records (RFC 8446 section 5.5), a few minutes of a busy NBD
//! connection; kernels before 6.14 cannot take a KeyUpdate on a kernel TLS socket, and
//! the NBD driver cannot read one at all (a record that is not application data fails
//! its read), so the connection would die. ChaCha20-Poly1305's limit is beyond 2^64
//! records: no key change is ever due.
//!
//! The one module of the crate with `unsafe` (two `setsockopt` calls). Not here: the
//! handshake.

#![allow(unsafe_code)] // each block says why it is sound

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use rustls::{ConnectionTrafficSecrets, ExtractedSecrets};

/// The one cipher suite a session handed to the kernel may use (see the module's notes).
pub fn cipher_suite() -> rustls::SupportedCipherSuite {
    rustls::crypto::ring::cipher_suite::TLS13_CHACHA20_POLY1305_SHA256
}

/// Hands the session of `secrets` to the kernel on `socket` (a connected TCP socket
/// whose TLS 1.3 handshake is done and which has no TLS bytes in flight: nothing sent
/// that rustls still buffers, nothing received that it has not processed).
///
/// Errors: `Unsupported` when the kernel has no TLS (`modprobe tls`, `CONFIG_TLS`) or the
/// suite is not ChaCha20-Poly1305; any other `setsockopt` error as it comes.
pub fn enable(socket: BorrowedFd<'_>, secrets: ExtractedSecrets) -> io::Result<()> {
    let tx = crypto_info(secrets.tx)?;
    let rx = crypto_info(secrets.rx)?;
    let ulp = b"tls";
    // SAFETY: `socket` is a valid open descriptor for the call (borrowed); the option
    // value is a live 3-byte buffer whose length is passed with it.
    let r = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_TCP,
            libc::TCP_ULP,
            ulp.as_ptr().cast(),
            ulp.len() as libc::socklen_t,
        )
    };
    if r != 0 {
        let e = io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            Some(libc::ENOENT) => io::Error::new(
                io::ErrorKind::Unsupported,
                "the kernel has no TLS (load the tls module: modprobe tls; CONFIG_TLS)",
            ),
            _ => io::Error::new(e.kind(), format!("setting TCP_ULP tls: {e}")),
        });
    }
    for (dir, info) in [(libc::TLS_TX, &tx), (libc::TLS_RX, &rx)] {
        // SAFETY: as above; `info` is a live, fully initialised
        // `tls12_crypto_info_chacha20_poly1305` and its exact size is passed.
        let r = unsafe {
            libc::setsockopt(
                socket.as_raw_fd(),
                libc::SOL_TLS,
                dir,
                (info as *const libc::tls12_crypto_info_chacha20_poly1305).cast(),
                std::mem::size_of::<libc::tls12_crypto_info_chacha20_poly1305>() as libc::socklen_t,
            )
        };
        if r != 0 {
            let e = io::Error::last_os_error();
            let what = if dir == libc::TLS_TX { "TLS_TX" } else { "TLS_RX" };
            let kind = if e.raw_os_error() == Some(libc::EINVAL) { io::ErrorKind::Unsupported } else { e.kind() };
            return Err(io::Error::new(kind, format!("setting {what} (TLS 1.3, ChaCha20-Poly1305): {e}")));
        }
    }
    Ok(())
}

/// The kernel's description of one direction of the session.
fn crypto_info(
    (seq, secrets): (u64, ConnectionTrafficSecrets),
) -> io::Result<libc::tls12_crypto_info_chacha20_poly1305> {
    let ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } = secrets else {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "only a ChaCha20-Poly1305 session can be handed to the kernel",
        ));
    };
    let mut info = libc::tls12_crypto_info_chacha20_poly1305 {
        info: libc::tls_crypto_info { version: libc::TLS_1_3_VERSION, cipher_type: libc::TLS_CIPHER_CHACHA20_POLY1305 },
        iv: [0; libc::TLS_CIPHER_CHACHA20_POLY1305_IV_SIZE],
        key: [0; libc::TLS_CIPHER_CHACHA20_POLY1305_KEY_SIZE],
        salt: [0; libc::TLS_CIPHER_CHACHA20_POLY1305_SALT_SIZE],
        rec_seq: seq.to_be_bytes(),
    };
    if key.as_ref().len() != info.key.len() || iv.as_ref().len() != info.iv.len() {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "a ChaCha20-Poly1305 key or IV of the wrong length"));
    }
    info.key.copy_from_slice(key.as_ref());
    info.iv.copy_from_slice(iv.as_ref());
    Ok(info)
}
