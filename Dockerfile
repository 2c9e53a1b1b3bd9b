# One image for every role of ferrovol: the storage host (`ferrovol serve`), the CSI
# controller and node plugin (`ferrovol csi controller|node`) and the NBD reconnect
# watcher (`ferrovol nbd watch`). Build: docker build -t ferrovol:0.1.0 .
FROM rust:1.95-bookworm AS build
# libclang for the ublk frontend's bindings (libublk runs bindgen at build time).
RUN apt-get update \
    && apt-get install -y --no-install-recommends libclang-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# With the ublk frontend: a storage host's own volumes can be local devices
# (`volume attach-local`, and the node plugin's --local-host-socket).
RUN cargo build --release --locked --bin ferrovol --features ublk \
    && strip target/release/ferrovol

FROM debian:bookworm-slim
# What the node plugin runs: mount/umount and blkid (util-linux, mount), mkfs.ext4 and
# resize2fs (e2fsprogs), mkfs.xfs and xfs_growfs (xfsprogs); kmod for modprobe nbd.
RUN apt-get update \
    && apt-get install -y --no-install-recommends util-linux mount e2fsprogs xfsprogs kmod ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/ferrovol /usr/bin/ferrovol
ENTRYPOINT ["/usr/bin/ferrovol"]
