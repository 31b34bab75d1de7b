#!/bin/bash
# Side-by-side figures: Meridian standalone vs pulsar-lite (same client: meridian perf) vs
# NATS JetStream (its own client, bench/nats-perf). Fresh data directories for every run.
#
#   B=path/to/meridian PL=path/to/pulsar-lite NP=path/to/nats-perf [DIR=/var/tmp/sbs] \
#   [PART=max|lat|backlog] [SECONDS_PER_RUN=10] [WARMUP=0] bench/sidebyside.sh
#   B=... PL=... CP=path/to/pulsar-crate-perf PART=crate [ROUNDS=3] bench/sidebyside.sh
#
# NP is optional (no NATS lines without it). ROUNDS (default 3) rounds of each part; the max
# and crate parts measure the disk (`meridian perf disk`) before each round. PART=lat takes
# RATE (default 10000) and BATCH (default 1: unbatched).
#
# PART=crate: the stock Rust `pulsar` crate as the client of both brokers (one batch in flight
# per producer, so a broker's round trip shows as throughput), batched 1 KiB (CRATE_BATCH
# messages per batch, default 1000), as fast as it goes and at 10,000 msg/s; before each pair, the disk's own limits (`meridian perf disk`).
# The order of the two brokers alternates from round to round. CP: `cargo build --release -p
# meridian-integration --bin pulsar-crate-perf`.
#
# WARMUP=N leaves the first N seconds of each latency run out of its summary (`meridian perf
# --warmup-seconds`; the per-second lines show them); NATS's client has no such option.
#
# pulsar-lite: `pip download --no-deps pulsar-lite`, unzip the wheel; NATS: `apt-get install
# nats-server`; nats-perf: `cargo build --release --manifest-path bench/nats-perf/Cargo.toml`.
# Everything listens on 127.0.0.1 only.
B=${B:?meridian binary}; PL=${PL:?pulsar-lite binary}
# Without NP the NATS lines are left out.
nats() { [ -n "${NP:-}" ] || return 0; start_n; echo -n "$1"; shift; $NP "$@"; stop_n; }
D=${DIR:-/var/tmp/meridian-sbs}; mkdir -p $D
start_m() { rm -rf $D/m; $B standalone --data-dir $D/m --pulsar-listen 127.0.0.1:16700 --http-listen 127.0.0.1:18700 > $D/m.log 2>&1 & echo $! > $D/m.pid; sleep 2; }
stop_m() { kill -TERM $(cat $D/m.pid); while kill -0 $(cat $D/m.pid) 2>/dev/null; do sleep 0.2; done; rm -rf $D/m; }
start_pl() { rm -rf $D/pl*; printf '[metrics]\nenabled = false\n' > $D/pl.toml; $PL --config $D/pl.toml --addr 127.0.0.1:16701 --db-path $D/pl --log-level warn > $D/pl.log 2>&1 & echo $! > $D/pl.pid; sleep 2; }
stop_pl() { kill -TERM $(cat $D/pl.pid); while kill -0 $(cat $D/pl.pid) 2>/dev/null; do sleep 0.2; done; rm -rf $D/pl*; }
start_n() { rm -rf $D/n; nats-server -a 127.0.0.1 -p 14222 -js -sd $D/n > $D/n.log 2>&1 & echo $! > $D/n.pid; sleep 1; }
stop_n() { kill -TERM $(cat $D/n.pid); while kill -0 $(cat $D/n.pid) 2>/dev/null; do sleep 0.2; done; rm -rf $D/n; }
S=${SECONDS_PER_RUN:-10}
R=${ROUNDS:-3}
disk() { $B perf disk --dir $D --seconds 2 | sed 's/^summary /  /'; }
if [ "${PART:-all}" = all ] || [ "$PART" = max ]; then
for r in $(seq 1 $R); do
  echo "== max publish, batched, run $r"; disk
  start_m; echo -n "meridian:    "; $B perf produce --url pulsar://127.0.0.1:16700 --topic max --seconds $S --report-every 100 | grep "summary produce:"; stop_m
  start_pl; echo -n "pulsar-lite: "; $B perf produce --url pulsar://127.0.0.1:16701 --topic max --seconds $S --report-every 100 | grep "summary produce:"; stop_pl
  nats "nats (1000 in flight): " nats://127.0.0.1:14222 0 $S 1024 1000
done
fi
# Fixed rates: RATE=10000 unbatched (the default) or RATE=50000 BATCH=1000 (batched, 1 ms
# delay); Meridian's runs also print where its publishes' time went (`stage` lines).
if [ "${PART:-all}" = all ] || [ "$PART" = lat ]; then
RATE=${RATE:-10000}; BATCH=${BATCH:-1}
for r in $(seq 1 $R); do
  echo "== $RATE msg/s, 1 KiB, batches of at most $BATCH, run $r"
  lat="--topic lat --rate $RATE --batch-max-messages $BATCH --seconds $S --report-every 100 --warmup-seconds ${WARMUP:-0} --fsync-probe-dir $D"
  start_m; echo "meridian:"; $B perf e2e --url pulsar://127.0.0.1:16700 $lat --stats-http 127.0.0.1:18700 | grep "summary\|^stage"; stop_m
  start_pl; echo "pulsar-lite:"; $B perf e2e --url pulsar://127.0.0.1:16701 $lat | grep summary; stop_pl
  nats "nats: " nats://127.0.0.1:14222 $RATE $S 1024 1000
done
fi
if [ "${PART:-all}" = all ] || [ "$PART" = backlog ]; then
for r in $(seq 1 $R); do
  echo "== catch up a 1,000,000-message backlog, run $r"
  start_m; $B perf produce --url pulsar://127.0.0.1:16700 --topic bl --messages 1000000 --seconds 0 --report-every 100 | grep "summary produce:" >/dev/null
  echo -n "meridian:    "; $B perf consume --url pulsar://127.0.0.1:16700 --topic bl --messages 1000000 --seconds 120 --report-every 100 | grep "summary consume"; stop_m
  start_pl; $B perf produce --url pulsar://127.0.0.1:16701 --topic bl --messages 1000000 --seconds 0 --report-every 100 | grep "summary produce:" >/dev/null
  echo -n "pulsar-lite: "; $B perf consume --url pulsar://127.0.0.1:16701 --topic bl --messages 1000000 --seconds 120 --report-every 100 | grep "summary consume"; stop_pl
done
fi
if [ "${PART:-all}" = crate ]; then
CP=${CP:?pulsar-crate-perf binary}; CB=${CRATE_BATCH:-1000}
crate_m() { start_m; echo -n "meridian:    "; $CP --url pulsar://127.0.0.1:16700 "$@" | grep summary; stop_m; }
crate_pl() { start_pl; echo -n "pulsar-lite: "; $CP --url pulsar://127.0.0.1:16701 "$@" | grep summary; stop_pl; }
for r in $(seq 1 $R); do
  for what in max rate; do
    if [ $what = max ]; then
      echo "== Rust pulsar crate, batched 1 KiB ($CB per batch, 1 ms delay), as fast as it goes, run $r"
      args="--topic cmax --seconds $S --batch $CB"
    else
      echo "== Rust pulsar crate, batched 1 KiB ($CB per batch, 1 ms delay), 10,000 msg/s, run $r"
      args="--topic crate --rate 10000 --seconds $S --batch $CB"
    fi
    disk
    if [ $((r % 2)) = 1 ]; then crate_m $args; crate_pl $args; else crate_pl $args; crate_m $args; fi
  done
done
fi
