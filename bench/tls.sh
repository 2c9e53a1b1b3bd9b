#!/usr/bin/env bash
# bench/tls.sh [reps] — the cost of NBD over TLS: fio's nbd engine (libnbd) against one
# ferrovol server (`--nbd-tls optional`, mutual TLS with certificates made here by
# openssl), each job in plain text and over TLS in the same run, the order alternating
# between reps:
#   randread-4k   4 KiB random reads, QD32, over 1 GiB of written data
#   seqread-1m    1 MiB sequential reads, QD8
# Prints IOPS (4k) or MiB/s (1m) of each and the TLS/plain ratio. Env: WORK, PORT,
# RUNTIME (seconds per job, default 15), SERVER_CPUS and CLIENT_CPUS (taskset lists:
# pin the server and fio apart, as when the client is another host).
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=${1:-3}
WORK=${WORK:-$HOME/.cache/ferrovol-bench}
PORT=${PORT:-10849}
RUNTIME=${RUNTIME:-15}
. bench/common.sh
build
D=$WORK/tls
# The credentials in /tmp: fio runs as nobody (below), who may not enter $HOME.
PKI=$(mktemp -d /tmp/ferrovol-tls-bench.XXXXXX)
rm -rf "$D"
mkdir -p "$PKI/client"
trap 'stop_server; rm -rf "$D" "$PKI"' EXIT
# A CA, the server's certificate (for 127.0.0.1), a client's (gnutls's layout, which
# libnbd's tls-certificates reads).
(
  cd "$PKI"
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj /CN=bench-ca \
    -keyout ca-key.pem -out ca.pem 2>/dev/null
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=bench-server \
    -addext subjectAltName=IP:127.0.0.1 -keyout server-key.pem -out server.csr 2>/dev/null
  openssl x509 -req -in server.csr -CA ca.pem -CAkey ca-key.pem -days 2 -copy_extensions copy \
    -out server.pem 2>/dev/null
  # X.509 v3 (with an extension): rustls refuses version 1 certificates.
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=bench-node \
    -addext extendedKeyUsage=clientAuth -keyout client/client-key.pem -out client.csr 2>/dev/null
  openssl x509 -req -in client.csr -CA ca.pem -CAkey ca-key.pem -days 2 -copy_extensions copy \
    -out client/client-cert.pem 2>/dev/null
  cp ca.pem client/ca-cert.pem
)
# fio's nbd engine (libnbd) may not name certificate files in its URI; libnbd reads
# them from $HOME/.pki/libnbd when it runs as a user, so fio runs as nobody with that
# HOME (/etc/pki/libnbd, root's default, is left alone), for both modes alike.
mkdir -p "$PKI/home/.pki"
cp -r "$PKI/client" "$PKI/home/.pki/libnbd"
chmod -R a+rX "$PKI"
AS_USER=()
if [ "$(id -u)" = 0 ]; then
  AS_USER=(setpriv --reuid=65534 --regid=65534 --clear-groups env HOME="$PKI/home")
else
  AS_USER=(env HOME="$PKI/home")
fi
CLIENT="${AS_USER[*]} ${CLIENT_CPUS:+taskset -c $CLIENT_CPUS}"
job() { # job NAME URI RW BS QD FIELD -> the figure
  $CLIENT fio --name="$1" --ioengine=nbd --uri="$2" --rw="$3" --bs="$4" --iodepth="$5" --size=1g \
    --time_based --runtime="$RUNTIME" --output-format=json |
    sed -n '/^{/,$p' | /usr/bin/python3 -c "import json,sys; r=json.load(sys.stdin)['jobs'][0]['read']; \
print(int(r['iops']) if '$6'=='iops' else round(r['bw']/1024))"
}
start_server "$D" "$PORT" --pool-size 4GiB --nbd-tls optional --tls-cert "$PKI/server.pem" \
  --tls-key "$PKI/server-key.pem" --nbd-tls-client-ca "$PKI/ca.pem"
"$BIN" --data-dir "$D" volume create v --size 2GiB >/dev/null
PLAIN=nbd://127.0.0.1:$PORT/v
TLS="nbds://127.0.0.1:$PORT/v"
$CLIENT fio --name=pre --ioengine=nbd --uri="$PLAIN" --bs=1m --iodepth=8 --rw=write --size=1g >/dev/null
# The certificates work (a TLS URI fails rather than fall back to plain text).
"${AS_USER[@]}" nbdinfo --size "$TLS" >/dev/null
for rep in $(seq "$REPS"); do
  for spec in "randread-4k randread 4k 32 iops" "seqread-1m read 1m 8 mib"; do
    set -- $spec
    if [ $((rep % 2)) = 1 ]; then
      p=$(job "$1-plain" "$PLAIN" "$2" "$3" "$4" "$5"); t=$(job "$1-tls" "$TLS" "$2" "$3" "$4" "$5")
    else
      t=$(job "$1-tls" "$TLS" "$2" "$3" "$4" "$5"); p=$(job "$1-plain" "$PLAIN" "$2" "$3" "$4" "$5")
    fi
    /usr/bin/python3 -c "import sys; n,u,p,t=sys.argv[1:]; p,t=int(p),int(t); print(f'rep $rep: {n:12} plain {p:>7} {u}  tls {t:>7} {u}  tls/plain {t/p:.2f}')" "$1" "$5" "$p" "$t"
  done
done
