#!/bin/bash
# Side-by-side figures: Meridian standalone vs pulsar-lite (same client: meridian perf) vs
# NATS JetStream (its own client, bench/nats-perf). Fresh data directories for every run.
#
#   B=path/to/meridian PL=path/to/pulsar-lite NP=path/to/nats-perf [DIR=/var/tmp/sbs] \
#   [PART=max|lat|backlog] [SECONDS_PER_RUN=10] [WARMUP=0] bench/sidebyside.sh
#   B=... PL=... CP=path/to/pulsar-crate-perf PART=crate [ROUNDS=3] bench/sidebyside.sh
#
# PART=crate: the stock Rust `pulsar` crate as the client of both brokers (one batch in flight
# per producer, so a broker's round trip shows as throughput), batched 1 KiB, as fast as it
# goes and at 10,000 msg/s; before each pair, the disk's own limits (`meridian perf disk`).
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
[ "${PART:-all}" = crate ] || NP=${NP:?nats-perf binary}
D=${DIR:-/var/tmp/meridian-sbs}; mkdir -p $D
start_m() { rm -rf $D/m; $B standalone --data-dir $D/m --pulsar-listen 127.0.0.1:16700 --http-listen 127.0.0.1:18700 > $D/m.log 2>&1 & echo $! > $D/m.pid; sleep 2; }
stop_m() { kill -TERM $(cat $D/m.pid); while kill -0 $(cat $D/m.pid) 2>/dev/null; do sleep 0.2; done; rm -rf $D/m; }
start_pl() { rm -rf $D/pl*; printf '[metrics]\nenabled = false\n' > $D/pl.toml; $PL --config $D/pl.toml --addr 127.0.0.1:16701 --db-path $D/pl --log-level warn > $D/pl.log 2>&1 & echo $! > $D/pl.pid; sleep 2; }
stop_pl() { kill -TERM $(cat $D/pl.pid); while kill -0 $(cat $D/pl.pid) 2>/dev/null; do sleep 0.2; done; rm -rf $D/pl*; }
start_n() { rm -rf $D/n; nats-server -a 127.0.0.1 -p 14222 -js -sd $D/n > $D/n.log 2>&1 & echo $! > $D/n.pid; sleep 1; }
stop_n() { kill -TERM $(cat $D/n.pid); while kill -0 $(cat $D/n.pid) 2>/dev/null; do sleep 0.2; done; rm -rf $D/n; }
S=${SECONDS_PER_RUN:-10}
if [ "${PART:-all}" = all ] || [ "$PART" = max ]; then
for r in 1 2 3; do
  echo "== max publish, batched, run $r"
  start_m; echo -n "meridian:    "; $B perf produce --url pulsar://127.0.0.1:16700 --topic max --seconds $S --report-every 100 | grep "summary produce:"; stop_m
  start_pl; echo -n "pulsar-lite: "; $B perf produce --url pulsar://127.0.0.1:16701 --topic max --seconds $S --report-every 100 | grep "summary produce:"; stop_pl
  start_n; echo -n "nats (1000 in flight): "; $NP nats://127.0.0.1:14222 0 $S 1024 1000; stop_n
done
fi
if [ "${PART:-all}" = all ] || [ "$PART" = lat ]; then
for r in 1 2; do
  echo "== 10,000 msg/s, 1 KiB, unbatched, run $r"
  start_m; echo "meridian:"; $B perf e2e --url pulsar://127.0.0.1:16700 --topic lat --rate 10000 --batch-max-messages 1 --seconds $S --report-every 100 --warmup-seconds ${WARMUP:-0} --fsync-probe-dir $D | grep summary; stop_m
  start_pl; echo "pulsar-lite:"; $B perf e2e --url pulsar://127.0.0.1:16701 --topic lat --rate 10000 --batch-max-messages 1 --seconds $S --report-every 100 --warmup-seconds ${WARMUP:-0} --fsync-probe-dir $D | grep summary; stop_pl
  start_n; echo -n "nats: "; $NP nats://127.0.0.1:14222 10000 $S 1024 1000; stop_n
done
fi
if [ "${PART:-all}" = all ] || [ "$PART" = backlog ]; then
for r in 1 2; do
  echo "== catch up a 1,000,000-message backlog, run $r"
  start_m; $B perf produce --url pulsar://127.0.0.1:16700 --topic bl --messages 1000000 --seconds 0 --report-every 100 | grep "summary produce:" >/dev/null
  echo -n "meridian:    "; $B perf consume --url pulsar://127.0.0.1:16700 --topic bl --messages 1000000 --seconds 120 --report-every 100 | grep "summary consume"; stop_m
  start_pl; $B perf produce --url pulsar://127.0.0.1:16701 --topic bl --messages 1000000 --seconds 0 --report-every 100 | grep "summary produce:" >/dev/null
  echo -n "pulsar-lite: "; $B perf consume --url pulsar://127.0.0.1:16701 --topic bl --messages 1000000 --seconds 120 --report-every 100 | grep "summary consume"; stop_pl
done
fi
if [ "${PART:-all}" = crate ]; then
CP=${CP:?pulsar-crate-perf binary}
crate_m() { start_m; echo -n "meridian:    "; $CP --url pulsar://127.0.0.1:16700 "$@" | grep summary; stop_m; }
crate_pl() { start_pl; echo -n "pulsar-lite: "; $CP --url pulsar://127.0.0.1:16701 "$@" | grep summary; stop_pl; }
for r in $(seq 1 ${ROUNDS:-3}); do
  for what in max rate; do
    if [ $what = max ]; then
      echo "== Rust pulsar crate, batched 1 KiB (1,000 per batch, 1 ms delay), as fast as it goes, run $r"
      args="--topic cmax --seconds $S"
    else
      echo "== Rust pulsar crate, batched 1 KiB, 10,000 msg/s, run $r"
      args="--topic crate --rate 10000 --seconds $S"
    fi
    $B perf disk --dir $D --seconds 2 | sed 's/^summary /  /'
    if [ $((r % 2)) = 1 ]; then crate_m $args; crate_pl $args; else crate_pl $args; crate_m $args; fi
  done
done
fi
