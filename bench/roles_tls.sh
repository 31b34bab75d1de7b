#!/bin/bash
# The cost of TLS between roles (issue 18): a site of one metadata node, one bookie and one
# broker as separate processes on loopback, plaintext and with [tls], alternating, fresh data
# directories for every run. The broker reaches the bookie and the store over TCP here (a
# standalone would reach its bookie in-process, where TLS never applies).
#
#   B=path/to/meridian A=path/to/meridian-admin [DIR=/var/tmp/meridian-rtls] \
#   [RUNS=2] [SECONDS_PER_RUN=10] [PART=max|lat|all] bench/roles_tls.sh
#
# max: `perf produce` as fast as possible (batched, 1 KiB); lat: 10,000 msg/s unbatched, publish
# latency over whole runs from a fresh site.
B=${B:?meridian binary}; A=${A:?meridian-admin binary}
D=${DIR:-/var/tmp/meridian-rtls}; mkdir -p $D
S=${SECONDS_PER_RUN:-10}
PKI=$D/pki
if [ ! -f $PKI/ca.pem ]; then
  $A site-tls create-ca --site bench --out-dir $PKI > /dev/null
  $A site-tls create-cert --role metadata --name 1 --ca-dir $PKI --out-dir $PKI --san-ip 127.0.0.1 > /dev/null
  $A site-tls create-cert --role bookie --name bk1 --ca-dir $PKI --out-dir $PKI --san-ip 127.0.0.1 > /dev/null
  $A site-tls create-cert --role broker --name b1 --ca-dir $PKI --out-dir $PKI --san-ip 127.0.0.1 > /dev/null
fi
tls_env() { # role-name
  if [ "$MODE" = tls ]; then
    echo "MERIDIAN_TLS_CERT_FILE=$PKI/$1.pem MERIDIAN_TLS_KEY_FILE=$PKI/$1.key MERIDIAN_TLS_CA_FILE=$PKI/ca.pem"
  fi
}
start_site() {
  rm -rf $D/site; mkdir -p $D/site
  env $(tls_env metadata-1) $B metadata --node-id 1 --listen 127.0.0.1:17101 --data-dir $D/site/m \
    --initial-members 1=127.0.0.1:17101 > $D/site/m.log 2>&1 & echo $! > $D/m.pid
  sleep 1.5
  env $(tls_env bookie-bk1) $B bookie --metadata 127.0.0.1:17101 --listen 127.0.0.1:13181 \
    --journal-dir $D/site/bk/journal --ledger-dir $D/site/bk/ledgers > $D/site/bk.log 2>&1 & echo $! > $D/bk.pid
  sleep 3
  env $(tls_env broker-b1) $B broker --metadata 127.0.0.1:17101 --listen 127.0.0.1:16750 \
    --http-listen 127.0.0.1:18750 --admin-listen 127.0.0.1:16780 > $D/site/b.log 2>&1 & echo $! > $D/b.pid
  sleep 2
}
stop_site() {
  for p in b bk m; do
    kill -TERM $(cat $D/$p.pid) 2>/dev/null
    while kill -0 $(cat $D/$p.pid) 2>/dev/null; do sleep 0.2; done
  done
  rm -rf $D/site
}
# CPU time of the site's three processes (broker, bookie, metadata node), clock ticks: on this
# shared VM it is steadier than the rate, so each run also prints it per message.
cpu_ticks() {
  local t=0
  for p in b bk m; do t=$((t + $(awk '{print $14 + $15}' /proc/$(cat $D/$p.pid)/stat))); done
  echo $t
}
# Runs `meridian perf produce ARGS` on the site; prints its summary, the site's CPU per message
# and the load average.
measure() {
  local t0 out msgs ticks
  t0=$(cpu_ticks)
  out=$($B perf produce --url pulsar://127.0.0.1:16750 --report-every 100 "$@" | grep "summary produce")
  ticks=$(( $(cpu_ticks) - t0 ))
  msgs=$(echo "$out" | head -1 | awk '{print $3}')
  echo "$out"
  echo "  site CPU $(( ticks * (1000000000 / $(getconf CLK_TCK)) / msgs )) ns/msg; load $(cut -d' ' -f1-3 /proc/loadavg)"
}
RUNS=${RUNS:-2}
if [ "${PART:-all}" = all ] || [ "$PART" = max ]; then
for r in $(seq $RUNS); do
  for MODE in plain tls; do
    start_site; echo -n "max publish, run $r, $MODE ($(grep -o 'tls=[a-z]*' $D/site/m.log | head -1)): "
    measure --topic max --seconds $S
    stop_site
  done
done
fi
if [ "${PART:-all}" = all ] || [ "$PART" = lat ]; then
for r in $(seq $RUNS); do
  for MODE in plain tls; do
    start_site; echo -n "10,000 msg/s unbatched, run $r, $MODE ($(grep -o 'tls=[a-z]*' $D/site/m.log | head -1)): "
    measure --topic lat --rate 10000 --batch-max-messages 1 --seconds $S --warmup-seconds 0
    stop_site
  done
done
fi
